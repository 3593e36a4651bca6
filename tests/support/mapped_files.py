"""Which live tensors are backed by a file mapping (Linux, /proc/self/maps): what issue 47's tests assert never
happens after a resume. A tensor whose storage lies in a mapping of a checkpoint file (safetensors' `get_tensor`
returns views of one) dies with SIGBUS, or silently changes, when that file is truncated or rewritten later (the
memory tier reuses evicted checkpoints' files).

Anonymous memory (the heap, anonymous `mmap`s, `/dev/zero`, the memfd-backed shared memory torch uses) is owned
by the process; every other mapping with an inode is a file's.
"""

from __future__ import annotations

import bisect
import gc

import torch

#: Mappings with an inode that are not files a checkpoint could be read from (shared anonymous memory).
_ANONYMOUS = ("/dev/zero", "/memfd:", "/SYSV", "/dev/shm/torch_", "/torch_")


def file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file-backed mapping of this process, sorted by start."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0":
                continue
            path = fields[5].strip()
            if not path.startswith("/") or path.startswith(_ANONYMOUS):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, path))
    return sorted(out)


def _storage_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        if not storage.nbytes():
            return None
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # wrapper subclasses, storages freed (FSDP's unsharded)
        return None


def live_tensors() -> list[torch.Tensor]:
    """Every tensor object the garbage collector tracks (after a collection): parameters, gradients, optimizer
    state, EMA averages, anything a module or the Trainer keeps."""
    gc.collect()
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
        except ReferenceError:  # a dead weak proxy
            continue
    return tensors


def tensors_in_files(tensors: list[torch.Tensor] | None = None) -> list[tuple[tuple, str]]:
    """(shape, path) of each tensor (default: every live one) whose storage lies in a file mapping."""
    maps = file_mappings()
    starts = [m[0] for m in maps]
    found = []
    for tensor in live_tensors() if tensors is None else tensors:
        span = _storage_range(tensor)
        if span is None:
            continue
        i = bisect.bisect_right(starts, span[0]) - 1
        if i >= 0 and maps[i][0] <= span[0] < maps[i][1]:
            found.append((tuple(tensor.shape), maps[i][2]))
    return found
