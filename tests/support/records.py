"""Recordings of what a save did (its plans and collectives, hand-overs, aggregated cells, spare-file reuse,
host buffers), by wrapping library functions for the duration of a run.
"""

from __future__ import annotations

import contextlib
import itertools




@contextlib.contextmanager
def record_reuse():
    """Record what this rank's saves did with the memory tier's files: how many files were written over a spare
    file (`memory_tier.reuse_spare`), written (`MemoryTierWriter.write`), of them placed by the snapshot's copy
    straight into the file (`MemoryTierWriter.place`), copied into through a mapping made earlier; and the bytes of the
    snapshot's host buffers after each save's snapshot."""
    from hf_unified_ckpt.checkpoint.write import memory_tier
    from hf_unified_ckpt.checkpoint.save.snapshot import Snapshots
    from hf_unified_ckpt.store import WritableMaps

    originals = memory_tier.reuse_spare, memory_tier.MemoryTierWriter.write, WritableMaps.view, Snapshots.take
    record = {"spare": 0, "written": 0, "placed": 0, "mapped_before": 0, "host_buffer_bytes": []}
    seen = []

    def reuse(spare, ref):
        used = originals[0](spare, ref)
        record["spare"] += used
        return used

    def write(self, folder, file, tensors):
        record["written"] += 1
        record["placed"] += isinstance(tensors, memory_tier.Placed)
        return originals[1](self, folder, file, tensors)

    def view(self, path, size):
        mapped = originals[2](self, path, size)
        record["mapped_before"] += any(mapped.obj is old for old in seen)
        seen.append(mapped.obj)
        return mapped

    def stage(self, *args):
        job = originals[3](self, *args)
        record["host_buffer_bytes"].append(self.buffers.nbytes())
        return job

    tier = memory_tier.MemoryTierWriter
    memory_tier.reuse_spare, tier.write, WritableMaps.view, Snapshots.take = reuse, write, view, stage
    try:
        yield record
    finally:
        memory_tier.reuse_spare, tier.write, WritableMaps.view, Snapshots.take = originals


@contextlib.contextmanager
def record_buffers():
    """Record, on this rank, the host buffers the snapshot had made before each background save started
    (`AsyncSaver.start`; key -> buffer id, the background preparation joined first) and the buffers each save's
    copies went into (`HostBuffers.copy`; key -> the set of buffer ids)."""
    from hf_unified_ckpt.checkpoint.save.async_save import AsyncSaver
    from hf_unified_ckpt.checkpoint.save.snapshot import HostBuffers

    originals = AsyncSaver.start, HostBuffers.copy
    record = {"ready_at_start": [], "used": {}}

    def start(self, *args, **kwargs):
        buffers = self._snapshots.buffers
        buffers._join()
        record["ready_at_start"].append({key: id(b) for key, (b, _) in buffers._buffers.items()})
        return originals[0](self, *args, **kwargs)

    def copy(self, key, tensor, *args, **kwargs):
        out = originals[1](self, key, tensor, *args, **kwargs)
        record["used"].setdefault(key, set()).add(id(out))
        return out

    AsyncSaver.start, HostBuffers.copy = start, copy
    try:
        yield record
    finally:
        AsyncSaver.start, HostBuffers.copy = originals


@contextlib.contextmanager
def record_pieces():
    """Record, per component, the tensors the last save planned held in pieces by the ranks (each rank writes its
    piece in place; nothing of them is assembled on one rank): from the partition rule or the census of pieces."""
    from hf_unified_ckpt.checkpoint.save import saving as save

    original, recorded = save.plan_save, {}

    def plan_save(engine, request, *args, **kwargs):
        out = original(engine, request, *args, **kwargs)
        if out.pieces:
            recorded.clear()
            recorded.update({component: sorted(tensors) for component, tensors in out.pieces.items()})
        return out

    save.plan_save = plan_save
    try:
        yield recorded
    finally:
        save.plan_save = original


