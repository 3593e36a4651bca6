"""Faults injected into a save below the store or inside the library (kills mid-write, failing encodes,
broken rules), and checkpoints tampered with after the fact. Store faults go through `faulty_store`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time

import torch


FAULTS: dict[str, bool] = {}


def record_fault(name: str, survived: bool) -> None:
    """Fault-injection tests report here; the run ends with a summary line of faults tried and survived."""
    FAULTS[name] = survived


def resign(ckpt, name: str) -> None:
    """What anyone crafting a file does (a CRC-32 is a checksum, not a signature): record file `name`'s new size and
    CRC-32 in the checkpoint's manifest, so that its checksums match again."""
    import json

    from hf_unified_ckpt.checkpoint.folder.files import file_crc32

    path = os.path.join(str(ckpt), "unified_checkpoint.json")
    with open(path) as f:
        manifest = json.load(f)
    file = os.path.join(str(ckpt), name)
    manifest["files"][name] = {"size": os.path.getsize(file), "crc32": file_crc32(file)}
    with open(path, "w") as f:
        json.dump(manifest, f)


def rewrite_tensor(ckpt, stem: str, key: str, change) -> str:
    """Replace tensor `key` of component `stem` by `change(tensor)` in the safetensors file holding it, and re-sign
    that file (`resign`). Returns the file's name."""
    import json

    from safetensors.torch import load_file, save_file

    with open(os.path.join(str(ckpt), f"{stem}.safetensors.index.json")) as f:
        name = json.load(f)["weight_map"][key]
    path = os.path.join(str(ckpt), name)
    tensors = load_file(path)
    tensors[key] = change(tensors[key]).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    resign(ckpt, name)
    return name


@contextlib.contextmanager
def slow_snapshot(seconds: float):
    """An async save's snapshot sleeps before it copies: a training step that did not wait for the copy would
    change the weights or optimizer state first, and the resume from that checkpoint would not be exact."""
    from hf_unified_ckpt.checkpoint.save.snapshot import Snapshots

    original = Snapshots.take

    def late(self, *args):
        time.sleep(seconds)
        return original(self, *args)

    Snapshots.take = late
    try:
        yield
    finally:
        Snapshots.take = original


def die_at_commit(when: str, nth: int):
    """This process dies as under kill -9 (no cleanup, no exception) at its `nth` folder commit (the store's
    `publish` of a `checkpoint-N` folder), "before" or "after" the rename that commits its folder."""
    from support.faulty_store import die, injected, on
    from support.faulty_store import nth as nth_call
    from hf_unified_ckpt.store import name_of

    def dying(call):
        if when == "before":
            die()
        call.proceed()
        die()

    return injected(on("publish", nth_call(nth, lambda call: re.fullmatch(r"checkpoint-\d+", name_of(call.args[1]))),
                       dying))


def memory_full_from(step: int):
    """Writes into the memory tier's checkpoints of `step` and later fail with ENOSPC (a full tmpfs), on every
    rank: what a full `/dev/shm` does, without filling the real one (it is RAM)."""
    from support.faulty_store import fail_with, injected, no_space, on

    def full(call) -> bool:
        match = re.search(r"/hf_unified_ckpt/.*checkpoint-(\d+)", call.ref)
        return match is not None and int(match.group(1)) >= step

    return injected(on(("write_whole", "write_at", "map_writable"), full, fail_with(no_space)))


