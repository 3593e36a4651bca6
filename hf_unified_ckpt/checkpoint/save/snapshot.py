"""The snapshot of a background save: this rank's tensors copied off the live engine, so that training may go on
while they are written.

- `HostBuffers`: copies of live tensors into host buffers reused from one save (or EMA update) to the next; a
  CUDA tensor is copied into pinned memory on a side stream (`device_copy`). With `shared`, the buffers are in
  shared memory, so that a writer process maps the same pages (`executors.ProcessExecutor`): host memory stays at
  one snapshot.
- `Snapshots`: what `async_save.AsyncSaver` copies into for each save: straight into the files where the write
  strategy can place them (the memory tier's reused files, mapped from save to save: `writer.PlacesSnapshots`),
  else into the host buffers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import torch

from ...format.headers import TORCH_DTYPE_NAMES
from ...format.planning import FilePlan
from ...store import WritableMaps
from .device_copy import PAGE, Transfers, host_buffer
from .persist import PersistJob, lower_priority
from ..write.reports import guarded
from ..write.writer import PlacesSnapshots, writes_whole

logger = logging.getLogger(__name__)


class HostBuffers:
    """Host copies of tensors, keyed, each buffer reused while its shape and dtype stay the same; a tensor on a CUDA
    device is copied into pinned memory on a side stream (`device_copy`: `transfers` orders the copies against the
    training stream, and `Background` drives it)."""

    def __init__(self, shared: bool = False):
        self._buffers: dict[object, tuple[torch.Tensor, bool]] = {}  # key -> (buffer, whether pinned)
        self.transfers = Transfers()
        self.shared = shared
        self._warming: threading.Thread | None = None
        self._stop = threading.Event()

    def warm_up(self, specs: list[tuple[object, tuple[int, ...], torch.dtype, int]], device: torch.device) -> None:
        """Make the buffers of `specs` ((key, shape, dtype, phase) of the tensors the next copies will take, from
        `device`) in a background thread at the lowest CPU priority: allocated (each `phase` bytes into a page, as
        its bytes lie in their file: written to disk straight from the buffer), their pages faulted in (pinned, for
        a CUDA device), so that the first copies find them ready instead of paying for them while training waits.
        `copy` waits for a warm-up still running; `release` stops it."""
        self._join()
        self._stop.clear()
        like = torch.empty(0, device=device)
        self._warming = threading.Thread(target=self._allocate, args=(specs, like), daemon=True,
                                           name="hf_unified_ckpt-host-buffers")
        self._warming.start()

    def _allocate(self, specs, like: torch.Tensor) -> None:
        """The warm-up's thread. A failure (memory refused) stops it, logged: the copies make what is missing."""
        lower_priority()
        pin = like.device.type == "cuda" and not self.shared
        try:
            for key, shape, dtype, phase in specs:
                if self._stop.is_set():
                    return
                buffer = host_buffer(shape, dtype, like, shared=self.shared, phase=phase)
                if not pin:  # a pinned buffer is faulted in before it is locked (`device_copy`); a pageable one here
                    fault_in(buffer)
                self._buffers[key] = (buffer, pin)
        except (MemoryError, OSError, RuntimeError) as e:
            logger.info("The background saves' host buffers were not all made ahead (%s); the first save makes the "
                        "rest as it copies.", e)

    def _join(self) -> None:
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def release(self) -> None:
        """Free every buffer (the end of a run); a warm-up in progress stops first."""
        self._stop.set()
        self._join()
        self._buffers.clear()

    def copy(self, key, tensor: torch.Tensor, dtype: torch.dtype | None = None, flat: bool = False) -> torch.Tensor:
        """A copy of `tensor` (flattened with `flat`, converted to `dtype` if given) in the buffer of `key` (for a
        CUDA tensor: queued, there once `transfers.settle()` returned)."""
        self._join()
        shape = (tensor.numel(),) if flat else tuple(tensor.shape)
        dtype = dtype or tensor.dtype
        buffer, pinned = self._buffers.get(key, (None, False))
        # a CUDA tensor's buffer is pinned unless shared (asking a buffer whether it is costs a CUDA call)
        pin = tensor.device.type == "cuda" and not self.shared
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype or pinned != pin:
            buffer = host_buffer(shape, dtype, tensor, shared=self.shared)
            self._buffers[key] = (buffer, pin)
        return self.transfers.copy(buffer, tensor, shape, dtype)

    def drop(self, keys) -> None:
        """Free the buffers of `keys` (their copies go elsewhere now)."""
        for key in keys:
            self._buffers.pop(key, None)

    def nbytes(self) -> int:
        return sum(b.nbytes for b, _ in list(self._buffers.values()))


