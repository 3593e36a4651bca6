"""Host copies of tensors for a background job (an async or flash save's snapshot, the EMA's copy of the weights),
on whatever device each tensor lives; the device is read from the tensor, never assumed.

- A CPU tensor: a plain synchronous copy; every ordering step below does nothing.
- A CUDA tensor: copied into pinned host memory (the DMA engine reads it directly, and the copy can be queued
  without blocking) on a side stream of the tensor's device, so that the training stream is not held up. The side
  stream first waits for an event recorded on the training stream when the job began (`begin`, on the training
  thread: the state to copy is final there); after the last copy an event marks the copies done (`end`). The next
  optimizer step is queued behind that event (`fence`, on the training thread: the GPU orders the two, the host does
  not wait), and the background thread blocks on it (`settle`) before it reads the host buffers.

The CUDA branch runs on a GPU machine only (bench/gpu/); on CPU its absence is what the tests see.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor, shared: bool = False,
                phase: int | None = None) -> torch.Tensor:
    """An empty host buffer for copies of `like`: pinned where `like` lives on a CUDA device, pageable otherwise;
    with `shared`, in shared memory (another process maps the same pages: the writer process), pageable. With
    `phase` (not shared), the buffer starts `phase` bytes into a page, as the bytes it holds will in their file:
    its whole pages then go to disk with direct I/O straight from it (`store.direct`), no copy.

    Pinned memory is page-locked in place (`cudaHostRegister`) over an allocation of the exact size: torch's pinned
    allocator (`pin_memory=True`) rounds every allocation up to a power of two and keeps it cached, so a snapshot
    would hold up to twice its bytes (a 262 MB embedding takes 512 MB). Where registering fails, `pin_memory=True`."""
    if shared:
        return torch.empty(shape, dtype=dtype).share_memory_()
    if like.device.type != "cuda":
        return torch.empty(shape, dtype=dtype) if phase is None else paged_buffer(shape, dtype, phase)
    buffer = registered_buffer(shape, dtype, _register, _unregister, phase or 0)
    if buffer is None:
        logger.debug("cudaHostRegister failed; a pinned buffer from torch's allocator instead")
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return buffer


def paged_buffer(shape: tuple[int, ...], dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
    """An empty tensor of `shape` and `dtype` starting `phase` bytes into the first page of an anonymous memory map
    (`phase` a multiple of the dtype's size)."""
    nbytes = math.prod(shape) * dtype.itemsize
    span = -(-max(phase + nbytes, 1) // PAGE) * PAGE
    region = torch.frombuffer(mmap.mmap(-1, span), dtype=torch.uint8)  # the storage keeps the map alive
    return region[phase:phase + nbytes].view(dtype).view(shape)


def registered_buffer(shape: tuple[int, ...], dtype: torch.dtype, register: Callable[[int, int], bool],
                      unregister: Callable[[int], object], phase: int = 0) -> torch.Tensor | None:
    """An empty tensor of `shape` and `dtype` on whole pages of an exact-size host allocation (an anonymous memory
    map), locked by `register(address, length)` (False: not locked, None returned) and unlocked by
    `unregister(address)` once the tensor is gone (before its memory is freed: its views keep the memory, unlocked,
    valid).

    The tensor's storage begins where the locked range does: CUDA's `Tensor.is_pinned()` looks up the storage's first
    byte, so a page-aligned view into a larger allocation (as an H100 run of bench/gpu/device_check.py found) is
    copied as pinned memory yet reported as pageable."""
    nbytes = math.prod(shape) * dtype.itemsize
    span = -(-max(phase + nbytes, 1) // PAGE) * PAGE
    region = torch.frombuffer(mmap.mmap(-1, span), dtype=torch.uint8)  # the storage keeps the map alive
    fault_in_outside_driver(region)
    if not register(region.data_ptr(), span):
        return None
    buffer = region[phase:phase + nbytes].view(dtype).view(shape)
    weakref.finalize(buffer, unregister, region.data_ptr())
    return buffer


def fault_in_outside_driver(region: torch.Tensor) -> None:
    """Make the pages of a fresh anonymous map exist before the driver page-locks them: one byte of every page
    written here (numpy's strided write releases the GIL), one page fault at a time.

    Page-locking pages that do not exist yet faults and zeroes them inside `cudaHostRegister`, under locks a training
    step waits for: an H200 run (2026-11-28, `bench_1b_throughput`) held the training thread 3.9 s in the one step
    during which 11.4 GB of a 1B model's buffers were made ahead, and `bench/gpu/pin_contention.py` found the
    training thread held 99.5 % of the time the buffers took to make that way, 13 % once faulted in here first
    (huge pages, `MADV_HUGEPAGE`, changed neither figure and risk compaction stalls: not asked for)."""
    if region.numel():
        region.numpy()[::PAGE] = 0


def _register(address: int, length: int) -> bool:
    """Page-lock a host range for every device (`cudaHostRegisterPortable`), as torch's own
    `distributed._state_dict_utils` does for its pinned CPU state dicts (`cuda._pin_memory_utils`, private)."""
    return int(torch.cuda.cudart().cudaHostRegister(address, length, 1)) == 0


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class Transfers:
    """The ordering of one job's copies against the training stream (see the module docstring). One job at a time:
    `begin` (training thread), `copy`... and `end` (background thread), then `fence` (training thread) and `settle`
    (background thread), in either order."""

    def __init__(self):
        self._ready: dict[int, object] = {}  # device index -> event on the training stream at `begin`
        self._streams: dict[int, object] = {}  # device index -> side stream (created once, reused)
        self._used: set[int] = set()
        self._done: dict[int, object] = {}  # device index -> event after the job's last copy

    def begin(self) -> None:
        """Mark, on every CUDA device's current stream, the point the next copies must follow. Training thread."""
        self._ready, self._used, self._done = {}, set(), {}
        if _cuda_in_use():
            for index in range(torch.cuda.device_count()):
                self._ready[index] = torch.cuda.current_stream(index).record_event()

    def copy(self, buffer: torch.Tensor, tensor: torch.Tensor, shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        """Copy `tensor` (reshaped to `shape`, converted to `dtype`) into the host `buffer`; for a CUDA tensor the copy
        is queued on the side stream (done once `settle` returns). Returns `buffer`."""
        if tensor.device.type != "cuda":
            return buffer.copy_(tensor.detach().reshape(shape))
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        stream = self._side_stream(index)
        with torch.cuda.stream(stream):
            source = tensor.detach().reshape(shape).to(dtype)  # any temporary lives on the side stream
            buffer.copy_(source, non_blocking=True)
        tensor.detach().record_stream(stream)  # the allocator keeps its memory until the copy ran
        return buffer

    def _side_stream(self, index: int):
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        stream = self._streams[index]
        if index not in self._used:
            self._used.add(index)
            if index in self._ready:
                stream.wait_event(self._ready[index])
            else:  # CUDA first used by this job: order after everything queued on the device so far
                stream.wait_stream(torch.cuda.current_stream(index))
        return stream

    def end(self) -> None:
        """Mark the job's copies done on each side stream used. Background thread, after the last `copy`."""
        self._done = {index: self._streams[index].record_event() for index in self._used}

    def fence(self) -> None:
        """Queue what the training stream does next (the optimizer step) behind the copies; no host wait. Training
        thread."""
        for index, event in self._done.items():
            torch.cuda.current_stream(index).wait_event(event)

    def settle(self) -> None:
        """Block until the copies are done, so the host buffers hold them. Background thread."""
        for event in self._done.values():
            event.synchronize()
