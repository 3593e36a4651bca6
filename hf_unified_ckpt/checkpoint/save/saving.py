"""The save algorithm: one algorithm, the same with and without a process group, for every store (`store/`: every
byte goes through `store_for(ref)`; a checkpoint is a string reference, a local path or a URL), and for every
executor (`executors.py`: the synchronous save runs it inline, `async_save` in a thread or a writer process).

It is cut once, where the snapshot is taken:

- on the training thread, `begin` (collective): rank 0 creates the staging folder (`Store.stage`:
  `.checkpoint-N.<host>.<pid>.<token>.incomplete`, this save's own, where the store renames atomically, else
  `checkpoint-N` itself, committed by its manifest); ranks that cannot see it (their machine has its own local folder)
  create their own; every rank computes the same shard plan (`plan_save`: from the engine's partition rule, cached
  across saves, where it has one: `rule_plan`; else from a census of every rank's pieces); the write strategy is
  chosen from the store's capabilities and the options, and set up (`choose_writer`: pieces in place where every
  rank sees the folder and the store writes at offsets, or through a few aggregators per file where a file would
  have many writers (`aggregating.py`); parts of multipart uploads on an object store; into machine-local folders,
  each file by its one writer from the pieces the others send it); file by file, the tensors no rank holds in one
  contiguous piece are assembled by the engine on the rank that writes them;
- then the snapshot: the live tensors themselves (synchronous save) or host copies (`snapshot.py`), held by a
  `PersistJob` with the small files as bytes;
- after it, `finish`, wherever the executor runs it (collective on its group): every rank writes its files
  (`PersistJob.run`); the ranks agree on success by an all-reduce and their records reach rank 0 as one record
  per file (`conclude`, `record_tree`; a failure gathers every rank's `Failure`); rank 0 completes the
  strategy, writes the index files and the manifest (last); the leader of every other folder copies rank 0's small
  files and manifest into it; every leader publishes its staging folder as `checkpoint-N` (`Store.publish`: a
  rename, or nothing where the manifest is the commit). The `Outcome` is the same on every rank; its leader then
  runs `after_commit` (rotation), and every rank raises its error if it failed (`Outcome.after_commit_or_raise`).

Any failure on any rank aborts the save on every rank: the staging folders are removed and nothing is committed.
With machine-local folders, each folder holds the manifest, the small files and its machine's share of the
tensor files; the union of the folders is the checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import logging
import math
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from tqdm.auto import tqdm

from ... import dist
from ...format.codecs import MomentCodec, ResidualCodec, count_ties
from ...format.components import MASTER, Component, Role, component
from ...engines.base import ConfirmsRule, EngineAdapter, MasterFragments
from ...errors import UnifiedCheckpointError
from ...options import UnifiedCheckpointOptions
from . import record_tree, rule_plan
from .persist import PersistJob, write_small_files
from ..write.reports import Failure, guarded, out_of_space
from ...format.planning import (ComponentPlan, Encoder, FilePlan, HaloEncoder, Pieces, TensorSpec, file_plans,
                               piecewise, plan_component, stored_pieces, tiling)
from ..folder.commit import (WRITER_MARK, commit, join_staging, mark_writer, new_tag, prepare_staging, remove_stale,
                     remove_writer_marks, sees_writer, staging_dir)
from ..folder.files import FileRecord, RangeRecord, combine_ranges, put_file
from ...store import (STAGING_SUFFIX, as_ref, join, multipart_of, name_of, parent_of, positional_writes_of,
                     store_for)
from ..folder.manifest import MANIFEST_NAME, ComponentEntry, build_manifest, codec_summary, write_manifest
from ..folder.safetensors_io import index_name, write_index
from ..write.aggregating import AggregatingWriter
from ..write.multipart import MultipartWriter
from ..write.memory_tier import MemoryTierWriter
from ..write.writer import SharedFileWriter, StorageWriter, WholeFileWriter

logger = logging.getLogger(__name__)

#: This rank's non-tensor files (RNG, and on rank 0 trainer state, scheduler, configs, tokenizer...): name -> bytes.
SmallFiles = Mapping[str, bytes]


@dataclass(frozen=True)
class SaveRequest:
    """Where and what to save."""

    final_dir: str | os.PathLike  # a store reference (`store.base`): a local path or a URL
    global_step: int
    options: UnifiedCheckpointOptions
    include_optimizer: bool = True
    show_progress: bool = True
    #: The whole blocks of the tensor files go to disk with direct I/O, several writes in flight
    #: (`store.direct.write_at_direct`), where the filesystem allows: a save writes at the disk's speed and leaves the
    #: job's page cache alone. False for the memory tier, whose files are memory read back by the persister, and
    #: where the user turned it off (`unified_checkpoint_direct_io=False`).
    direct_io: bool = True
    #: A folder of files an evicted checkpoint left (the memory tier): a file this rank writes alone takes the place
    #: of the spare file of the same name and overwrites its memory (`MemoryTierWriter`), rather than being created.
    spare: str | None = None


@dataclass(frozen=True)
class SavePlan:
    """Everything the save writes besides tensor bytes, fixed when the save starts (an async save finishes
    while training goes on, so nothing may be read from the live engine later): the shard plan of every
    component, the optimizer's param-group metadata, and how the checkpoint was saved."""

    components: dict[str, ComponentPlan]
    saved_by: dict
    pieces: dict[str, dict[str, Pieces]] = dataclasses.field(default_factory=dict)  # component -> tensor -> pieces
    #: The file plans, where they were made already (a plan reused from an earlier save, `rule_plan`).
    planned: tuple[FilePlan, ...] | None = dataclasses.field(default=None, repr=False)

    @functools.cached_property
    def files(self) -> list[FilePlan]:
        """Every file with its header and write items, in the order all ranks walk them (made once per plan)."""
        if self.planned is not None:
            return list(self.planned)
        return [f for name, cplan in self.components.items() for f in file_plans(cplan, self.pieces.get(name))]


