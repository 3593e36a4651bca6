"""Preemption: every rank agrees, at the same step boundary, that a signal came, so they all save the same step.

A signal reaches the ranks at different moments, or only some of them (the launcher forwards it; SLURM signals
every process; when one worker crashes torchrun signals the others). Saving where the signal lands would make the
ranks enter the save's collectives at different steps (ZeRO-3 and FSDP hang there). So the handler only records it
(`signals.SignalFlag`) and the ranks vote at every step boundary: an all-reduce (max) of the signal number each
received, on a gloo group of its own. A step's vote is started before its optimizer step and read at the boundary
after it, so it runs while the optimizer steps and training hardly waits for it, and a signal that came during the
forward and backward passes is honoured at the end of that same step; `now` votes and reads at once, for the rare
boundaries after an evaluation or a save and at the ends of `train()`. Every rank starts and reads the same votes in
the same order, so all see the same outcome at the same boundary.

A rank that received a signal waits for a vote at most `agree_timeout` seconds: past that a peer is gone (killed, or
stuck), and this rank leaves without saving (`PeerLost`); the newest complete checkpoint stays the one a resume picks.
"""

from __future__ import annotations

import logging
import time

from .. import dist
from ..errors import TrainingPreempted
from ..options import PreemptionOptions
from .requeue import requeue
from .signals import SignalFlag, signal_name

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """The ranks could not agree on a preemption: a peer did not vote in time, or its connection failed."""


class Agreement:
    """Votes on `flag`. Collective at creation (its gloo group) and at every `start` / `read` / `now`: all
    ranks call them in the same order."""

    def __init__(self, flag: SignalFlag, agree_timeout: float):
        self.flag = flag
        self.agree_timeout = agree_timeout
        self._group = dist.gloo_group("preemption") if dist.is_distributed() else None
        self._pending = None

    def start(self) -> None:
        """Start a vote (none when one is in flight already). Collective: all ranks call it."""
        if self._pending is None:
            self._start()

    def read(self) -> int:
        """The signal agreed by the vote in flight (0: none, or no vote in flight). Collective: all ranks call it."""
        return self._read()

    def now(self) -> int:
        """The signal agreed by the vote in flight or, when that says none, by a vote taken now. Collective: all
        ranks call it."""
        return self._read() or (self._start(), self._read())[1]

    def drain(self, timeout: float = 0.0) -> None:
        """Forget the vote in flight, waiting up to `timeout` s for it (leaving `train()` by an exception). Local."""
        pending, self._pending = self._pending, None
        if pending is not None:
            deadline = time.monotonic() + timeout
            while not pending[0].is_completed() and time.monotonic() < deadline:
                time.sleep(0.001)

    def _start(self) -> None:
        if self._group is None:
            return
        import torch

        vote = torch.tensor([self.flag.received], dtype=torch.int32)
        work = torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, vote)

    def _read(self) -> int:
        if self._group is None:
            return self.flag.received
        if self._pending is None:
            return 0
        work, vote = self._pending
        self._wait(work)
        self._pending = None
        return int(vote.item())

    def _wait(self, work) -> None:
        """Until `work` completes; in a Python loop, so the signal handlers run meanwhile. Once this rank has a
        signal, at most `agree_timeout` s from it."""
        delay = 1e-5
        while not work.is_completed():
            if self.flag.received and self.flag.elapsed() > self.agree_timeout:
                raise PeerLost(f"no agreement within {self.agree_timeout:.0f} s of the signal: a peer did not vote "
                               "(it may have died)")
            time.sleep(delay)
            delay = min(2 * delay, 0.005)
        try:
            work.wait()
        except Exception as e:  # the group failed: a peer's connection closed
            self._pending = None
            raise PeerLost(f"the vote failed: {type(e).__name__}: {e}") from e


class Watch:
    """Preemption handling for one `train()` call: the signal handlers (installed by `start`, put back by `close`),
    the votes, and what is said and done once a preemption is agreed."""

    def __init__(self, options: PreemptionOptions):
        self.options = options
        self.flag = SignalFlag(options.signals)
        self.agreement: Agreement | None = None

    def start(self) -> None:
        """Install the handlers (said once when `train()` runs off the main thread, where none can be) and create
        the vote's group. Collective: all ranks call it."""
        if not self.flag.install() and dist.rank() == 0:
            logger.warning("train() runs off the main thread (Ray Train does this), where Python cannot install signal "
                           "handlers: preemption signals reaching this process end it as they would without the "
                           "plugin. It still takes part in the ranks' agreement on a preemption.")
        self.agreement = Agreement(self.flag, self.options.agree_timeout)

    def close(self) -> None:
        """Put the handlers back; forget a vote in flight. Local."""
        self.flag.restore()
        if self.agreement is not None:
            self.agreement.drain(timeout=1.0)

    def vote(self, now: bool = False, start: bool = False) -> int:
        """The signal the ranks agreed on (0: none): the vote in flight read, one taken `now`, or (`start`: 0
        returned) one started. Collective."""
        if start:
            self.agreement.start()
            return 0
        return self.agreement.now() if now else self.agreement.read()

    def late(self, expected_save_seconds: float | None) -> None:
        """Say (rank 0) when the save about to start may not finish before the SIGKILL that follows the signal."""
        left = self.options.grace_period - self.flag.elapsed()
        if expected_save_seconds is not None and expected_save_seconds > left and dist.rank() == 0:
            logger.warning("Preemption save: the last save took %.1f s and %.1f s of the %.0f s grace period are left; "
                           "if SIGKILL cuts it off, that save is never picked and the newest complete checkpoint "
                           "stays the one resumed (raise preemption_grace_period if the scheduler allows more).",
                           expected_save_seconds, max(left, 0.0), self.options.grace_period)

    def ended(self, number: int, step: int, checkpoint: str | None, saved: bool, where: str,
              save_seconds: float | None = None) -> TrainingPreempted:
        """The exception `train()` raises; said once (rank 0); the SLURM job requeued (rank 0) when asked."""
        name = signal_name(number) if number else "a lost peer"
        if saved:
            what = f"saved {checkpoint}" + (f" in {save_seconds:.1f} s" if save_seconds is not None else "")
        elif checkpoint:
            what = f"nothing new saved; the newest complete checkpoint is {checkpoint}"
        else:
            what = "nothing saved (there is no checkpoint yet)"
        message = (f"Training preempted by {name} at step {step} ({where}): {what}. Exiting with status "
                   f"{128 + number}; resume with train(resume_from_checkpoint='auto').")
        if dist.rank() == 0:
            logger.warning("%s", message)
            if self.options.requeue:
                requeue()
        return TrainingPreempted(message, number, step, checkpoint, saved)
