"""Preemption: every rank agrees, at the same step boundary, that a signal came, so they all save the same step.

A signal reaches the ranks at different moments, or only some of them (the launcher forwards it; SLURM signals
every process; when one worker crashes torchrun signals the others). Saving where the signal lands would make the
ranks enter the save's collectives at different steps (ZeRO-3 and FSDP hang there). So the handler only records it
(`signals.SignalFlag`) and the ranks vote at every step boundary: an all-reduce (max) of the signal number each
received, on a gloo group of its own. A step's vote is started before its optimizer step and read at the boundary
after it, so it runs while the optimizer steps and training hardly waits for it, and a signal that came during the
forward and backward passes is honoured at the end of that same step (where steps are so short that a vote per step
would cost more than half a percent, the ranks agree to vote every few steps, at least once a second: `Agreement`);
`now` votes and reads at once, for the rare boundaries after an evaluation or a save and at the ends of `train()`. Every rank starts and reads the same votes in
the same order, so all see the same outcome at the same boundary.

A rank that received a signal waits for a vote at most `agree_timeout` seconds: past that a peer is gone (killed, or
stuck), and this rank leaves without saving (`PeerLost`); the newest complete checkpoint stays the one a resume picks.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

from .. import dist
from ..errors import TrainingPreempted
from ..options import PreemptionOptions
from .requeue import requeue
from .signals import SignalFlag, signal_name

logger = logging.getLogger(__name__)

#: How long one wait for a vote blocks before Python gets to run signal handlers (and check the deadline).
WAIT_SLICE = timedelta(milliseconds=50)
#: The share of training time votes may cost (`Agreement`), and the longest time between two votes.
EXPOSED_SHARE = 0.005
MAX_LATENCY = 1.0


def _smooth(average: float | None, sample: float) -> float:
    return sample if average is None else 0.9 * average + 0.1 * sample


class PeerLost(RuntimeError):
    """The ranks could not agree on a preemption: a peer did not vote in time, or its connection failed."""


class Agreement:
    """Votes on `flag`. Collective at creation (its gloo group) and at every `start` / `read` / `now`: all
    ranks call them in the same order.

    A vote costs a little time whatever the step's length (an all-reduce on gloo: a fraction of a millisecond on a
    busy CPU); where steps are that short, voting at every one would slow training. So the ranks vote every `every`
    boundaries: each vote carries the interval every rank wants, the largest at which its votes cost at most
    `EXPOSED_SHARE` of its training time, but a vote at least every `MAX_LATENCY` seconds; all ranks read the same
    vote at the same boundary and adopt its maximum there. Steps of a tenth of a second or more vote at every one."""

    def __init__(self, flag: SignalFlag, agree_timeout: float):
        self.flag = flag
        self.agree_timeout = agree_timeout
        self.every = 1
        self._group = dist.gloo_group("preemption") if dist.is_distributed() else None
        self._pending = None
        self._steps = 0  # optimizer steps seen by `start` (counted there: an epoch's end adds a boundary, not a step)
        self._cost = self._step = None  # smoothed seconds: one vote's cost to this rank; one optimizer step
        self._last = None  # when the previous optimizer step began
        self._spent = 0.0  # seconds the vote of the coming boundary has cost so far

    def start(self) -> None:
        """Before an optimizer step: start the vote of the coming boundary, when one is due there (and none is in
        flight). Collective: all ranks call it."""
        self._steps += 1
        now = time.monotonic()
        if self._last is not None:
            self._step = _smooth(self._step, now - self._last)
        self._last = now
        if self._pending is None and self._steps % self.every == 0:
            self._start()
            self._spent += time.monotonic() - now

    def read(self) -> int:
        """At a step boundary: the signal agreed by the vote in flight (0: none, or no vote due here). Collective:
        all ranks call it."""
        began, voted = time.monotonic(), self._pending is not None
        agreed, wanted = self._read()
        now = time.monotonic()
        if voted:
            self.every = max(1, wanted)
            self._cost = _smooth(self._cost, self._spent + now - began)
        self._spent = 0.0
        return agreed

    def now(self) -> int:
        """The signal agreed by the vote in flight or, when that says none, by a vote taken now. Collective: all
        ranks call it."""
        return self._read()[0] or (self._start(), self._read())[1][0]

    def drain(self, timeout: float = 0.0) -> None:
        """Forget the vote in flight, waiting up to `timeout` s for it (leaving `train()` by an exception). Local."""
        pending, self._pending = self._pending, None
        if pending is not None:
            deadline = time.monotonic() + timeout
            while not pending[0].is_completed() and time.monotonic() < deadline:
                time.sleep(0.001)

    def wanted_every(self) -> int:
        """The voting interval this rank wants (see the class docstring)."""
        if not self._cost or not self._step:
            return 1
        cheap = math.ceil(self._cost / (EXPOSED_SHARE * self._step))
        return max(1, min(cheap, int(MAX_LATENCY / self._step)))

    def _start(self) -> None:
        if self._group is None:
            return
        import torch

        vote = torch.tensor([self.flag.received, self.wanted_every()], dtype=torch.int32)
        work = torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, vote)

    def _read(self) -> tuple[int, int]:
        """(the agreed signal, the agreed voting interval) of the vote in flight; without one, (0, `every`)."""
        if self._group is None:
            return self.flag.received, 1
        if self._pending is None:
            return 0, self.every
        work, vote = self._pending
        self._wait(work)
        self._pending = None
        return int(vote[0]), int(vote[1])

    def _wait(self, work) -> None:
        """Until `work` completes: in slices of `WAIT_SLICE` (a timed wait in C++, no polling), so the signal
        handlers run between them. Once this rank has a signal, at most `agree_timeout` s from it."""
        while True:
            try:
                work.wait(timeout=WAIT_SLICE)
                return
            except RuntimeError as e:
                if work.is_completed() and not self._succeeded(work):  # failed, not slow: a peer's connection closed
                    self._pending = None
                    raise PeerLost(f"the vote failed: {type(e).__name__}: {e}") from e
                if work.is_completed():  # the timed wait ran out just as the vote arrived
                    return
            if self.flag.received and self.flag.elapsed() > self.agree_timeout:
                raise PeerLost(f"no agreement within {self.agree_timeout:.0f} s of the signal: a peer did not "
                               "vote (it may have died)")


    @staticmethod
    def _succeeded(work) -> bool:
        """Whether completed `work` succeeded: waited on again it returns at once, or raises its failure."""
        try:
            work.wait()
        except RuntimeError:
            return False
        return True


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
        """The exception `train()` raises; said once (rank 0; for a lost peer, by every rank that lost one); the
        SLURM job requeued (rank 0) when asked."""
        name = signal_name(number) if number else "a lost peer"
        if saved:
            what = f"saved {checkpoint}" + (f" in {save_seconds:.1f} s" if save_seconds is not None else "")
        elif checkpoint:
            what = f"nothing new saved; the newest complete checkpoint is {checkpoint}"
        else:
            what = "nothing saved (there is no checkpoint yet)"
        message = (f"Training preempted by {name} at step {step} ({where}): {what}. Exiting with status "
                   f"{128 + number if number else 1}; resume with train(resume_from_checkpoint='auto').")
        if dist.rank() == 0 or not number:  # a lost peer may be rank 0: every rank that lost one says so
            logger.warning("%s", message)
            if self.options.requeue:
                requeue()
        return TrainingPreempted(message, number, step, checkpoint, saved)