def plan_save(engine: EngineAdapter, request: SaveRequest, shared: bool = False, rank_local: bool = False) -> SavePlan:
    """The save plan, identical on all ranks; with `shared` (every rank sees the staging folder), the tensors the
    ranks hold in pieces are planned to be written in place. With `rank_local` too (the ranks write their pieces
    in place themselves: no multipart hand-overs), an engine that follows a partition rule gives the pieces in
    closed form, checked against what each rank holds, and the plan is reused by the next saves of the same
    shapes, world and options (`rule_plan`); else every rank's pieces are gathered (`census_of_pieces`).
    Collective (one all-reduce of the rule's check; or locality hints of sharded engines and the census of
    pieces): all ranks must call it."""
    components = [c for c in engine.components() if request.include_optimizer or c.role is not Role.OPTIMIZER]
    rule = rule_plan.agree(engine, components, request, shared) if shared and rank_local else None
    if rule is not None and isinstance(engine, ConfirmsRule):
        engine.confirm_rule()
    if rule is not None and rule.cached is not None:
        return _reused(rule.cached, engine, request, components, rule)
    plans = {c.name: _component_plan(c, engine, request, rule) for c in components}
    if rule is None:
        return SavePlan(plans, copy.deepcopy(engine.saved_by()), census_of_pieces(engine, plans) if shared else {})
    pieces = rule_plan.pieces_of(rule, plans)
    rule_plan.exchange_halos(engine, plans, pieces)
    plan = SavePlan(plans, copy.deepcopy(engine.saved_by()), pieces)
    rule_plan.remember(rule, plan)
    return plan


def _component_plan(c: Component, engine: EngineAdapter, request: SaveRequest, rule, codec=False,
                    specs: list[TensorSpec] | None = None) -> ComponentPlan:
    """One component's shard plan with its index metadata (collective where its codec takes a census, unless the
    `codec` is given; `specs`: the engine's, where the caller has them)."""
    codec = encoder_for(c, engine, request.options, rule) if codec is False else codec
    specs = engine.specs(c.name) if specs is None else specs
    plan = plan_component(c.name, specs, dist.world_size(), request.options.max_shard_size,
                          file_stem=c.file_stem, owners=engine.preferred_owners(c.name), codec=codec)
    return dataclasses.replace(plan, index_metadata=_index_metadata(c, engine, codec))


def _residual_plan(c: Component, cached: ComponentPlan, engine: EngineAdapter, request: SaveRequest,
                   rule) -> ComponentPlan:
    """The residual master weights' plan at a later save: its census taken again (the ties follow the data); the
    cached files and owners kept where every tensor has as many ties as when they were planned (the stored shapes
    are the same), else planned again from this census. Collective (the census).

    The engine's specs are the cached plan's (the digest that found it covers them)."""
    codec = encoder_for(c, engine, request.options, rule, names=list(cached.specs))
    if codec.census != cached.codec.census:
        return _component_plan(c, engine, request, rule, codec, specs=list(cached.specs.values()))
    stored = {s.name: codec.stored_specs(s) for s in cached.specs.values()}
    return dataclasses.replace(cached, codec=codec, stored=stored, index_metadata=_index_metadata(c, engine, codec))


