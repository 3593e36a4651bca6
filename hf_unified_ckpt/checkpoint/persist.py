"""What a save persists, as data, and the two parts that run it in the background.

- `PersistJob`: one rank's share of a save once its tensors are in hand: the folder (a store reference), the
  storage writer, this rank's tensors per planned file, and the small files (RNG, trainer state, scheduler,
  configs, tokenizer) already turned into bytes. Plain and picklable: a thread runs it today (`run`), and another
  process can run it tomorrow (a persister that outlives the trainer); the files it writes are the same.
- `HostBuffers` (staging): copies of live tensors into host buffers reused from one save (or EMA update) to the
  next, so that the optimizer may change the live ones while the copy is written.
- `Background` (execution): one thread at a time that stages, signals that the copy is taken (the next optimizer
  step waits only for that), lowers its CPU priority and runs the rest. Shared by `async_save.AsyncSaver` and
  `ema.BackgroundUpdates`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..format.planning import FilePlan
from .device_copy import Transfers, host_buffer
from .files import FileRecord, RangeRecord, put_file
from ..store import join


@dataclass
class PersistJob:
    """One rank's share of a save, ready to write (see the module docstring). Local I/O only: no collective."""

    folder: str
    writer: object  # checkpoint.writer.StorageWriter
    files: list[tuple[FilePlan, Mapping[str, torch.Tensor]]] = field(default_factory=list)
    small_files: dict[str, bytes] = field(default_factory=dict)

    def run(self) -> list[FileRecord | RangeRecord]:
        """Write the tensor files (durable on return) and the small files; return their records. After a failure
        the remaining files are still handed to the writer (a multipart writer's exchanges are collectives the other
        ranks wait for); the first failure is raised at the end."""
        records, failure = [], None
        with self.writer.syncing():
            for file, tensors in self.files:
                try:
                    records += self.writer.write(self.folder, file, tensors)
                except Exception as e:  # raised below, once every file had its turn
                    failure = failure or e
        if failure is not None:
            raise failure
        return records + write_small_files(self.folder, self.small_files)


def write_small_files(folder: str, files: Mapping[str, bytes]) -> list[FileRecord]:
    """Put each small file (name -> bytes) into `folder`, durably and atomically; return their records."""
    return [put_file(join(folder, name), data) for name, data in sorted(files.items())]


class HostBuffers:
    """Host copies of tensors, keyed, each buffer reused while its shape and dtype stay the same; a tensor on a CUDA
    device is copied into pinned memory on a side stream (`device_copy`: `transfers` orders the copies against the
    training stream, and `Background` drives it)."""

    def __init__(self):
        self._buffers: dict[object, tuple[torch.Tensor, bool]] = {}  # key -> (buffer, whether pinned)
        self.transfers = Transfers()

    def copy(self, key, tensor: torch.Tensor, dtype: torch.dtype | None = None, flat: bool = False) -> torch.Tensor:
        """A copy of `tensor` (flattened with `flat`, converted to `dtype` if given) in the buffer of `key` (for a
        CUDA tensor: queued, there once `transfers.settle()` returned)."""
        shape = (tensor.numel(),) if flat else tuple(tensor.shape)
        dtype = dtype or tensor.dtype
        buffer, pinned = self._buffers.get(key, (None, False))
        on_device = tensor.device.type == "cuda"  # its buffer must be pinned (asking a buffer costs a CUDA call)
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype or pinned != on_device:
            buffer = host_buffer(shape, dtype, tensor)
            self._buffers[key] = (buffer, on_device)
        return self.transfers.copy(buffer, tensor, shape, dtype)

    def drop(self, keys) -> None:
        """Free the buffers of `keys` (their copies go elsewhere now)."""
        for key in keys:
            self._buffers.pop(key, None)

    def nbytes(self) -> int:
        return sum(b.nbytes for b, _ in self._buffers.values())


class Background:
    """Runs one `stage` then `then(staged)` at a time in a thread (see the module docstring). `wait` joins it and
    returns `then`'s result, or raises what `stage` or `then` raised. With the `transfers` of the host buffers the
    stage copies into, device copies are ordered: marked at `start`, the optimizer step queued behind them at
    `wait_for_stage`, and `then` runs once they are done (`device_copy.Transfers`)."""

    def __init__(self, name: str, transfers: Transfers | None = None):
        self.name = name
        self._transfers = transfers or Transfers()
        self._staged = threading.Event()
        self._staged.set()
        self._thread: threading.Thread | None = None
        self._result: tuple[bool, object] | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, stage: Callable[[], object], then: Callable[[object], object], label: str = "") -> None:
        """Start a job; the caller has waited for the previous one (`wait`)."""
        assert self._thread is None, "one background job at a time: wait() for the previous one first"
        self._staged.clear()
        self._transfers.begin()
        self._thread = threading.Thread(target=self._run, args=(stage, then), daemon=True,
                                        name=f"hf_unified_ckpt-{self.name}{'-' + label if label else ''}")
        self._thread.start()

    def _run(self, stage, then) -> None:
        try:
            try:
                staged = stage()
            finally:
                try:
                    self._transfers.end()
                finally:
                    self._staged.set()
            self._transfers.settle()
            lower_priority()
            self._result = (True, then(staged))
        except BaseException as e:  # handed to wait(), on the training thread
            self._result = (False, e)

    def wait_for_stage(self) -> None:
        """Block until the job in flight has taken its copy (call before the optimizer changes the originals); copies
        from a CUDA device are then queued ahead of whatever the training stream does next."""
        self._staged.wait()
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