@contextlib.contextmanager
def record_aggregation():
    """Record, per save of this rank: the files its write strategy aggregated, the cells it wrote, the bytes it
    received from other ranks and sent, the peak of its cell buffers (`AggregatingWriter.peak_buffer_bytes`), and how
    many sharded tensors the engines assembled whole so far (DeepSpeed's `_assemble`, FSDP's `_full_on`). A save
    written by the writer process (`unified_checkpoint_async_executor="process"`) is recorded from the writer its
    outcome brings back from that process (`process`: True): its plans, and the peak its cells' writes left there."""
    from hf_unified_ckpt.checkpoint.save import executors
    from hf_unified_ckpt.checkpoint.write import aggregating
    from hf_unified_ckpt.engines import deepspeed, fsdp

    original, saves = aggregating.AggregatingWriter.write, []
    assembled = {"count": 0}  # sharded tensors the engines assembled whole (their own collectives)
    assemble, full_on = deepspeed.DeepSpeedEngine._assemble, fsdp._full_on

    def counted(fn):
        def wrapper(*args, **kwargs):
            assembled["count"] += 1
            return fn(*args, **kwargs)
        return wrapper

    serial = itertools.count()

    def save_of(writer, process: bool = False) -> dict:
        return {"writer": next(serial), "files": sorted(writer.plans), "cells": [], "received": 0, "sent": 0,
                "peak": 0, "buffer": writer.options.buffer_bytes, "process": process}

    def add_file(save: dict, writer, name: str) -> None:
        plan = writer.plans[name]
        save["cells"] += [(name, a, b) for a, b in plan.cells_of(writer.rank)]
        save["received"] += sum(h.end - h.start for h in plan.received_by(writer.rank))
        save["sent"] += sum(h.end - h.start for h in plan.sent_by(writer.rank))

    def write(self, folder, file, tensors):
        if not saves or saves[-1]["writer"] != vars(self).get("_recorded_as"):  # not id(): a freed id is reused
            saves.append(save_of(self))
            self._recorded_as = saves[-1]["writer"]
        if file.name in self.plans:
            add_file(saves[-1], self, file.name)
        out = original(self, folder, file, tensors)
        saves[-1]["peak"], saves[-1]["assembled"] = self.peak_buffer_bytes, assembled["count"]
        return out

    def finished(self, started, snapshot, fallback):  # the writer as it ended in the writer process (pickled back)
        outcome = run(self, started, snapshot, fallback)
        writer = outcome.writer
        if isinstance(writer, aggregating.AggregatingWriter) and snapshot[0]:
            saves.append(save_of(writer, process=True))
            for name in writer.plans:
                add_file(saves[-1], writer, name)
            saves[-1]["peak"] = writer.peak_buffer_bytes  # set by its cells' writes only: 0 unless it aggregated
        return outcome

    run = executors.ProcessExecutor.run
    aggregating.AggregatingWriter.write, executors.ProcessExecutor.run = write, finished
    deepspeed.DeepSpeedEngine._assemble, fsdp._full_on = counted(assemble), counted(full_on)
    try:
        yield saves
    finally:
        aggregating.AggregatingWriter.write, executors.ProcessExecutor.run = original, run
        deepspeed.DeepSpeedEngine._assemble, fsdp._full_on = assemble, full_on


#: The functions of `hf_unified_ckpt.dist` a save communicates through, counted by `record_plans`.
COUNTED = ("all_gather_object", "broadcast_object", "all_reduce_ints", "exchange_tensors", "recv_bytes")


def received_bytes(kind: str, result, args) -> int:
    """What one call received, counted as bench/bench_scale_sim.py counts it: an all-gather of objects N x (8 + the
    largest pickle), a broadcast 8 + the pickle (0 on its source), an all-reduce twice its vector, a message its
    bytes (8 more for its length)."""
    import pickle

    from hf_unified_ckpt import dist

    if kind == "all_gather_object":
        return len(result) * (8 + max(len(pickle.dumps(x)) for x in result))
    if kind == "broadcast_object":
        src = args[1] if len(args) > 1 else 0
        return 0 if dist.rank() == src else 8 + len(pickle.dumps(result))
    if kind == "all_reduce_ints":
        return 16 * len(args[0])
    if kind == "exchange_tensors":
        return sum(t.numel() * t.element_size() for t in result.values())
    return 8 + len(result)