def _index_metadata(c: Component, engine: EngineAdapter, codec) -> dict:
    metadata = copy.deepcopy(engine.optimizer_metadata()) if c.role is Role.OPTIMIZER else {}
    if codec is not None:
        metadata["codec"] = codec.metadata()
    return metadata


def _reused(cached: SavePlan, engine: EngineAdapter, request: SaveRequest, components, rule) -> SavePlan:
    """A plan made at an earlier save of the same digest, with what changes from save to save made again: the
    index metadata (the optimizer's param groups), the halos of a block codec (a fresh codec object, so that an
    earlier save still writing keeps its own), and a component whose files depend on the data (the residual's
    ties). Collective (the halos, the residual's census): all ranks must call it."""
    plans, files, fresh = {}, [], {}
    for c in components:
        cplan = cached.components[c.name]
        if isinstance(cplan.codec, ResidualCodec):
            fresh[c.name] = plans[c.name] = _residual_plan(c, cplan, engine, request, rule)
            continue
        codec = copy.copy(cplan.codec) if cplan.codec is not None else None
        plans[c.name] = dataclasses.replace(cplan, codec=codec, index_metadata=_index_metadata(c, engine, codec))
    pieces = {**cached.pieces, **rule_plan.pieces_of(rule, fresh)}
    rule_plan.exchange_halos(engine, {n: p for n, p in plans.items() if n not in fresh}, pieces)
    old: dict[str, list[FilePlan]] = {name: [] for name in plans}  # the cached files by component
    for f in cached.files:
        old[f.component].append(f)
    for name, cplan in plans.items():
        if name in fresh:
            files += _residual_files(cplan, cached, old[name], pieces.get(name))
        else:
            files += [f if f.codec is None else f.with_codec(cplan.codec) for f in old[name]]
    return SavePlan(plans, copy.deepcopy(engine.saved_by()), pieces, planned=tuple(files))


def _residual_files(cplan: ComponentPlan, cached: SavePlan, old: list[FilePlan], pieces) -> list[FilePlan]:
    """The residual component's files at a later save: where its plan kept the cached files (`old`: as many ties
    per tensor), the cached files with this save's ties laid out (headers kept), else made again."""
    if cplan.files is not cached.components[cplan.component].files:
        return file_plans(cplan, pieces)
    stored = stored_pieces(cplan, pieces or {})
    if any(n not in stored for f in old for n in f.pieces):
        return file_plans(cplan, pieces)
    return [f.with_pieces(cplan.codec, stored) for f in old]


def census_of_pieces(engine: EngineAdapter, plans: dict[str, ComponentPlan]) -> dict[str, dict[str, Pieces]]:
    """Per component, the tensors the ranks together hold exactly once in contiguous pieces, with every rank's
    piece (`planning.tiling`); every component gets an entry, so a plan made for a shared folder is never empty.
    A codec that encodes blocks across pieces (`HaloEncoder`) receives every rank's `halo` (the few elements its
    neighbours need). Collective (one all-gather of the pieces' bounds and halos): all ranks must call it."""
    local = {}
    for name, cplan in plans.items():
        if piecewise(cplan.codec):
            halo = cplan.codec.halo if isinstance(cplan.codec, HaloEncoder) else None
            local[name] = {n: (f.start, f.values.numel(), halo(n, f.start, f.values) if halo else None)
                           for n, f in engine.fragments(name).items()}
    everyone = dist.all_gather_object(local)
    out: dict[str, dict[str, Pieces]] = {}
    for name, cplan in plans.items():
        held, halos = {}, {}
        for rank, share in enumerate(everyone):
            for tensor, (start, count, halo) in share.get(name, {}).items():
                held.setdefault(tensor, []).append((rank, start, count))
                if halo is not None:
                    halos.setdefault(tensor, {})[start] = halo
        if isinstance(cplan.codec, HaloEncoder):
            cplan.codec.receive_halos(halos)
        out[name] = {t: p for t, bounds in held.items()
                     if (p := tiling(math.prod(cplan.specs[t].shape), bounds)) is not None}
    return out


