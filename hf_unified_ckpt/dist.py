"""Thin wrappers over torch.distributed that also work without a process group (world size 1)."""

from __future__ import annotations

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Collective: all ranks must call it."""
    if is_distributed():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Collective: all ranks must call it. Returns every rank's `obj`, indexed by rank."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Collective: all ranks must call it. Returns rank `src`'s `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
