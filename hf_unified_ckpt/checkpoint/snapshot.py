"""The snapshot of a background save: this rank's tensors copied off the live engine, so that training may go on
while they are written.

- `HostBuffers`: copies of live tensors into host buffers reused from one save (or EMA update) to the next; a
  CUDA tensor is copied into pinned memory on a side stream (`device_copy`). With `shared`, the buffers are in
  shared memory, so that a writer process maps the same pages (`executors.ProcessExecutor`): host memory stays at
  one snapshot.
- `Snapshots`: what `async_save.AsyncSaver` copies into for each save: straight into the files where the write
  strategy can place them (the memory tier's reused files, mapped from save to save: `SharedFileWriter.place`),
  else into the host buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..format.planning import FilePlan
from ..store import WritableMaps
from .device_copy import Transfers, host_buffer
from .persist import PersistJob
from .reports import guarded


class HostBuffers:
    """Host copies of tensors, keyed, each buffer reused while its shape and dtype stay the same; a tensor on a CUDA
    device is copied into pinned memory on a side stream (`device_copy`: `transfers` orders the copies against the
    training stream, and `Background` drives it)."""

    def __init__(self, shared: bool = False):
        self._buffers: dict[object, tuple[torch.Tensor, bool]] = {}  # key -> (buffer, whether pinned)
        self.transfers = Transfers()
        self.shared = shared

    def copy(self, key, tensor: torch.Tensor, dtype: torch.dtype | None = None, flat: bool = False) -> torch.Tensor:
        """A copy of `tensor` (flattened with `flat`, converted to `dtype` if given) in the buffer of `key` (for a
        CUDA tensor: queued, there once `transfers.settle()` returned)."""
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
        return sum(b.nbytes for b, _ in self._buffers.values())


class Snapshots:
    """The copies of one training job's background saves (see the module docstring). `place`: whether a file may
    be copied straight into place (not where another process writes the job: a mapping does not travel)."""

    def __init__(self, shared: bool = False, place: bool = True):
        self.buffers = HostBuffers(shared)
        self.maps = WritableMaps()  # mappings of the files saves copy into directly (`SharedFileWriter.place`)
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
        place = getattr(job.writer, "place", None) if self.place else None  # SharedFileWriter's
        return place(job.folder, file, tensors, self.maps) if place is not None else None

    def release_mappings(self) -> None:
        """Unmap the files the saves wrote through mappings (a run's end: the memory tier's files may be freed).
        Call with no save in flight."""
        self.maps.close()