def encoder_for(c: Component, engine: EngineAdapter, options: UnifiedCheckpointOptions, rule=None,
                names: list[str] | None = None) -> Encoder | None:
    """The codec that stores component `c` (None: stored as it is): O1/O2 for optimizer moments, the bf16 residual
    for master weights (`names`: the component's tensors, where the caller has them). Collective for the residual
    (a census of every rank's fragments: summed by an all-reduce where the save follows a partition `rule`, else
    gathered): all ranks must call it."""
    if c.role is Role.OPTIMIZER and options.quant_stage != "O0":
        return MomentCodec(options.quant_stage)
    if c.name == MASTER.name and options.residual_master_weight:
        if rule is not None:
            return rule_plan.residual_census(engine, names or [s.name for s in engine.specs(c.name)])
        census, by_rank = residual_census(engine)
        return ResidualCodec(census, by_rank=by_rank)
    return None


def residual_census(engine: EngineAdapter) -> tuple[dict[str, int], dict[str, dict[int, int]]]:
    """Master tensors whose every element the bf16 residual rebuilds exactly (the engine's bf16 weights are exactly
    their rounding), with their number of ties summed over the fragments of every rank, and each rank's ties; a
    tensor that fails on any rank is left out (stored as plain fp32). Collective: all ranks must call it."""
    fragments = engine.master_fragments() if isinstance(engine, MasterFragments) else []
    local = {name: count_ties(hp, lp) for name, hp, lp in fragments}
    by_rank: dict[str, dict[int, int | None]] = {}
    for rank, share in enumerate(dist.all_gather_object(local)):
        for name, ties in share.items():
            by_rank.setdefault(name, {})[rank] = ties
    ok = {name: ranks for name, ranks in by_rank.items() if None not in ranks.values()}
    return {name: sum(ranks.values()) for name, ranks in ok.items()}, ok


def save_checkpoint(engine: EngineAdapter, request: SaveRequest, small_files: SmallFiles,
                    after_commit: Callable[[], None] | None = None) -> str:
    """Write and commit one unified checkpoint at `request.final_dir`; then each folder's leader runs
    `after_commit` (rotation). The synchronous save: the algorithm run inline, each file written by a writer thread
    while the next is assembled.

    Collective: all ranks must call it. Returns the committed folder; raises `UnifiedCheckpointError` on every
    rank if any rank failed, leaving no `checkpoint-N` behind (an existing complete one stays untouched where the
    store renames atomically; where the manifest is the commit, a save of a step that already has a checkpoint
    writes in its place: that one is removed, manifest first, when the save begins).
    """
    started = begin(engine, request, small_files, lazily=True)
    started.job.files = started.live_files(engine)
    return finish(started, (True, started.job)).after_commit_or_raise(after_commit)


@dataclass
class Started:
    """A save whose training-thread half is done (`begin`): its request, staging folder, plan, write strategy
    (set up), the files this rank writes, assembled (or, for the synchronous save, assembled as they are
    walked), and the job that will write them, holding the small files (its tensors come with the snapshot).
    Picklable once `files` is a list: the process executor sends it to its writer."""

    request: SaveRequest
    staging: Staging
    plan: SavePlan
    writer: StorageWriter
    files: list[FilePlan] | Iterator[FilePlan]
    job: PersistJob

    def live_files(self, engine: EngineAdapter) -> Iterator[tuple[FilePlan, Mapping]]:
        """Each file this rank writes with the live tensors it writes of it (the synchronous save: no copy)."""
        return ((file, self.writer.local_tensors(engine, file)) for file in self.files)


