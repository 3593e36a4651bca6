"""What a save persists, as data, and the thread that runs background work.

- `PersistJob`: one rank's share of a save once its tensors are in hand: the folder (a store reference), the write
  strategy, this rank's tensors per planned file, and the small files (RNG, trainer state, scheduler, configs,
  tokenizer) already turned into bytes. Plain and picklable once its files are a list of host tensors: a thread
  runs it, or the writer process of `executors.ProcessExecutor`; the files it writes are the same. Collective only
  where its write strategy says so (`StorageWriter.collective_write`: multipart hand-overs).
- `Background` (execution): one thread at a time that takes a snapshot, signals that it is taken (the next
  optimizer step waits only for that), lowers its CPU priority and runs the rest. Shared by `async_save.AsyncSaver` and
  `ema.BackgroundUpdates`.

The host copies themselves are `snapshot.py`'s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...format.planning import FilePlan
from .device_copy import Transfers
from ..folder.files import FileRecord, RangeRecord, put_file
from ...store import join, name_of


@dataclass
class PersistJob:
    """One rank's share of a save, ready to write (see the module docstring)."""

    folder: str
    writer: object  # checkpoint.write.writer.StorageWriter
    files: Iterable[tuple[FilePlan, Mapping[str, torch.Tensor] | object]] = field(default_factory=list)
    small_files: dict[str, bytes] = field(default_factory=dict)

    def run(self) -> list[FileRecord | RangeRecord]:
        """Write the tensor files in a writer thread, so that writing one file overlaps producing the next
        (assembling it, in the synchronous save), then the small files on this thread while the last tensors are
        written (their fsyncs wait on the disk's journal alongside the tensors' writeback, not after it); return
        every record, the small files' last. Durable on return. Every file is handed to the writer even after a
        failure (a multipart writer's hand-overs are transfers the other ranks wait for); the first failure is
        raised once every write and fsync has ended. Collective only where `writer.collective_write`."""
        with self.writer.syncing(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_unified_ckpt-write") as pool:
            futures = [pool.submit(self.writer.write, self.folder, file, tensors) for file, tensors in self.files]
            extras = write_small_files(self.folder, self.small_files)
            records = [record for done in futures for record in done.result()]
        return records + extras


def write_small_files(folder: str, files: Mapping[str, bytes]) -> list[FileRecord]:
    """Put each small file (name -> bytes) into `folder`, durably and atomically; return their records."""
    return [put_file(join(folder, name), data) for name, data in sorted(files.items())]


class Background:
    """Runs one `take` (the snapshot) then `then(snapshot)` at a time in a thread (see the module docstring). `wait`
    joins it and returns `then`'s result, or raises what `take` or `then` raised. With the `transfers` of the host
    buffers `take` copies into, device copies are ordered: marked at `start`, the optimizer step queued behind them
    at `wait_for_snapshot`, and `then` runs once they are done (`device_copy.Transfers`)."""

    def __init__(self, name: str, transfers: Transfers | None = None):
        self.name = name
        self._transfers = transfers or Transfers()
        self._taken = threading.Event()
        self._taken.set()
        self._thread: threading.Thread | None = None
        self._result: tuple[bool, object] | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, take: Callable[[], object], then: Callable[[object], object], label: str = "") -> None:
        """Start a job; the caller has waited for the previous one (`wait`)."""
        assert self._thread is None, "one background job at a time: wait() for the previous one first"
        self._taken.clear()
        self._transfers.begin()
        label = name_of(label) if label else ""  # a checkpoint's reference: its folder's name
        self._thread = threading.Thread(target=self._run, args=(take, then), daemon=True,
                                        name=f"hf_unified_ckpt-{self.name}{'-' + label if label else ''}")
        self._thread.start()

    def _run(self, take, then) -> None:
        try:
            try:
                snapshot = take()
            finally:
                try:
                    self._transfers.end()
                finally:
                    self._taken.set()
            self._transfers.settle()
            lower_priority()
            self._result = (True, then(snapshot))
        except BaseException as e:  # handed to wait(), on the training thread
            self._result = (False, e)

    def wait_for_snapshot(self) -> None:
        """Block until the job in flight has taken its snapshot (call before the optimizer changes the originals);
        copies from a CUDA device are then queued ahead of whatever the training stream does next."""
        self._taken.wait()
        self._transfers.fence()

    def wait(self):
        """Join the job in flight (if any); return its result or raise its error."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        (ok, value), self._result = self._result, None
        if not ok:
            raise value
        return value


def lower_priority() -> None:
    """Once the copy is taken, nothing waits for this thread: lower its CPU priority (Linux: per-thread nice), so
    that on a busy CPU the writing, checksums and page-cache copies take idle cycles, not training's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass
