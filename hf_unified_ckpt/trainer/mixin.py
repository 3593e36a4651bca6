"""`UnifiedCheckpointMixin`: the Trainer methods the plugin overrides, each handing the call to the Trainer's
`CheckpointSession` (`session.py`) in a line or two, with the Trainer's own method where the session may fall back
to it:

- `train`: refuses what a save could not handle (before anything trains), resolves `resume_from_checkpoint`
  (`resume.resolve`: True -> newest *complete* checkpoint; a unified folder verified before anything is loaded);
- `_prepare_for_training`: a unified folder is loaded after the engine is prepared, then the class's own load hooks
  run with that folder; the prepared engine is described once as a save would, so its refusals come before the
  first step;
- `_finalize_training`: the save in flight committed and the memory tier's checkpoints made durable before the
  Trainer's end steps read checkpoint folders;
- `_load_best_model`: `load_best_model_at_end` from a unified checkpoint into any engine;
- `save_model`: under DeepSpeed and FSDP, weights that `from_pretrained` loads, whatever the stage or state-dict
  type (one process and DDP keep the Trainer's own);
- `_maybe_log_save_evaluate`: the step boundary, where the ranks' vote on a preemption signal is read;
- `get_train_dataloader` / `get_eval_dataloader`: DataLoader workers ignore the preemption signals.

`_save_checkpoint`, `_get_output_dir` and the base Trainer's checkpoint loads are not overridden here but by the two
classes `chain.chained` puts around the trainer's own (`chain.py`): the class's own `_save_checkpoint` chain and
load hooks run, and only the base Trainer's native writes and reads are replaced. A subclass of this mixin is
switched to its chained class when it is built.
"""

from __future__ import annotations

import contextlib
import functools

from ..arguments import UnifiedCheckpointFields
from .chain import chained
from .hooks import equip


class UnifiedCheckpointMixin:
    """Trainer mixin with the unified save and resume paths. Prefer `attach(trainer)` to subclassing, except for a
    model sharded at load time (tensor parallelism: `from_pretrained(..., tp_plan="auto")` or a
    `DistributedConfig`): `Trainer.__init__` refuses to checkpoint its optimizer state before any callback runs, so
    build it from a subclass, `class TPTrainer(UnifiedCheckpointMixin, Trainer)`, which lifts that refusal while
    the Trainer is built (unified checkpoints save every rank's shards) and equips itself as `attach` would (its
    callback is a `hooks.SessionHooks` unless a `UnifiedCheckpointCallback` was passed), its class switched to
    `chain.chained(its class)`."""

    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        with _optimizer_state_checkpointable(model, training_args):
            super().__init__(*args, **kwargs)
        equip(self)
        self.__class__ = chained(type(self))

    # ---- resume -----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, with the resume folder resolved and verified first. Collective: all ranks call it."""
        return self._uc_session.train(super().train, resume_from_checkpoint, trial,
                                      ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        return self._uc_session.prepare_for_training(super()._prepare_for_training, max_steps, train_dataloader,
                                        resume_from_checkpoint)

    def _load_best_model(self):
        return self._uc_session.load_best_model(super()._load_best_model)

    # ---- save -------------------------------------------------------------------------------------------
    def _finalize_training(self, trial, num_train_samples, start_time):
        """Collective: the in-flight save commits, the memory tier's last and best are made durable."""
        self._uc_session.end_training()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Collective under DeepSpeed and FSDP: all ranks call it, as the Trainer requires there."""
        return self._uc_session.save_model(super().save_model, output_dir, _internal_call)

    # ---- preemption -------------------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, *args, **kwargs):
        """The step boundary. Collective: all ranks call it."""
        native = functools.partial(super()._maybe_log_save_evaluate, tr_loss, grad_norm, model, trial, *args, **kwargs)
        return self._uc_session.step_boundary(native, model, trial)

    def get_train_dataloader(self):
        return self._uc_session.quiet_workers(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._uc_session.quiet_workers(super().get_eval_dataloader(eval_dataset))


@contextlib.contextmanager
def _optimizer_state_checkpointable(model, training_args):
    """While the Trainer is built: transformers refuses `save_only_model=False` for a model sharded at load time,
    because its own save keeps one rank's optimizer shards; unified checkpoints save all of them, so with
    `unified_checkpoint=True` the flag reads True during `Trainer.__init__` and is set back after."""
    lift = (isinstance(training_args, UnifiedCheckpointFields) and training_args.unified_checkpoint_options.enabled
            and not training_args.save_only_model
            and getattr(model, "is_distributed_loading_by_transformers", False))
    if lift:
        training_args.save_only_model = True
    try:
        yield
    finally:
        if lift:
            training_args.save_only_model = False