def begin(engine: EngineAdapter, request: SaveRequest, small_files: SmallFiles, lazily: bool = False) -> Started:
    """The half of a save that runs on the training thread: the staging folder (`open_staging`), the plan
    (`plan_save`), the write strategy chosen from the store's capabilities and set up (`choose_writer`,
    `StorageWriter.set_up`), the files this rank writes, assembled on their writers in plan order (`lazily`: as
    `Started.files` is walked, which must then happen on this thread), and the job with `small_files`.
    Collective: all ranks must call it."""
    staging = open_staging(as_ref(request.final_dir))
    gathered = sends_pieces(staging, request)
    with paused_gc():
        plan = plan_save(engine, request, shared=staging.in_place or gathered,
                         rank_local=not (staging.multipart or gathered))
        writer = choose_writer(staging, request)
        raise_if_failed([writer.set_up(staging.path, plan.files)], staging, writer)
        show = request.show_progress and dist.rank() == 0
        files = assembled_files(engine, writer, plan.files, f"Saving {name_of(staging.final)}", show)
        files = files if lazily else list(files)
    job = PersistJob(staging.path, writer, small_files=dict(small_files))
    return Started(request, staging, plan, writer, files, job)


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic garbage collector paused (as it was found, after): the plan allocates many small objects, and
    each full collection they trigger walks the whole heap of the training process, the plan's own cost aside (a
    0.1-0.3 s pause at 16,384 ranks in `bench/bench_scale_sim.py`). torch's `get_state_dict`/`set_state_dict` do
    the same (`torch.distributed.checkpoint.state_dict._gc_context`). Reference counting still frees as it goes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def choose_writer(staging: Staging, request: SaveRequest) -> StorageWriter:
    """The write strategy of a save, from what its folder's store can do (`Staging.multipart`, `Staging.in_place`)
    and the options: parts of multipart uploads; pieces written in place, or through a few aggregators per file
    (`unified_checkpoint_aggregate*`; never into the memory tier, whose files one machine's ranks place directly:
    `MemoryTierWriter`); into machine-local folders, each file by its one writer from the pieces the ranks send it;
    or whole files."""
    if staging.multipart:
        return MultipartWriter(dist.rank(), aggregation=request.options.aggregation)
    if staging.in_place and request.spare is not None:
        return MemoryTierWriter(dist.rank(), request.spare, request.direct_io)
    if staging.in_place and request.options.aggregation.mode != "never":
        return AggregatingWriter(dist.rank(), request.options.aggregation, request.direct_io)
    if staging.in_place:
        return SharedFileWriter(dist.rank(), request.direct_io)
    if sends_pieces(staging, request):  # each file's one writer receives its pieces: one aggregator per file
        whole = dataclasses.replace(request.options.aggregation, mode="always", per_file=1)
        return AggregatingWriter(dist.rank(), whole, request.direct_io)
    return WholeFileWriter(request.direct_io)


def sends_pieces(staging: Staging, request: SaveRequest) -> bool:
    """Whether the ranks send their pieces of each file point-to-point to the one rank that writes it into its
    machine's folder (machine-local folders of a store that writes at offsets; not the memory tier, whose files are
    placed whole), instead of the engines assembling every sharded tensor there. The plan then holds every rank's
    pieces (a census: the sender and the writer are different ranks)."""
    return not staging.shared and request.spare is None and positional_writes_of(store_for(staging.path)) is not None


@dataclass(frozen=True)
class Outcome:
    """How a save ended, the same on every rank: the reports every rank checks (`guarded`'s), the folder it went
    to, and why it went to its fallback instead (None: it did not)."""

    reports: list
    staging: Staging
    fell_back: str | None = None
    writer: StorageWriter | None = None  # what `raise_if_failed` aborts (multipart uploads in flight)

    @property
    def committed(self) -> bool:
        return all(ok for ok, _ in self.reports)

    def run_after_commit(self, after_commit: Callable[[], None] | None) -> None:
        """Run `after_commit` (rotation) on the folder's leader if the save committed; nothing otherwise. Local."""
        if self.committed and self.staging.is_leader and after_commit is not None:
            after_commit()

    def raise_if_failed(self) -> str:
        """Raise the save's error if it failed (on every rank: `raise_if_failed`, which first has the folder's
        leader remove what it wrote); returns the committed folder."""
        raise_if_failed(self.reports, self.staging, self.writer)
        return self.staging.final

    def after_commit_or_raise(self, after_commit: Callable[[], None] | None = None) -> str:
        """How a save's caller ends it, in one call (the async driver's one entry into this module after the
        executor): `run_after_commit`, then `raise_if_failed`. Returns the committed folder."""
        self.run_after_commit(after_commit)
        return self.raise_if_failed()


def finish(started: Started, snapshot: tuple[bool, object], group=None, fallback: str | None = None) -> Outcome:
    """The half of a save that runs after its snapshot, wherever an executor runs it (inline, a thread, a writer
    process): write this rank's files (`snapshot`: (True, the `PersistJob`) or (False, the snapshot's `Failure`)),
    conclude, and where a folder ran out of space and `fallback` names another folder, write the same snapshot
    there. Collective (on `group`): all its ranks must call it."""
    outcome = guarded(snapshot[1].run) if snapshot[0] else snapshot
    reports = conclude(started, outcome, group=group)
    if fallback is not None and snapshot[0] and out_of_space(reports):
        return _save_elsewhere(started, snapshot[1], fallback, group, reports)
    return Outcome(reports, started.staging, writer=started.writer)


