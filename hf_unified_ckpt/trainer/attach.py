"""`attach(trainer)` gives one Trainer instance (Trainer, SFTTrainer, DPOTrainer, ...) unified checkpoints, and
`UnifiedCheckpointCallback` does the same from `Trainer(..., callbacks=[...])`. Nothing is patched globally. Every
change made to that Trainer, all of them:

- its class: switched to `Unified<its class>` (made once per class, `chain.chained`), a subclass with
  `chain.Outermost` and `UnifiedCheckpointMixin` first in its bases and `chain.NativeStandIn` last (just above
  `transformers.Trainer`): the mixin overrides `train`, `_prepare_for_training`, `_load_best_model`,
  `_finalize_training`, `save_model`, `_maybe_log_save_evaluate`, `get_train_dataloader` and
  `get_eval_dataloader`; `Outermost` the outermost `_save_checkpoint` and `_get_output_dir`; `NativeStandIn` the
  base Trainer's `_save_checkpoint`, `_load_optimizer_and_scheduler`, `_load_from_checkpoint` and
  `_load_rng_state`, so that the class's own overrides of those run; each hands the call to the session;
- one attribute: `_uc_session`, its `CheckpointSession` (`session.py`), which holds all the plugin's state;
- one callback: a `UnifiedCheckpointCallback` added (or the one passed in `callbacks=[...]` used), which calls the
  session at `on_train_begin`, `on_pre_optimizer_step`, `on_step_end` and `on_train_end` (`hooks.SessionHooks`);
- one hook per process: `atexit` (registered once) lets every background save in flight commit, then destroys the
  process groups a script left (`hooks.wait_for_saves` waits for the same saves).

While `train()` runs, the session also changes what that run uses, and puts back what outlives it: the preemption
signal handlers (for the length of `train()`); transformers' `JITCheckpointCallback` removed and its SIGTERM handler
put back (`enable_jit_checkpoint`); DataLoader workers' `worker_init_fn` wrapped to ignore the preemption signals;
under DeepSpeed the optimizer's `step` of that engine made to wait for a background snapshot
(`engines.deepspeed.wait_before_steps`).
"""

from __future__ import annotations

import inspect

import transformers

from .chain import chained
from .hooks import SessionHooks, equip
from .mixin import UnifiedCheckpointMixin


class UnifiedCheckpointCallback(SessionHooks):
    """Gives a Trainer unified checkpoints. Either pass it to the Trainer (`callbacks=[UnifiedCheckpointCallback()]`:
    when the Trainer's `__init__` ends, the callback finds that Trainer and attaches it) or call
    `hf_unified_ckpt.attach(trainer)` (which adds it); both give the same trainer. A callback that reaches no
    Trainer (added some other way) stops `train()` before the first step with an error saying so."""

    @property
    def attached(self) -> bool:
        return self.session is not None

    @classmethod
    def attach(cls, trainer):
        return attach(trainer)

    def on_init_end(self, args, state, control, **kwargs):
        """Passed in `callbacks=[...]`: attach the Trainer whose `__init__` is ending (this instance only)."""
        if not self.attached:
            trainer = _trainer_holding(self)
            if trainer is not None:
                attach(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        """Refuse a callback that reached no Trainer; end the run here if a preemption signal came during set-up."""
        if not self.attached:
            raise RuntimeError(
                "UnifiedCheckpointCallback was added to a Trainer after its construction (add_callback), so it could "
                "not attach it and checkpoints would be written the native way. Pass it in "
                "Trainer(..., callbacks=[UnifiedCheckpointCallback()]) or call hf_unified_ckpt.attach(trainer).")
        super().on_train_begin(args, state, control, **kwargs)


def _trainer_holding(callback) -> object | None:
    """The Trainer whose `__init__` is running with `callback` among its callbacks: callbacks are not handed the
    Trainer, so look for it on the call stack (the `self` of `Trainer.__init__`, which called `on_init_end`)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = (getattr(candidate, "callback_handler", None) if isinstance(candidate, transformers.Trainer)
                       else None)
            if handler is not None and any(c is callback for c in handler.callbacks):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def attach(trainer):
    """Give `trainer` (any `transformers.Trainer` subclass instance) unified checkpoints (the changes the module
    docstring lists); returns it. Attaching it again changes nothing.

    Its `args` must carry the plugin's fields (`UnifiedCheckpointArguments`, or a config class made with
    `with_unified_checkpoint`, such as `hf_unified_ckpt.trl_configs.UnifiedSFTConfig`).
    """
    equip(trainer, UnifiedCheckpointCallback)
    if not isinstance(trainer, UnifiedCheckpointMixin):
        trainer.__class__ = chained(type(trainer), UnifiedCheckpointMixin)
    return trainer
