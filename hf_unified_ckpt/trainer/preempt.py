"""What a preemption signal does to a Trainer (the signal handling and the ranks' vote are `preemption/`; the
session of `session.py` owns one `PreemptionRun` per `train()` call).

- the vote is started before each optimizer step (`CheckpointSession.before_optimizer_step`, from the callback's
  `on_pre_optimizer_step`) and read at the step boundary that follows (`_maybe_log_save_evaluate`), so it runs
  during the optimizer step and a signal that came during the forward and backward passes is honoured at the end of
  that same step; a signal during an evaluation or a save is voted on right after it; `train`'s two ends vote too
  (`before_first_step`, `after_training`);
- agreed: that step is logged and saved (synchronously; not evaluated), made durable, and `train` raises
  `TrainingPreempted`;
- `enable_jit_checkpoint` is taken over (or refused when preemption handling is off).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.folder.layout import newest_complete
from ..errors import UnsupportedCheckpointError
from ..options import PreemptionOptions
from ..preemption.watch import PeerLost, Watch
from ..store import join
from .storage import checkpoint_root

logger = logging.getLogger(__name__)


class PreemptionRun:
    """Preemption handling of one `train()` call of `session`'s Trainer (see the module docstring). `agreed`: a
    preemption was agreed, so the saves from then on are synchronous."""

    def __init__(self, session, watch: Watch):
        self.session = session
        self.trainer = session.trainer
        self.watch = watch
        self.agreed = False

    @classmethod
    def start(cls, session, options: PreemptionOptions) -> PreemptionRun:
        """Install the signal handlers and create the vote's group. Collective: all ranks call it."""
        watch = Watch(options)
        watch.start()
        return cls(session, watch)

    def close(self) -> None:
        """Put the handlers back; forget a vote in flight. Local."""
        self.watch.close()

    def start_vote(self) -> None:
        """Before an optimizer step: start the vote the next step boundary reads. Collective: all ranks call it."""
        self._vote("before an optimizer step", start=True)

    def step_boundary(self, native: Callable[[], None], model, trial) -> None:
        """`_maybe_log_save_evaluate` (`native`) with the ranks' vote on a preemption signal. Agreed → this step is
        logged and saved (not evaluated), then `TrainingPreempted` is raised. A signal during an evaluation or a
        save here is voted on right after it. Collective: all ranks call it."""
        control = self.trainer.control
        agreed, started = self._vote("at a step boundary", read=True), time.monotonic()
        if agreed:
            self.watch.late(self.session.save_seconds)
            control.should_evaluate = False
            control.should_save = self.agreed = True
        busy = control.should_evaluate or control.should_save
        native()
        if not agreed and busy:
            agreed, started = self._vote("after an evaluation or a save", now=True), time.monotonic()
        if agreed:
            self._preempted(agreed, model, trial, started)

    def before_first_step(self) -> None:
        """`on_train_begin`: a signal that came while the run was set up (or the resume loaded) ends it here, with
        nothing to save. Collective: all ranks call it."""
        agreed = self._vote("before the first step", now=True)
        if agreed:
            resumed = self.session.resume.layout.path if self.session.resume is not None else None
            raise self.watch.ended(agreed, self.trainer.state.global_step, resumed, saved=False,
                                   where="before the first step")

    def after_training(self, trial) -> None:
        """A signal that came after the last step boundary (the final save or evaluation, the best model's load)
        still ends the run with `TrainingPreempted`, so that nothing after `train()` runs on into the SIGKILL.
        Collective: all ranks call it."""
        agreed = self._vote("after training", now=True)
        if agreed:
            self.session.saver.wait()
            step = self.trainer.state.global_step
            newest = newest_complete(checkpoint_root(self.trainer, trial))
            saved = newest is not None and newest.global_step == step
            raise self.watch.ended(agreed, step, newest.path if newest else None, saved=saved,
                                   where="after the last step")

    def _vote(self, where: str, now: bool = False, start: bool = False, read: bool = False) -> int:
        """The agreed signal (0: none): the vote in flight `read`, a vote taken `now`, or (`start`) one started. A
        rank that cannot agree (a peer died) leaves without saving: the newest complete checkpoint stays the one
        picked. Collective: all ranks call it."""
        try:
            return self.watch.vote(now=now, start=start)
        except PeerLost as e:
            newest = newest_complete(checkpoint_root(self.trainer))
            raise self.watch.ended(self.watch.flag.received, self.trainer.state.global_step,
                                   newest.path if newest else None, saved=False, where=f"{where}; {e}") from e

    def _preempted(self, number: int, model, trial, started: float) -> None:
        """Save this step's state (if not saved here already), make it durable (an async save in flight commits
        first), and raise `TrainingPreempted`. Collective: all ranks call it."""
        self.agreed = True
        trainer, step = self.trainer, self.trainer.state.global_step
        if self.session.saved_step != step:
            self.watch.late(self.session.save_seconds)
            trainer._save_checkpoint(model, trial)
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
        self.session.saver.wait()
        folder = join(checkpoint_root(trainer, trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        raise self.watch.ended(number, step, folder, saved=True, where="at a step boundary",
                               save_seconds=time.monotonic() - started)


def take_over_jit_checkpoint(trainer) -> None:
    """transformers' `enable_jit_checkpoint` saves from a timer on each rank, without the ranks agreeing on a step
    (ZeRO-3 and FSDP hang there), then lets `train()` return as if training had ended: with unified checkpoints it is
    replaced by the preemption handling (its SIGTERM handler put back, its callback removed), or refused when that is
    off. Local."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    jit = [c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)]
    options = trainer.args.unified_checkpoint_options
    if not jit or not options.enabled:
        return
    if not options.preemption.enabled:
        raise UnsupportedCheckpointError(
            "enable_jit_checkpoint=True with unified_checkpoint=True and save_on_preemption=False: transformers' "
            "JIT checkpoint saves on each rank without the ranks agreeing on a step and writes the native "
            "checkpoint. Set save_on_preemption=True (the plugin's agreed, unified save on SIGTERM), or drop "
            "enable_jit_checkpoint.")
    for callback in jit:
        manager = getattr(callback, "jit_manager", None)
        original = getattr(manager, "_original_sigterm_handler", None)
        if manager is not None and signal.getsignal(signal.SIGTERM) == manager._sigterm_handler:
            signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)
        trainer.callback_handler.remove_callback(callback)
    if dist.rank() == 0:
        logger.info("enable_jit_checkpoint is handled by the unified checkpoint's preemption handling "
                    "(save_on_preemption): the ranks agree on a step, then save it unified.")
