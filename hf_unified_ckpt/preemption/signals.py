"""Preemption signals: handlers that only record the first signal, installed for the length of one `train()` call.

Kubernetes, spot VMs, SLURM and torchrun end a job with SIGTERM (SLURM can send SIGUSR1 ahead with `--signal`),
then SIGKILL after a grace period. A handler here does nothing but note which signal came first and when; a
repeated one (torchrun forwarding SIGTERM a second time, SIGUSR1 then SIGTERM) changes nothing. What to do about it
is decided at the next step boundary, by all ranks together (`preemption.py`).

DataLoader worker processes are forked from the training process and get the same signals (torchrun and SLURM
signal the whole process group): without help, torch's worker handler ends a worker on SIGTERM and the training
process then fails with "DataLoader worker exited unexpectedly" before it could save. `IgnoreInWorkers` wraps a
DataLoader's `worker_init_fn` so that its workers ignore the preemption signals; they end with the training process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)


class SignalFlag:
    """Records the first of `signals` this process receives while installed (`received`: its number, 0 if none;
    `at`: `time.monotonic()` then)."""

    def __init__(self, signals: tuple[int, ...]):
        self.signals = tuple(signals)
        self.received = 0
        self.at: float | None = None
        self._previous: dict[int, object] = {}
        self._owner: int | None = None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers; False (and nothing installed) off the main thread, where Python cannot."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._owner = os.getpid()
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._record)
        return True

    def restore(self) -> None:
        """Put back the handlers found at `install`."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _record(self, number: int, frame) -> None:
        if os.getpid() != self._owner:  # a forked child that inherited the handler: not the training process
            return
        if not self.received:
            self.received, self.at = number, time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the first signal (0 when none came)."""
        return time.monotonic() - self.at if self.at is not None else 0.0


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class IgnoreInWorkers:
    """A DataLoader `worker_init_fn` that makes the worker ignore `signals` unless its parent sends them, then runs
    the original one (picklable, for the spawn and forkserver start methods, when the original is)."""

    def __init__(self, original, signals: tuple[int, ...]):
        self.original = original
        self.signals = tuple(signals)

    def __call__(self, worker_id: int):
        ignore_unless_from_parent(self.signals)
        if self.original is not None:
            self.original(worker_id)


def ignore_unless_from_parent(signals: tuple[int, ...]) -> None:
    """In a DataLoader worker: drop `signals` sent by anyone but the parent (torchrun's or SLURM's preemption
    signal), end the worker on one from the parent, as torch's own worker handler does (multiprocessing ends its
    daemon children with SIGTERM at exit, and joins them: a worker ignoring it would keep its parent waiting). The
    signals are blocked and taken by a thread that sees who sent them (`sigwaitinfo`); where that is not available,
    they are ignored outright."""
    if not hasattr(signal, "sigwaitinfo"):
        for number in signals:
            signal.signal(number, signal.SIG_IGN)
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def take() -> None:
        while True:
            if signal.sigwaitinfo(signals).si_pid == parent:
                os._exit(0)

    threading.Thread(target=take, name="dataloader-worker-signals", daemon=True).start()


def ignore_in_workers(loader, signals: tuple[int, ...]):
    """`loader` (a DataLoader, or accelerate's wrapper of one), its workers made to ignore `signals`; returned."""
    # accelerate's DataLoaderShard iterates the DataLoader it holds (`base_dataloader`): set it there
    target = vars(loader).get("base_dataloader", loader)
    if getattr(target, "num_workers", 0) and not isinstance(target.worker_init_fn, IgnoreInWorkers):
        target.worker_init_fn = IgnoreInWorkers(target.worker_init_fn, signals)
    return loader