def fault_in(buffer: torch.Tensor) -> None:
    """Touch one byte of every page of `buffer` (writing zeros), so that its pages exist before a copy needs them
    (numpy's strided write releases the GIL)."""
    if buffer.nbytes:
        numpy = buffer.view(-1).view(torch.uint8).numpy()
        numpy[::PAGE] = 0


def snapshot_specs(files: Iterable[FilePlan], rank: int, placed_whole: bool = False
                   ) -> list[tuple[object, tuple[int, ...], torch.dtype, int]] | None:
    """(key, shape, dtype, phase) of each tensor `rank` will copy into host buffers for a save of `files` (the save
    plan), read from the plan alone: its pieces of the tensors written in place (flat) and, on a file's header
    rank, the tensors it writes whole; `phase`: where in a page its bytes begin in the file. With `placed_whole`,
    none of a file it writes whole (copied straight into place: the memory tier's files on a CPU). None where a
    file has a codec (its encoded tensors are not known before the data is)."""
    specs = []
    for file in files:
        if not file.writes(rank):
            continue
        if file.codec is not None:
            return None
        items = sorted(file.items_of(rank), key=lambda item: item.start)
        if placed_whole and writes_whole(file, rank, items):
            continue
        starts = {item.name: len(file.header_bytes) + item.start for item in items}
        wanted = [(name, (file.first_held(name, rank)[1],)) for name in file.pieces_held(rank)]
        if rank == file.header_rank:
            wanted += [(name, tuple(file.header[name]["shape"])) for name in file.whole_names]
        specs += [((file.component, name), shape, _dtype(file.header[name]["dtype"]), starts.get(name, 0) % PAGE)
                  for name, shape in wanted]
    return specs


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, TORCH_DTYPE_NAMES[name])


class Snapshots:
    """The copies of one training job's background saves (see the module docstring). `place`: whether a file may
    be copied straight into place (not where another process writes the job: a mapping does not travel)."""

    def __init__(self, shared: bool = False, place: bool = True):
        self.buffers = HostBuffers(shared)
        self.maps = WritableMaps()  # mappings of the files saves copy into directly (`PlacesSnapshots.place`)
        self.place = place
        self.nbytes = 0  # what the last save copied of this rank's tensors (into buffers or files)

    def take(self, engine, job: PersistJob, mine: Iterable[FilePlan]) -> tuple[bool, object]:
        """Copy this rank's tensors of the files it writes (`mine`) into `job`: (True, the job, ready to run) or
        (False, the `Failure`). Local."""
        return guarded(lambda: self._take(engine, job, mine))

    def _take(self, engine, job: PersistJob, mine: Iterable[FilePlan]) -> PersistJob:
        self.maps.prune()
        self.nbytes, files = 0, []
        for file in mine:
            tensors = job.writer.local_tensors(engine, file)
            placed = self._placed(job, file, tensors)
            if placed is not None:  # its host buffers, if an earlier save made them, are not needed any more
                self.buffers.drop((file.component, name) for name in tensors)
            else:
                tensors = {name: self.buffers.copy((file.component, name), t) for name, t in tensors.items()}
            self.nbytes += sum(t.nbytes for t in tensors.values())
            files.append((file, placed if placed is not None else tensors))
        job.files = files
        return job

    def _placed(self, job: PersistJob, file: FilePlan, tensors):
        if self.place and isinstance(job.writer, PlacesSnapshots):
            return job.writer.place(job.folder, file, tensors, self.maps)
        return None

    def release_mappings(self) -> None:
        """Unmap the files the saves wrote through mappings (a run's end: the memory tier's files may be freed).
        Call with no save in flight."""
        self.maps.close()
