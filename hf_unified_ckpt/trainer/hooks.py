"""What ties a `CheckpointSession` to its Trainer: `equip` (the checks, the session, the callback that calls it),
the per-step hooks (`SessionHooks`, a `TrainerCallback`), and the interpreter-exit hook every session's saver is
registered with (`wait_for_saves` waits for them). Used by `attach` (which also imports the mixin, to subclass it)
and by the mixin's `__init__` (which imports nothing of `attach`): no import circle between the two."""

from __future__ import annotations

import atexit
import weakref

import transformers
from transformers import TrainerCallback

from .. import dist
from ..arguments import UnifiedCheckpointFields
from ..checkpoint.save.async_save import AsyncSaver
from .session import CheckpointSession

SUPPORTED_TRANSFORMERS_MAJOR = 5
_REQUIRED_METHODS = ("train", "_prepare_for_training", "_load_from_checkpoint", "_load_rng_state",
                     "_save_checkpoint", "_get_output_dir", "_load_optimizer_and_scheduler", "store_flos", "_load_scaler", "_load_best_model",
                     "save_model", "push_to_hub", "_maybe_log_save_evaluate", "get_train_dataloader",
                     "get_eval_dataloader", "_finalize_training")


class SessionHooks(TrainerCallback):
    """The Trainer events a `CheckpointSession` needs, each handed to it: before each optimizer step the background
    save's snapshot and the EMA's copy are waited for and the preemption vote starts; after it the EMA update; the
    end of training waits for both; the beginning ends a run a preemption signal reached during its set-up."""

    def __init__(self):
        self.session: CheckpointSession | None = None

    @property
    def saver(self) -> AsyncSaver | None:
        """The session's background saver (None before `equip`)."""
        return self.session.saver if self.session is not None else None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """`CheckpointSession.before_optimizer_step`. Collective: the Trainer calls it on every rank."""
        if self.session is not None:
            self.session.before_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        """`CheckpointSession.after_optimizer_step`. Collective (after the run's first step: the background saves'
        host buffers are planned)."""
        if self.session is not None:
            self.session.after_optimizer_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        """`CheckpointSession.wait_for_background`. Local."""
        if self.session is not None:
            self.session.wait_for_background()

    def on_train_begin(self, args, state, control, **kwargs):
        """`CheckpointSession.before_first_step`. Collective: the Trainer calls it on every rank."""
        if self.session is not None:
            self.session.before_first_step()


def equip(trainer, hooks: type[SessionHooks] = SessionHooks) -> CheckpointSession:
    """Give `trainer` its `CheckpointSession` (as `trainer._uc_session`) and a callback calling it (the `SessionHooks`
    it has, else a new `hooks()` added); once: a trainer equipped already keeps its session. Registers the session's
    saver with the exit hook. `TypeError` when `trainer.args` lacks the plugin's fields; `RuntimeError` for a
    transformers the plugin does not support. Returns the session."""
    check_trainer(trainer)
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, SessionHooks)), None)
    if callback is None:
        callback = hooks()
        trainer.add_callback(callback)
    if callback.session is None:
        callback.session = CheckpointSession(trainer)
        _register_exit(callback.session.saver)
    trainer._uc_session = callback.session
    return callback.session


def check_trainer(trainer) -> None:
    """Refuse a trainer whose `args` lack the plugin's fields, or a transformers other than 5.x (or whose Trainer
    lacks a method the plugin overrides)."""
    if not isinstance(trainer.args, UnifiedCheckpointFields):
        raise TypeError(
            f"trainer.args is a {type(trainer.args).__name__} without the unified-checkpoint fields; build it with "
            "hf_unified_ckpt.UnifiedCheckpointArguments (or with_unified_checkpoint(YourConfigClass)).")
    major = int(transformers.__version__.split(".")[0])
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(trainer, m, None))]
    if major != SUPPORTED_TRANSFORMERS_MAJOR or missing:
        raise RuntimeError(
            f"hf_unified_ckpt {__import__('hf_unified_ckpt').__version__} supports transformers "
            f"{SUPPORTED_TRANSFORMERS_MAJOR}.x (found {transformers.__version__}"
            + (f", Trainer lacks {missing}" if missing else "") + ").")


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