@contextlib.contextmanager
def aggregation_fault(fault: str, rank: int, step: int, seen: dict, keep=lambda: None):
    """A fault on rank `rank` in the aggregated save of `step` (`AggregatingWriter`), into the first file it
    aggregates (it writes cells of it) or, for "kill_sender" and "encode", the first it sends pieces of:
    "kill_aggregator" dies as under kill -9 once its first cell of that file is written ("died" in `seen`: when,
    saved by `keep` first);
    "kill_sender" dies before it sends any piece of a file it does not aggregate; "enospc": its cell writes into
    that file fail with ENOSPC (the store's `write_at`; "fired": when first); "slow": every cell write of that save
    sleeps 0.1 s ("slow_until": when the last ended); "encode": encoding its pieces of that file raises ("fired");
    "fail_aggregator": its first cell of the first file where bytes are announced to it (`unknown_bytes`) fails
    before any is received (`copy_held`; "fired"). On rank 0, "committed":
    when the save's folder was committed (the store's `publish`). The cell writes and the commit are faulted
    through the store (`faulty_store`), the rest by rebinding the aggregating writer's own functions."""
    from support.faulty_store import injected, no_space
    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.write import aggregating
    from hf_unified_ckpt.format.planning import FilePlan

    originals = (aggregating.AggregatingWriter.write, FilePlan.encoded, aggregating.copy_held)
    armed = {}  # the file the fault hits, once chosen

    def write(self, folder, file, tensors):
        plan = self.plans.get(file.name)
        if plan is not None and "timeouts" not in seen:  # the default group's and the `aggregate` group's, seconds
            seen["timeouts"] = [_timeout_s(g) for g in (dist.cpu_group(), dist.gloo_group(aggregating.GROUP))]
        if dist.rank() == rank and f".checkpoint-{step}." in str(folder) and plan is not None and not armed:
            sends = bool(plan.sent_by(rank))
            if fault in ("kill_aggregator", "enospc", "slow") and plan.aggregates(rank) or (
                    fault == "encode" and sends) or (fault == "kill_sender" and sends and not plan.aggregates(rank)) or (
                    fault == "fail_aggregator" and any(plan.unknown_bytes(a, b) for a, b in plan.cells_of(rank))):
                armed.update(name=file.name, folder=str(folder))
                seen["file"] = file.name
                armed["writing"] = fault == "fail_aggregator"  # its first cell of that file fails (`copy_held`)
                if fault == "kill_sender":
                    _die(seen, keep)
        return originals[0](self, folder, file, tensors)

    def write_at(call):
        ref = call.ref
        hit = armed and ref.startswith(armed["folder"]) and (fault == "slow" or ref.endswith(armed["name"]))
        if hit and fault == "enospc":
            seen.setdefault("fired", time.time())
            raise no_space(ref)
        if hit and fault == "slow":
            time.sleep(0.1)
        written = call.proceed()
        if hit and fault == "slow":
            seen["slow_until"], seen["slow_writes"] = time.time(), seen.get("slow_writes", 0) + 1
        if hit and fault == "kill_aggregator":
            _die(seen, keep)
        return written

    def copy_held(buffer, start, held):
        if fault == "fail_aggregator" and armed and armed.get("writing"):
            armed["writing"] = False
            seen.setdefault("fired", time.time())
            raise RuntimeError(f"injected: aggregating {armed['name']} failed on rank {rank}")
        return originals[2](buffer, start, held)

    def encoded(self, tensors, r):
        if fault == "encode" and armed and self.name == armed["name"] and r == rank:
            seen.setdefault("fired", time.time())
            raise RuntimeError(f"injected: encoding {self.name} failed on rank {r}")
        return originals[1](self, tensors, r)

    def committed(call):
        call.proceed()
        if f"checkpoint-{step}" in str(call.args[1]):
            seen["committed"] = time.time()

    def store_faults(call):
        return {"write_at": write_at, "publish": committed}.get(call.method, lambda c: c.proceed())(call)

    aggregating.AggregatingWriter.write, FilePlan.encoded, aggregating.copy_held = write, encoded, copy_held
    try:
        with injected(store_faults):
            yield
    finally:
        aggregating.AggregatingWriter.write, FilePlan.encoded, aggregating.copy_held = originals


def _timeout_s(group) -> float:
    """A gloo group's timeout (None: the default group), seconds."""
    import torch.distributed.distributed_c10d as c10d

    group = group if group is not None else c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _die(seen: dict, keep) -> None:
    """Record when, then die as under kill -9 (no clean-up)."""
    seen["died"] = time.time()
    keep()
    os._exit(9)


@contextlib.contextmanager
def broken_rule():
    """DeepSpeed's declared partition rule off by one element (its ZeRO-1/2 offsets, ZeRO-3's piece size), as an
    engine whose real layout is not the one it declares: the save must see it and take the census."""
    from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine
    from hf_unified_ckpt.format.planning import Strided

    original = DeepSpeedEngine._strided

    def strided(self, name):
        s = original(self, name)
        return Strided(s.numel, s.size + 1, s.shift) if self.stage == 3 else Strided(s.numel, s.size, s.shift + 1)

    DeepSpeedEngine._strided = strided
    try:
        yield
    finally:
        DeepSpeedEngine._strided = original


@contextlib.contextmanager
def unreadable_bytes(rank: int):
    """On rank `rank`, a bucket save cannot produce its bytes of any file (as a failed device-to-host copy): the
    ranks it hands bytes over to must not wait for them, and the save must fail on every rank."""
    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.write import multipart

    original = multipart.rank_ranges

    def failing(file, r, tensors):
        if r == rank == dist.rank():
            raise OSError(f"injected: rank {rank} could not read its bytes of {file.name}")
        return original(file, r, tensors)

    multipart.rank_ranges = failing
    try:
        yield
    finally:
        multipart.rank_ranges = original


@contextlib.contextmanager
def die_mid_write(rank: int, step: int):
    """Rank `rank` dies as under kill -9 in the middle of its first in-place write into a file that several ranks
    write, in the save of `step`: the file exists (at its final size, if the header rank got there first) with half
    of this rank's ranges written; the other ranks are stopped by the launcher."""
    import dataclasses

    import hf_unified_ckpt.checkpoint.write.writer as writer

    original = writer.write_ranges

    def dying(path, file, r, tensors, **kwargs):
        if r == rank and f".checkpoint-{step}." in str(path) and len(file.writers) > 1:
            mine = file.items_of(r)
            kept = {item.name for item in mine[: max(1, len(mine) // 2)]}  # its first half (the layout's own order)
            half = tuple(e for e in file.layout if e[0] in kept)
            original(path, dataclasses.replace(file, layout=half), r, tensors, **kwargs)
            os._exit(9)
        return original(path, file, r, tensors, **kwargs)

    writer.write_ranges = dying
    try:
        yield
    finally:
        writer.write_ranges = original
