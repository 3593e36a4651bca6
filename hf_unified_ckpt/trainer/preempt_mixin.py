"""`PreemptionMixin`: the Trainer methods through which a preemption signal ends training (`preemption/` has the
signal handling and the ranks' vote; `UnifiedCheckpointMixin` inherits this).

- the vote is started before each optimizer step (`UnifiedCheckpointCallback.on_pre_optimizer_step`) and read at the
  step boundary that follows (`_maybe_log_save_evaluate`), so it runs during the optimizer step and a signal that came
  during the forward and backward passes is honoured at the end of that same step; a signal during an evaluation or a
  save is voted on right after it; `train`'s two ends vote too (`_uc_before_first_step`, `_uc_after_training`);
- agreed: that step is logged and saved (synchronously; not evaluated), made durable, and `train` raises
  `TrainingPreempted`;
- `get_train_dataloader` / `get_eval_dataloader`: DataLoader workers drop the signals (`signals.ignore_in_workers`);
- `enable_jit_checkpoint` is taken over (or refused when preemption handling is off).
"""

from __future__ import annotations

import logging
import time

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.layout import newest_complete
from ..errors import UnsupportedCheckpointError
from ..store import join
from ..preemption.watch import PeerLost, Watch
from ..preemption.signals import ignore_in_workers
from .storage import checkpoint_root

logger = logging.getLogger(__name__)


class PreemptionMixin:
    """Trainer methods for preemption (see the module docstring); state set up by `UnifiedCheckpointMixin.train`."""

    def _uc_watch_preemption(self) -> Watch | None:
        """Preemption handling for this `train()` call, or None when it is off. Collective: all ranks call it."""
        options = self.args.unified_checkpoint_options
        if not (options.enabled and options.preemption.enabled):
            return None
        watch = Watch(options.preemption)
        watch.start()
        return watch

    def _uc_take_over_jit_checkpoint(self) -> None:
        """transformers' `enable_jit_checkpoint` saves from a timer on each rank, without the ranks agreeing on a step
        (ZeRO-3 and FSDP hang there), then lets `train()` return as if training had ended: with unified checkpoints
        it is replaced by the preemption handling (its SIGTERM handler put back, its callback removed), or refused
        when that is off."""
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback

        jit = [c for c in self.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)]
        options = self.args.unified_checkpoint_options
        if not jit or not options.enabled:
            return
        if not options.preemption.enabled:
            raise UnsupportedCheckpointError(
                "enable_jit_checkpoint=True with unified_checkpoint=True and save_on_preemption=False: transformers' "
                "JIT checkpoint saves on each rank without the ranks agreeing on a step and writes the native "
                "checkpoint. Set save_on_preemption=True (the plugin's agreed, unified save on SIGTERM), or drop "
                "enable_jit_checkpoint.")
        import signal

        for callback in jit:
            manager = getattr(callback, "jit_manager", None)
            original = getattr(manager, "_original_sigterm_handler", None)
            if manager is not None and signal.getsignal(signal.SIGTERM) == manager._sigterm_handler:
                signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)
            self.callback_handler.remove_callback(callback)
        if dist.rank() == 0:
            logger.info("enable_jit_checkpoint is handled by the unified checkpoint's preemption handling "
                        "(save_on_preemption): the ranks agree on a step, then save it unified.")

    # ---- preemption (preemption.py) ---------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, *args, **kwargs):
        """The step boundary: the ranks' vote on a preemption signal. Agreed → this step is logged and saved (not
        evaluated), then `train` raises `TrainingPreempted`. A signal during an evaluation or a save here is voted
        on right after it. Collective: all ranks call it."""
        watch = getattr(self, "_uc_preemption", None)
        if watch is None:
            return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, *args, **kwargs)
        agreed, started = self._uc_vote(watch, "at a step boundary", read=True), time.monotonic()
        if agreed:
            watch.late(self._uc_save_seconds)
            self.control.should_evaluate = False
            self.control.should_save = self._uc_preempting = True
        busy = self.control.should_evaluate or self.control.should_save
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, *args, **kwargs)
        if not agreed and busy:
            agreed, started = self._uc_vote(watch, "after an evaluation or a save", now=True), time.monotonic()
        if agreed:
            self._uc_preempted(watch, agreed, model, trial, started)

    def _uc_start_vote(self) -> None:
        """Before an optimizer step: start the vote the next step boundary reads. Collective: all ranks call it."""
        watch = getattr(self, "_uc_preemption", None)
        if watch is not None:
            self._uc_vote(watch, "before an optimizer step", start=True)

    def _uc_vote(self, watch: Watch, where: str, now: bool = False, start: bool = False, read: bool = False) -> int:
        """The agreed signal (0: none): the vote in flight `read`, a vote taken `now`, or (`start`) one started. A
        rank that cannot agree (a peer died) leaves without saving: the newest complete checkpoint stays the one
        picked. Collective: all ranks call it."""
        try:
            return watch.vote(now=now, start=start)
        except PeerLost as e:
            newest = newest_complete(checkpoint_root(self))
            raise watch.ended(watch.flag.received, self.state.global_step, newest.path if newest else None,
                              saved=False, where=f"{where}; {e}") from e

    def _uc_preempted(self, watch: Watch, number: int, model, trial, started: float) -> None:
        """Save this step's state (if not saved here already), make it durable (an async save in flight commits
        first), and raise `TrainingPreempted`. Collective: all ranks call it."""
        self._uc_preempting = True
        step = self.state.global_step
        if self._uc_saved_step != step:
            watch.late(self._uc_save_seconds)
            self._save_checkpoint(model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        self._uc_saver.wait()
        folder = join(checkpoint_root(self, trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        raise watch.ended(number, step, folder, saved=True, where="at a step boundary",
                          save_seconds=time.monotonic() - started)

    def _uc_before_first_step(self) -> None:
        """`on_train_begin`: a signal that came while the run was set up (or the resume loaded) ends it here, with
        nothing to save. Collective: all ranks call it."""
        watch = getattr(self, "_uc_preemption", None)
        if watch is not None:
            agreed = self._uc_vote(watch, "before the first step", now=True)
            if agreed:
                resumed = self._uc_resume.layout.path if getattr(self, "_uc_resume", None) else None
                raise watch.ended(agreed, self.state.global_step, resumed, saved=False, where="before the first step")

    def _uc_after_training(self, trial) -> None:
        """A signal that came after the last step boundary (the final save or evaluation, the best model's load)
        still ends the run with `TrainingPreempted`, so that nothing after `train()` runs on into the SIGKILL.
        Collective: all ranks call it."""
        watch = getattr(self, "_uc_preemption", None)
        if watch is None:
            return
        agreed = self._uc_vote(watch, "after training", now=True)
        if agreed:
            self._uc_saver.wait()
            newest = newest_complete(checkpoint_root(self, trial))
            saved = newest is not None and newest.global_step == self.state.global_step
            raise watch.ended(agreed, self.state.global_step, newest.path if newest else None, saved=saved,
                              where="after the last step")

    def get_train_dataloader(self):
        return self._uc_quiet_workers(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._uc_quiet_workers(super().get_eval_dataloader(eval_dataset))

    def _uc_quiet_workers(self, loader):
        """DataLoader workers get the preemption signals too (torchrun and SLURM signal the process group): they
        ignore them, so that the training process can save; they end with it."""
        options = self.args.unified_checkpoint_options
        if options.enabled and options.preemption.enabled:
            return ignore_in_workers(loader, options.preemption.signals)
        return loader