@contextlib.contextmanager
def record_plans():
    """Per save: every collective and message this rank took part in through `hf_unified_ckpt.dist` ((kind, the
    function that called it, bytes received: `received_bytes`)), how the plan was made ("rule", "cached" or
    "census"), and, where the rule was used, whether its pieces are exactly every rank's held pieces (checked by one
    more gather of every rank's (first, count), left out of the count), with the number of tensors compared and of
    those whose pieces are uneven."""
    import sys

    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.save import rule_plan, saving as save

    saves, paused = [], [False]
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counted(name):
        def call(*args, **kwargs):
            result = originals[name](*args, **kwargs)
            if saves and not paused[0]:
                saves[-1]["calls"].append((name, sys._getframe(1).f_code.co_name, received_bytes(name, result, args)))
            return result
        return call

    def open_staging(*args, **kwargs):
        saves.append({"calls": [], "plan": None})
        return original_staging(*args, **kwargs)

    def plan_save(*args, **kwargs):
        plan = original_plan(*args, **kwargs)
        if saves:
            saves[-1]["files"] = plan.files
        return plan

    def agree(engine, components, request, shared):
        rule = original_agree(engine, components, request, shared)
        saves[-1]["plan"] = "census" if rule is None else "cached" if rule.cached is not None else "rule"
        if rule is not None:
            paused[0] = True
            try:
                saves[-1].update(_rule_against_held(engine, rule))
            finally:
                paused[0] = False
        return rule

    original_staging, original_agree, original_plan = save.open_staging, rule_plan.agree, save.plan_save
    for name in COUNTED:
        setattr(dist, name, counted(name))
    save.open_staging, rule_plan.agree, save.plan_save = open_staging, agree, plan_save
    try:
        yield saves
    finally:
        for name, f in originals.items():
            setattr(dist, name, f)
        save.open_staging, rule_plan.agree, save.plan_save = original_staging, original_agree, original_plan


def _rule_against_held(engine, rule) -> dict:
    """Every rank's held (first, count) of every tensor of every component, gathered, against the rule's for that
    rank. Collective."""
    from hf_unified_ckpt import dist

    held = {c: {n: (f.start, f.values.numel()) for n, f in engine.fragments(c).items()} for c in rule.pieces}
    everyone = dist.all_gather_object(held)
    compared = uneven = 0
    same = True
    for component, tensors in rule.pieces.items():
        for name, pieces in tensors.items():
            compared += 1
            counts = set()
            for rank, share in enumerate(everyone):
                first, count = share[component].get(name, (0, 0))
                expected = pieces.of(rank)
                counts.add(count)
                same &= count == expected[1] and (not count or first == expected[0])
            uneven += len(counts - {0}) > 1 or 0 in counts
        for rank, share in enumerate(everyone):
            same &= all(not count or name in tensors for name, (_, count) in share[component].items())
    return {"rule_equals_held": same, "compared": compared, "uneven": uneven}


@contextlib.contextmanager
def record_hand_overs():
    """Per file of every bucket save (`MultipartWriter.write`), [the bytes of other ranks this rank received on the
    hand-overs' gloo group, the bytes its plan hands over to it]: received point to point (`dist.irecv`) or by an
    all-gather of every rank's hand-overs (the others' bytes counted)."""
    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.write import multipart
    from hf_unified_ckpt.store import join

    originals = multipart.MultipartWriter.write, getattr(dist, "irecv", None), dist.all_gather_object
    files, current = {}, [None]

    def write(self, folder, file, tensors):
        plan = self.part_plan(file, join(folder, file.name))
        current[0] = files[file.name] = [0, sum(h.end - h.start for h in plan.received_by(self.rank))]
        try:
            return originals[0](self, folder, file, tensors)
        finally:
            current[0] = None

    def irecv(tensor, src, *args, **kwargs):
        if current[0] is not None:
            current[0][0] += tensor.nbytes
        return originals[1](tensor, src, *args, **kwargs)

    def all_gather_object(obj, group=None):
        out = originals[2](obj, group=group)
        if current[0] is not None and group is dist.gloo_group(multipart.GROUP):
            current[0][0] += sum(len(data) for r, sent in enumerate(out) if r != dist.rank() and sent
                                 for data in sent.values())
        return out

    multipart.MultipartWriter.write, dist.all_gather_object = write, all_gather_object
    if originals[1] is not None:
        dist.irecv = irecv
    try:
        yield files
    finally:
        multipart.MultipartWriter.write, dist.all_gather_object = originals[0], originals[2]
        if originals[1] is not None:
            dist.irecv = originals[1]