def finish_in_background(started: Started, snapshot: tuple[bool, object], group=None,
                         fallback: str | None = None) -> Outcome:
    """`finish` for a background executor: a collective that fails (another rank died) is this save's failure, an
    outcome raised at the next wait (as every other failure), not an exception of a thread. Collective (on
    `group`)."""
    try:
        return finish(started, snapshot, group=group, fallback=fallback)
    except Exception as e:
        return Outcome([(False, Failure.of(e))], started.staging, writer=started.writer)


def _save_elsewhere(full: Started, job: PersistJob, fallback: str, group, reports) -> Outcome:
    """Write `job` (this rank's snapshot, still in host buffers) into `fallback`, where the folder that ran out of
    space is written the same way (in place, or whole files). Collective on `group`."""
    if full.staging.is_leader:
        discard(full.staging.path, full.writer)
    staging = open_staging(fallback, group=group)
    if staging.in_place != full.staging.in_place or staging.multipart:
        why = f"{fallback} is written another way than {full.staging.final}; the snapshot could not be saved there."
        return Outcome(reports + [(False, Failure.said(why))], staging, writer=full.writer)
    job.folder = staging.path
    elsewhere = dataclasses.replace(full, request=dataclasses.replace(full.request, final_dir=fallback),
                                    staging=staging)
    why = next(str(p).splitlines()[0] for ok, p in reports if not ok)
    return Outcome(conclude(elsewhere, guarded(job.run), group=group), staging, fell_back=why, writer=full.writer)


@dataclass(frozen=True)
class Staging:
    """This rank's staging folder, and who commits it. With one folder every rank sees (`shared`), rank 0
    commits it; with folders local to each machine, the lowest rank that sees a folder is its `leader`."""

    path: str
    final: str
    leader: int
    shared: bool

    @property
    def is_leader(self) -> bool:
        return self.leader == dist.rank()

    @property
    def in_place(self) -> bool:
        """Whether ranks write their pieces of shared files themselves: every rank sees the folder and its store
        writes at offsets or takes parts of one upload from several processes (else each file is written whole, in
        order, by one rank)."""
        store = store_for(self.path)
        return self.shared and (positional_writes_of(store) is not None or multipart_of(store) is not None)

    @property
    def multipart(self) -> bool:
        """Whether the ranks upload their pieces as parts of multipart uploads (an object store every rank sees)."""
        store = store_for(self.path)
        return self.shared and multipart_of(store) is not None and positional_writes_of(store) is None


def open_staging(final: str, group=None) -> Staging:
    """Create the staging folder of `final`: rank 0 creates it (and removes what interrupted saves left); every
    rank that does not see it (its machine has a local folder) creates and joins its own. A failure (read-only or
    full disk) is raised on every rank before anything is written. Collective (on `group`): all its ranks must call
    it."""
    attempt = status = tag = None
    if dist.rank() == 0:
        attempt = uuid.uuid4().hex
        tag = new_tag(attempt[:12])  # rank 0's machine and pid: a staging folder of this save's own
        path = staging_dir(final, tag)
        status = guarded(lambda: (remove_stale(parent_of(final), keep=path), prepare_staging(path),
                                  mark_writer(path, 0, attempt)))
    status, attempt, tag = dist.broadcast_object((status, attempt, tag), group=group)
    path = staging_dir(final, tag)
    creator = Staging(path, final, 0, True)
    raise_if_failed([status], creator)
    sees_rank0 = sees_writer(path, 0, attempt)
    joined = (True, None) if sees_rank0 else guarded(lambda: (remove_stale(parent_of(final), keep=path),
                                                              join_staging(path, attempt),
                                                              mark_writer(path, dist.rank(), attempt)))
    if dist.all_reduce_ints([int(not joined[0]), int(not sees_rank0)], "sum", group=group) == [0, 0]:
        return Staging(path, final, 0, shared=True)  # every rank sees rank 0's folder: nothing to gather
    reports = dist.all_gather_object((joined, sees_rank0), group=group)
    raise_if_failed([j for j, _ in reports], creator if sees_rank0 else Staging(path, final, dist.rank(), False))
    creators = [r for r, (_, seen) in enumerate(reports) if r == 0 or not seen]
    leader = next(r for r in creators if sees_writer(path, r, attempt))
    return Staging(path, final, leader, shared=len(creators) == 1)


