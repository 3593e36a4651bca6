"""Thin wrappers over torch.distributed that also work without a process group (world size 1).

torch.distributed is imported on first call, so that modules which only may communicate (`placement.py`) import
without torch (the `hf-unified-ckpt info` / `verify` command line loads none)."""

from __future__ import annotations

import os


def _torch_dist():
    import torch.distributed

    return torch.distributed


def is_distributed() -> bool:
    dist = _torch_dist()
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return _torch_dist().get_rank() if is_distributed() else 0


def world_size() -> int:
    return _torch_dist().get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Collective: all ranks must call it."""
    if is_distributed():
        _torch_dist().barrier()


def all_gather_object(obj, group=None) -> list:
    """Collective (on `group`, default: all ranks): all its ranks must call it. Returns every rank's `obj`."""
    if not is_distributed():
        return [obj]
    dist = _torch_dist()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """Collective (on `group`, default: all ranks): all its ranks must call it. Returns rank `src`'s `obj`."""
    if not is_distributed():
        return obj
    box = [obj]
    _torch_dist().broadcast_object_list(box, src=src, group=group)
    return box[0]


def reduce_to(tensor, owner: int) -> None:
    """Sum `tensor` over all ranks into rank `owner`'s copy (others' copies are left undefined). Collective: all
    ranks must call it; without a process group, nothing to do."""
    if is_distributed():
        _torch_dist().reduce(tensor, dst=owner, group=cpu_group() if tensor.device.type == "cpu" else None)


def cpu_group():
    """The group over all ranks for collectives on CPU tensors: the default group (None) where its backend takes CPU
    tensors (gloo, MPI, or a pair such as "cpu:gloo,cuda:nccl"), else a gloo group (`gloo_group`), since an NCCL
    default group takes CUDA tensors only. Collective where it creates that group: call it from collectives only."""
    if not is_distributed():
        return None
    backend = str(_torch_dist().get_backend())
    return None if "gloo" in backend or backend == "mpi" else gloo_group("cpu tensors")


def new_gloo_group(timeout=None):
    """A second group over all ranks, for collectives of a background thread (never interleaved with the
    training thread's collectives on the default group); `timeout` (a timedelta) where given, else torch's default
    for a new group (30 minutes, whatever the default group's). Collective: all ranks must call it."""
    return _torch_dist().new_group(backend="gloo", timeout=timeout) if is_distributed() else None


def default_timeout():
    """The default group's timeout (the job's: the Trainer's `ddp_timeout`, or its launcher's), as a timedelta;
    None where torch does not say (a new group then gets torch's default). Local."""
    if not is_distributed():
        return None
    group = _torch_dist().distributed_c10d._get_default_group()
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


_GROUPS: dict[tuple, object] = {}


def gloo_group(purpose: str, timeout=None):
    """A gloo group over all ranks for one `purpose` (a background thread's collectives, or the file service's
    messages), created once per process group and reused; `timeout` as `new_gloo_group`'s, at its creation.
    Collective on first call: all ranks must call it."""
    key = (_torch_dist().group.WORLD if is_distributed() else None, purpose)
    if key not in _GROUPS:
        _GROUPS[key] = new_gloo_group(timeout)
    return _GROUPS[key]


def release_groups() -> None:
    """Destroy the groups `gloo_group` created (a later call creates them again), so none outlives the `train()`
    call that used it: a group's C++ threads then end now, not during interpreter finalization. Local: destroying a
    gloo group involves no peer."""
    groups, _ = list(_GROUPS.items()), _GROUPS.clear()
    if not is_distributed():
        return
    dist = _torch_dist()
    live = dist.distributed_c10d._world.pg_map
    for (world, _purpose), group in groups:
        if group is not None and world is dist.group.WORLD and group in live:
            dist.destroy_process_group(group)


def destroy_default_group() -> None:
    """Destroy the default process group (and every group with it) if it is still there. For interpreter exit only:
    a gloo group still alive when the interpreter finalizes aborts the process ("terminate called without an active
    exception", SIGABRT) instead of letting it exit with its status, which happens whenever `train()` ends by an
    exception (a preemption, an error) and skips the script's own `destroy_process_group()`. Local for gloo."""
    _GROUPS.clear()
    if is_distributed():
        _torch_dist().destroy_process_group()


