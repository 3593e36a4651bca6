"""The host copies a background job takes (`checkpoint/save/device_copy.py`, `snapshot.HostBuffers`,
`persist.Background`): their CPU branch here; the CUDA branch (pinned buffers, a side stream, the optimizer step queued
behind the copies) runs in `bench/gpu/device_check.py` on a GPU machine, and that script's CPU dry run is in
test_gpu_script.py."""

import threading

from pathlib import Path

import torch

from hf_unified_ckpt.checkpoint.save.device_copy import Transfers, host_buffer
from hf_unified_ckpt.checkpoint.save.persist import Background
from hf_unified_ckpt.checkpoint.save.snapshot import HostBuffers


def test_a_snapshot_is_taken_before_the_snapshot_signal_and_its_buffers_are_reused():
    live = torch.arange(1001, dtype=torch.float32)
    buffers = HostBuffers()
    background = Background("test", buffers.transfers)
    release = threading.Event()

    def then(copy):
        release.wait(10)  # the "write" runs after the optimizer already changed the live tensor
        return copy.clone()

    background.start(lambda: buffers.copy("w", live), then)
    background.wait_for_snapshot()
    live.mul_(-1)  # the optimizer step
    release.set()
    assert torch.equal(background.wait(), torch.arange(1001, dtype=torch.float32))

    first = buffers.copy("w", live)
    again = buffers.copy("w", live * 2)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, live * 2)
    assert buffers.nbytes() == 1001 * 4
    small = (torch.arange(1001) % 64).float()  # exact in bf16
    converted = buffers.copy("w", small.to(torch.bfloat16), torch.float32, flat=True)  # a bf16 source, fp32 copy
    assert converted.data_ptr() == first.data_ptr() and torch.equal(converted, small)


def test_cpu_tensors_never_touch_cuda():
    """The device is read from each tensor: CPU tensors get pageable buffers (asking this CUDA-less torch for pinned
    memory would raise) and the ordering steps do nothing, without initializing CUDA."""
    assert not host_buffer((3,), torch.float32, torch.zeros(3)).is_pinned()
    transfers = Transfers()
    transfers.begin()
    out = transfers.copy(torch.empty(4), torch.arange(4.0).view(2, 2), (4,), torch.float32)
    transfers.end()
    transfers.fence()
    transfers.settle()
    assert torch.equal(out, torch.arange(4.0)) and not torch.cuda.is_initialized()


def test_pinned_buffers_are_exact_whole_pages_registered_while_they_live():
    """The CUDA branch of `host_buffer` page-locks an exact-size allocation (torch's pinned allocator would round
    it up to a power of two); here the registration is recorded instead of calling the CUDA runtime, which this
    torch lacks. The real call runs in bench/gpu/device_check.py (its buffers must be pinned)."""
    import gc

    from hf_unified_ckpt.checkpoint.save.device_copy import PAGE, registered_buffer

    locked: dict[int, int] = {}
    buffer = registered_buffer((3, 3001), torch.bfloat16, lambda a, n: locked.setdefault(a, n) == n, locked.pop)
    (address, length), = locked.items()
    assert buffer.shape == (3, 3001) and buffer.dtype == torch.bfloat16 and buffer.is_contiguous()
    assert buffer.data_ptr() == address and address % PAGE == 0
    assert buffer.untyped_storage().data_ptr() == address  # what CUDA's is_pinned() looks up: the storage's start
    assert buffer.nbytes == 18006 and length == 5 * PAGE  # whole pages: 20480 bytes, where torch's would take 32768
    buffer.copy_(torch.ones(3, 3001))  # writable
    assert float(buffer.float().sum()) == 9003
    view = buffer[1]
    del buffer
    gc.collect()
    assert locked == {}  # unregistered once the buffer is gone
    assert float(view.float().sum()) == 3001  # a view outliving it still reads its memory
    assert registered_buffer((4,), torch.float32, lambda a, n: False, locked.pop) is None  # refused: the caller pins


def test_pinned_buffers_are_faulted_in_before_they_are_locked():
    """The pages of a buffer made ahead exist before it is page-locked: faulted in by the preparing thread, not
    inside `cudaHostRegister`, where an H200 held the training thread 3.9 s (docs/gpu.md, issue 59). The resident
    memory of this process, read from /proc when `register` is called, already holds the buffer's 64 MiB."""
    from hf_unified_ckpt.checkpoint.save.device_copy import PAGE, registered_buffer

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE

    before, seen = resident(), []
    buffer = registered_buffer((64 * 2**20,), torch.uint8, lambda a, n: seen.append(resident()) is None,
                               lambda a: None)
    assert buffer is not None and len(seen) == 1
    assert seen[0] - before >= 60 * 2**20, f"only {(seen[0] - before) / 2**20:.1f} MiB resident when locked"