def conclude(started: Started, outcome: tuple[bool, object], group=None) -> list:
    """Share every rank's outcome; if all wrote their files, rank 0 completes the write strategy and writes the
    indexes and the manifest, and each folder's leader commits its folder (rank 0's small files and manifest are
    copied into the folders of other machines first). Returns the reports every rank then checks with
    `raise_if_failed` (the same on all ranks).

    Success is agreed by an all-reduce of every rank's status; only a failure gathers every rank's outcome. The
    ranges the ranks wrote reach rank 0 as one record per file (`record_tree`), their other records one message
    per rank.

    A rank that died during the save (or whose connection broke) fails that all-reduce on every other rank; nobody
    can have committed then, and each survivor returns its own outcome (whose failure names the dead rank where its
    transfers with it failed: `AggregatingWriter`) with the collective's error.

    Collective (on `group`): all its ranks must call it."""
    group = group if group is not None else dist.cpu_group()  # object collectives never held in GPU memory
    try:
        failed = dist.all_reduce_ints([int(not outcome[0])], "sum", group=group)[0]
    except Exception as e:  # a peer is gone: without its status no rank has the sum, so none goes on to commit
        lost = Failure.said(f"the ranks could not agree on the save's outcome: a rank died or its connection broke "
                            f"({type(e).__name__}: {e})")
        return [outcome, (False, lost)]
    if failed:
        return dist.all_gather_object(outcome, group=group)
    gathered = record_tree.reduce_records(outcome[1], started.plan.files, group=group)
    status = None
    if dist.rank() == 0:
        status = guarded(lambda: _finalize(started, gathered))
    status = dist.broadcast_object(status, group=group)
    if not status[0]:
        return [status]
    done = guarded(lambda: _commit_folder(started.staging, status[1])) if started.staging.is_leader else (True, None)
    if dist.all_reduce_ints([int(not done[0])], "sum", group=group)[0]:
        return dist.all_gather_object(done, group=group)
    return [done]


def raise_if_failed(reports, staging: Staging, writer: StorageWriter | None = None) -> None:
    """Raise `UnifiedCheckpointError` (with every rank's `Failure` in `failures`) if any report is a failure, once
    the folder's leader removed what the save wrote."""
    failures = [payload for ok, payload in reports if not ok]
    if not failures:
        return
    if staging.is_leader:
        discard(staging.path, writer)
    error = UnifiedCheckpointError(
        f"saving {staging.final} failed; nothing was committed (where machines have their own folders, one that did "
        "commit holds part of a checkpoint, which resuming skips) and earlier checkpoints are untouched.\n"
        + "\n".join(map(str, failures))
    )
    error.failures = failures
    raise error


def assembled_files(engine: EngineAdapter, writer: StorageWriter, files: list[FilePlan], desc: str,
                    show: bool) -> Iterator[FilePlan]:
    """The save loop, the same for sync and async saves: walk every file in the same order on all ranks, let the
    storage writer assemble it (`engine.exchange` of what is written whole: a collective on sharded engines), and
    yield the files this rank writes (part of), each once it is assembled. Collective: all ranks must run it to the
    end."""
    for file in tqdm(files, desc=desc, unit="file", disable=not show):
        writer.assemble(engine, file)
        if writer.writes(file, dist.rank()):
            yield file


def _finalize(started: Started, gathered: tuple[list, list]) -> dict[str, bytes]:
    """Rank 0: complete the write strategy (`StorageWriter.complete`: multipart uploads completed), check the ranges
    the ranks wrote and make each file's record (`gathered`: `record_tree.reduce_records`' rows, combined on the
    way, and every other record), write the indexes and the manifest (last) into its staging folder. Returns
    the bytes of the small files every folder holds (empty when all ranks share one folder)."""
    plan, staging = started.plan, started.staging
    shards = {f for cplan in plan.components.values() for f in cplan.files}
    rows, records = gathered
    written = started.writer.complete(staging.path, plan.files, records)
    combined, covered = record_tree.file_records(rows, plan.files)
    ranges = [r for r in records if isinstance(r, RangeRecord)]
    if ranges:
        sizes = {f.name: f.size for f in plan.files if f.name not in covered}
        combined += combine_ranges(sizes, ranges)
    records = [r for r in records if not isinstance(r, RangeRecord)] + combined
    entries = {}
    for name, cplan in plan.components.items():
        index = None
        if component(name).role is not Role.WEIGHTS or cplan.is_sharded:  # from_pretrained: no index for one file
            records.append(write_index(staging.path, cplan.file_stem, cplan.weight_map, cplan.total_size,
                                       cplan.index_metadata))
            index = index_name(cplan.file_stem)
        codec = cplan.codec.metadata() if cplan.codec is not None else None
        entries[name] = ComponentEntry(cplan.file_stem, tuple(cplan.files), index, len(cplan.specs),
                                       cplan.total_size, codec_summary(codec))
    manifest = build_manifest(started.request.global_step, plan.saved_by, started.request.options.as_manifest_dict(),
                              entries, records)
    _add_to_manifest(manifest, written)
    write_manifest(staging.path, manifest)
    if staging.shared:
        return {}
    store = store_for(staging.path)
    small = [n for n in store.list(staging.path) if n not in shards and not n.startswith(WRITER_MARK)]
    return {n: store.read(join(staging.path, n)) for n in small}