def local_rank() -> int:
    """This process's index on its machine (LOCAL_RANK, set by torchrun, accelerate and the DeepSpeed launcher);
    the global rank when the launcher did not set it."""
    return int(os.environ.get("LOCAL_RANK", rank()))


# ---- fixed-size and point-to-point messages (issue 57: save metadata linear in the ranks) -------------------------
# Tensor collectives of a few integers (statuses, digests, counts) and point-to-point messages between the ranks
# that need them, on CPU tensors (`cpu_group`: the default group where it takes CPU tensors, else a gloo group), so
# that nothing is staged in GPU memory. Without a process group each is the identity (one rank).


def all_reduce_ints(values: list[int], op: str = "sum", group=None) -> list[int]:
    """`values` (int64 each) reduced elementwise over all ranks with `op` ("sum", "min" or "max"). Collective (on
    `group`, default: all ranks on CPU tensors): all its ranks must call it with as many values."""
    if not is_distributed():
        return list(values)
    import torch

    dist = _torch_dist()
    tensor = torch.tensor(values, dtype=torch.int64)
    reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(tensor, op=reduce_op, group=group if group is not None else cpu_group())
    return tensor.tolist()


def send_bytes(data: bytes, dst: int, group=None) -> None:
    """Send `data` to rank `dst` (its length first). Point-to-point: `dst` must call `recv_bytes` from this rank."""
    import torch

    dist = _torch_dist()
    group = group if group is not None else cpu_group()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def recv_bytes(src: int, group=None) -> bytes:
    """The bytes rank `src` sends with `send_bytes`. Point-to-point."""
    import torch

    dist = _torch_dist()
    group = group if group is not None else cpu_group()
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    if not int(size):
        return b""
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return data.numpy().tobytes()


def isend(tensor, dst: int, group=None, tag: int = 0):
    """Post a non-blocking send of `tensor` (CPU, contiguous) to rank `dst`; the request to `wait()` on (`tensor` must
    live until then). Point-to-point: `dst` posts a receive of as many bytes with the same tag (gloo matches the
    messages of one pair of ranks and one tag in the order they were posted)."""
    return _torch_dist().isend(tensor, dst, group=group if group is not None else cpu_group(), tag=tag)


def irecv(tensor, src: int, group=None, tag: int = 0):
    """Post a non-blocking receive into `tensor` (CPU, contiguous) from rank `src` (`isend`'s); the request to
    `wait()` on. Point-to-point."""
    return _torch_dist().irecv(tensor, src, group=group if group is not None else cpu_group(), tag=tag)


def recv_any(tensor, group=None, tag: int = 0) -> int:
    """Receive into `tensor` (CPU, contiguous) the first message of `tag` from any rank; that rank. Point-to-point:
    the sender posts an `isend` of as many bytes with the same tag."""
    return _torch_dist().recv(tensor, None, group=group if group is not None else cpu_group(), tag=tag)


def exchange_tensors(sends: dict, receives: dict, group=None) -> dict:
    """Send `sends[rank]` (a 1-D CPU tensor) to each rank and receive from each rank in `receives` a tensor of the
    (numel, dtype) given there, all in flight together. Point-to-point: every pair's sender and receiver call it
    (with matching sizes). Returns the received tensors by source rank."""
    if not sends and not receives:
        return {}
    import torch

    dist = _torch_dist()
    group = group if group is not None else cpu_group()
    out = {src: torch.empty(numel, dtype=dtype) for src, (numel, dtype) in receives.items()}
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group=group) for dst, t in sorted(sends.items())]
    ops += [dist.P2POp(dist.irecv, t, src, group=group) for src, t in sorted(out.items())]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


def exclusive_scan_ints(values: list[int], group=None) -> list[int]:
    """Elementwise sums of `values` over the ranks below this one (rank 0: zeros), by recursive doubling: about
    log2(N) rounds, each one message of len(values) int64 sent and one received. Collective (point-to-point
    between ranks d apart): all ranks must call it with as many values."""
    if not is_distributed() or not values:
        return [0] * len(values)
    import torch

    n, me = world_size(), rank()
    total = torch.tensor(values, dtype=torch.int64)
    step = 1
    while step < n:
        sends = {me + step: total.clone()} if me + step < n else {}
        receives = {me - step: (len(values), torch.int64)} if me - step >= 0 else {}
        got = exchange_tensors(sends, receives, group=group)
        if me - step >= 0:
            total += got[me - step]
        step *= 2
    return (total - torch.tensor(values, dtype=torch.int64)).tolist()
