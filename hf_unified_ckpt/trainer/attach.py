"""`attach(trainer)` gives one Trainer instance (Trainer, SFTTrainer, DPOTrainer, ...) the unified save and resume
paths by switching that instance to a subclass with `UnifiedCheckpointMixin` first in its bases, and adds a
`UnifiedCheckpointCallback` (the per-step hooks: an async save's snapshot and the EMA's copy before each optimizer
step, the EMA update after it, waiting at the end of training). Nothing is patched globally."""

from __future__ import annotations

import atexit
import inspect
import weakref

import transformers
from transformers import TrainerCallback

from .. import dist
from ..checkpoint.async_save import AsyncSaver
from .mixin import UnifiedCheckpointMixin

SUPPORTED_TRANSFORMERS_MAJOR = 5
_REQUIRED_METHODS = ("train", "_prepare_for_training", "_load_from_checkpoint", "_load_rng_state",
                     "_save_checkpoint", "_get_output_dir", "store_flos", "_load_scaler", "_load_best_model",
                     "save_model", "push_to_hub", "_maybe_log_save_evaluate", "get_train_dataloader",
                     "get_eval_dataloader", "_finalize_training")


class UnifiedCheckpointCallback(TrainerCallback):
    """Gives a Trainer unified checkpoints. Either pass it to the Trainer (`callbacks=[UnifiedCheckpointCallback()]`:
    when the Trainer's `__init__` ends, the callback finds that Trainer and attaches it) or call
    `hf_unified_ckpt.attach(trainer)` (which adds it); both give the same trainer. A callback that reaches no
    Trainer (added some other way) stops `train()` before the first step with an error saying so."""

    def __init__(self):
        self.attached = False
        self.saver: AsyncSaver | None = None
        self.trainer = None

    @classmethod
    def attach(cls, trainer):
        return attach(trainer)

    def on_init_end(self, args, state, control, **kwargs):
        """Passed in `callbacks=[...]`: attach the Trainer whose `__init__` is ending (this instance only)."""
        if not self.attached:
            trainer = _trainer_holding(self)
            if trainer is not None:
                attach(trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """An in-flight async save, and an EMA update, copy live weights (and optimizer state): the step waits
        for those copies. The ranks' vote on a preemption signal starts here (read at the step's end)."""
        if self.trainer is not None:
            self.trainer._uc_wait_for_copies()
            self.trainer._uc_start_vote()
        elif self.saver is not None:
            self.saver.wait_for_snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        """After each optimizer step: the EMA of the weights, when due (before the step's save, if any)."""
        if self.trainer is not None:
            self.trainer._uc_ema_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        """The end of training waits for the in-flight async save and EMA update, and raises their errors."""
        if self.saver is not None:
            self.saver.wait()
        if self.trainer is not None and getattr(self.trainer, "_uc_updates", None) is not None:
            self.trainer._uc_updates.wait()

    def on_train_begin(self, args, state, control, **kwargs):
        """Refuse a callback that reached no Trainer; end the run here if a preemption signal came during set-up."""
        if not self.attached:
            raise RuntimeError(
                "UnifiedCheckpointCallback was added to a Trainer after its construction (add_callback), so it could "
                "not attach it and checkpoints would be written the native way. Pass it in "
                "Trainer(..., callbacks=[UnifiedCheckpointCallback()]) or call hf_unified_ckpt.attach(trainer).")
        if self.trainer is not None:
            self.trainer._uc_before_first_step()


_SUBCLASSES: dict[type, type] = {}


def _trainer_holding(callback) -> object | None:
    """The Trainer whose `__init__` is running with `callback` among its callbacks: callbacks are not handed the
    Trainer, so look for it on the call stack (the `self` of `Trainer.__init__`, which called `on_init_end`)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None) if isinstance(candidate, transformers.Trainer) else None
            if handler is not None and any(c is callback for c in handler.callbacks):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def attach(trainer):
    """Give `trainer` (any `transformers.Trainer` subclass instance) unified checkpoints; returns it.

    Its `args` must carry the plugin's fields (`UnifiedCheckpointArguments`, or a config class made with
    `with_unified_checkpoint`, such as `hf_unified_ckpt.trl_configs.UnifiedSFTConfig`).
    """
    if getattr(trainer.args, "unified_checkpoint_options", None) is None:
        raise TypeError(
            f"trainer.args is a {type(trainer.args).__name__} without the unified-checkpoint fields; build it with "
            "hf_unified_ckpt.UnifiedCheckpointArguments (or with_unified_checkpoint(YourConfigClass)).")
    _check_transformers(trainer)
    cls = type(trainer)
    if not isinstance(trainer, UnifiedCheckpointMixin):
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Unified{cls.__name__}", (UnifiedCheckpointMixin, cls),
                                    {"__module__": cls.__module__, "__doc__": cls.__doc__})
        trainer.__class__ = _SUBCLASSES[cls]
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, UnifiedCheckpointCallback)), None)
    if callback is None:
        callback = UnifiedCheckpointCallback()
        trainer.add_callback(callback)
    callback.attached = True
    callback.trainer = trainer
    if callback.saver is None:
        callback.saver = AsyncSaver(trainer.args.unified_checkpoint_options.async_executor)
        _register_exit(callback.saver)
    trainer._uc_saver = callback.saver
    return trainer


_SAVERS: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK: list = []


def _register_exit(saver: AsyncSaver) -> None:
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(atexit.register(_at_exit))
    _SAVERS.add(saver)


def _at_exit() -> None:
    """Interpreter exit: every background save in flight commits (its error logged), then the process groups are
    destroyed if the script did not (`dist.destroy_default_group`: a `train()` that raised skipped its tear-down)."""
    for saver in list(_SAVERS):
        saver.close()
    dist.destroy_default_group()


def wait_for_saves() -> None:
    """Wait until every background save of this process (`async_save`, `flash`) has committed, raising a save's
    error. With them, `on_save` runs once the snapshot is taken, before the folder is complete: a callback that
    reads the checkpoint folder in `on_save` calls this first (with `flash` the folder committed is the memory
    one; the durable copy follows every `persist_every`-th save). Local: each rank waits for its own saves."""
    for saver in list(_SAVERS):
        saver.wait()


def _check_transformers(trainer) -> None:
    major = int(transformers.__version__.split(".")[0])
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(trainer, m, None))]
    if major != SUPPORTED_TRANSFORMERS_MAJOR or missing:
        raise RuntimeError(
            f"hf_unified_ckpt {__import__('hf_unified_ckpt').__version__} supports transformers "
            f"{SUPPORTED_TRANSFORMERS_MAJOR}.x (found {transformers.__version__}"
            + (f", Trainer lacks {missing}" if missing else "") + ").")