def _add_to_manifest(manifest: dict, written: dict) -> None:
    """Merge what the write strategy reported (`StorageWriter.complete`) into the manifest's file entries and
    `saved_by`."""
    for name, entry in written.get("files", {}).items():
        manifest["files"][name].update(entry)
    manifest["saved_by"].update(written.get("saved_by", {}))


def _commit_folder(staging: Staging, small_files: dict[str, bytes]) -> None:
    """A folder's leader: add the small files rank 0 wrote (manifest last) unless this is rank 0's folder, then
    commit it."""
    if staging.leader != 0:
        for name in sorted(small_files, key=lambda n: n == MANIFEST_NAME):
            put_file(join(staging.path, name), small_files[name])
    remove_writer_marks(staging.path)
    commit(staging.path, staging.final)
    logger.info("Saved unified checkpoint %s", staging.final)


def discard(staging: str, writer: StorageWriter | None = None) -> None:
    """Remove what a failed save wrote (where the manifest is the commit, the staging folder is the checkpoint's
    own: its manifest, if any, goes first), and what its write strategy left in flight (`StorageWriter.abort`)."""
    store = store_for(staging)
    if store.is_folder(staging):
        store.retire(staging, MANIFEST_NAME)
    if writer is not None:
        writer.abort(staging)


def save_model_weights(engine: EngineAdapter, folder: str | os.PathLike, max_shard_size: int, small_files: SmallFiles,
                       show_progress: bool = True, direct_io: bool = True) -> None:
    """Write what `from_pretrained(folder)` loads — the model weights (sharded above `max_shard_size`, with their
    index) and, on rank 0, `small_files` (configs, tokenizer, training args) — into `folder`, which may already
    hold other files (a run's output_dir): each tensor is assembled on rank 0 and written into a staging
    subfolder, then the files are moved in, replacing the model files of an earlier save. Nothing else is touched.
    `direct_io` as `SaveRequest.direct_io`.

    Collective: all ranks must call it; a failure on any rank is raised on every rank."""
    folder = as_ref(folder)
    weights = next(c for c in engine.components() if c.role is Role.WEIGHTS)
    plan = plan_component(weights.name, engine.specs(weights.name), 1, max_shard_size, file_stem=weights.file_stem)
    tag = dist.broadcast_object(new_tag() if dist.rank() == 0 else None)
    staging = Staging(join(folder, f".{plan.file_stem}.{tag}{STAGING_SUFFIX}"), folder, 0, shared=True)
    status = (guarded(lambda: (remove_stale(folder, keep=staging.path, prefix=f".{plan.file_stem}."),
                               prepare_staging(staging.path))) if dist.rank() == 0 else (True, None))
    raise_if_failed([dist.broadcast_object(status)], staging)

    def write() -> None:
        writer = WholeFileWriter(direct_io)
        files = assembled_files(engine, writer, file_plans(plan), f"Saving the model to {folder}",
                                show_progress and dist.rank() == 0)
        PersistJob(staging.path, writer, ((f, writer.local_tensors(engine, f)) for f in files)).run()
        if dist.rank() == 0:
            if plan.is_sharded:
                write_index(staging.path, plan.file_stem, plan.weight_map, plan.total_size)
            write_small_files(staging.path, small_files)
            _move_model_files_in(staging.path, folder, plan.file_stem)

    raise_if_failed(dist.all_gather_object(guarded(write)), staging)
    logger.info("Saved the model weights to %s", folder)


def _move_model_files_in(staging: str, folder: str, stem: str) -> None:
    """Replace `folder`'s `<stem>*.safetensors` files and index by the ones in `staging`, then add the rest."""
    store = store_for(folder)
    new = set(store.list(staging))
    for old, size in store.list(folder).items():
        if old.startswith(stem) and ".safetensors" in old[len(stem):] and old not in new and size is not None:
            store.remove(join(folder, old))
    for name in sorted(new):
        store.move(join(staging, name), join(folder, name))
    store.remove(staging)
