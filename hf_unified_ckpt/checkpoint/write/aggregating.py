"""`AggregatingWriter`: files the ranks hold in pieces are written by a few aggregator ranks, each a large aligned
range, from bytes the holders send it point-to-point (a folder every rank sees: `Staging.in_place`).

Which files are aggregated, and the numbering of their aggregators, is decided in `set_up`, the same on every rank;
each aggregated file's plan (`format.aggregation`: its ranges, their aggregators, cells of at most half of
`unified_checkpoint_aggregate_buffer`) is made when a rank that has a part in it first needs it
(`AggregationPlans`); the files it does not aggregate
are written in place (`writer.SharedFileWriter`, which this strategy holds and hands them to). For an aggregated
file, in `write` (in plan order, on every rank: `collective_write`):

- every rank posts a non-blocking send of each piece of each cell it holds and another rank aggregates
  (`AggregatedFile.sent_by`: views of its host copies, no extra memory; `hand_overs.Sends`, the bucket hand-overs'
  code), on the `aggregate` gloo group, tagged with the file's index in the plan, before it does anything else;
- an aggregator then takes its cells in offset order: it receives the cell's bytes into one of two cell buffers
  (its own pieces copied in, the others' received straight into it: `hand_overs.Incoming`), then hands the cell to
  a write thread (direct I/O, `PositionalWrites.write_at`) and receives the next cell into the other buffer while it
  is written: at most two cells of extra memory;
- once its sends completed and its cells are written, each rank returns one `RangeRecord` per cell written; the
  records are combined into one per file on the way to rank 0 (`record_tree`).

A piece only its own rank can place (the residual master weights' ties: each rank knows only its own offset) is
announced: its holder sends its bounds, then its bytes, on a tag of the cell (`cell_tag`), and the aggregator, which
knows how many such bytes its cell holds (`AggregatedFile.unknown_bytes`), takes them from whichever rank sends them
(`hand_overs.Announced`).

Each byte crosses the network at most once, and a rank receives only bytes it writes. A rank that failed to produce
its pieces still sends the planned number of bytes (zeros), so no aggregator waits for it, and still receives the
cells it aggregates (writing none), then raises; an aggregator whose write failed receives its remaining cells before
it raises, and one that stops early (a failed transfer) receives and drops what is still due to it, the announced
bytes included (`Incoming.drain`, `Announced.drain`): the save then fails on every rank (`saving.conclude`) and nothing
is committed. A dead peer fails the transfers with it at once (gloo reports the closed connection), named in the
error; the other transfers are still completed, so no live rank waits for one that gave up. The exception: gloo's
receive from any rank is not woken by a peer's death, so an aggregator waiting for bytes a dead rank was to announce
fails at the group's timeout, unable to name it. A peer that hangs fails them after the `aggregate` group's
timeout: the default group's (the job's `init_process_group(timeout=...)`, where the Trainer passes its `ddp_timeout`
on GPUs), not torch's 30 minutes for a new group.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ... import dist
from ...format.aggregation import (ALIGN, AggregatedFile, AggregationLayout, AggregationPlans, range_count,
                                 wants_aggregation)
from ...format.planning import FilePlan
from ...options import AggregationOptions
from ...store import join, positional_writes_of, store_for
from ..folder.files import RangeRecord
from .hand_overs import Announced, Incoming, Sends, copy_held
from .writer import LocalWrites, SharedFileWriter, in_place_store, rank_ranges

logger = logging.getLogger(__name__)

#: The name of the gloo group that carries the aggregated files' bytes (`dist.gloo_group`).
GROUP = "aggregate"


class AggregatingWriter(LocalWrites):
    """See the module docstring. `peak_buffer_bytes`: the most cell-buffer bytes this rank held at once (its extra
    memory as an aggregator)."""

    collective_write = True

    def __init__(self, rank: int, options: AggregationOptions, direct_io: bool = False):
        self.rank = rank
        self.options = options
        self.direct_io = direct_io
        self.in_place = SharedFileWriter(rank, direct_io)
        self.layout: AggregationLayout | None = None
        self.plans: AggregationPlans | Mapping[str, AggregatedFile] = {}
        self.tags: dict[str, int] = {}
        self.peak_buffer_bytes = 0

    def set_up(self, folder: str, files: list[FilePlan]) -> tuple[bool, object]:
        """Agree on the layout (ranks per machine, the folder's block size: one all-reduce), plan which files are
        aggregated and how (the same on every rank), and make the `aggregate` gloo group where any is (with the
        default group's timeout). Collective: all ranks must call it."""
        self.layout = layout = agreed_layout(folder, self.options)
        kept = _PLANS.setdefault((layout, self.options.mode), _Kept())
        self.plans = plans = AggregationPlans(layout)
        index = 0
        decided, made, mode = kept.decided, kept.made(), self.options.mode
        for tag, file in enumerate(files):
            entry = decided.get(file.name)  # (the loop runs over thousands of files per save: inlined)
            if entry is not None and entry[0] is file.layout and entry[1] == index:
                count, plan = entry[2], made.get(file.name)
            else:
                count, plan = kept.decide(file, index, layout, mode), None
            if count:
                index += plans.add(file, index, plan, count)
                self.tags[file.name] = tag
        kept.last = plans
        if len(_PLANS) > 4:  # the layouts of earlier saves (another world or options): forgotten
            _PLANS.clear()
        if self.plans:  # a peer that hangs fails the transfers after the job's own collective timeout
            dist.gloo_group(GROUP, timeout=dist.default_timeout())
            logger.debug("%d of %d files aggregated (%s)", len(self.plans), len(files), layout)
        return True, None

    def assemble(self, engine, file: FilePlan) -> None:
        """As in place: the tensors written whole are assembled on the header rank. Collective: all ranks must call
        it, in plan order."""
        self.in_place.assemble(engine, file)

    def writes(self, file: FilePlan, rank: int) -> bool:
        return file.name in self.plans or file.writes(rank)

    def local_tensors(self, engine, file: FilePlan) -> Mapping[str, torch.Tensor]:
        return self.in_place.local_tensors(engine, file)

    def syncing(self) -> contextlib.AbstractContextManager:
        return self.in_place.syncing()

    def write(self, folder: str, file: FilePlan, tensors: Mapping) -> list[RangeRecord]:
        """Write `file` in place, or, aggregated, send this rank's pieces and write the cells it aggregates.
        Point-to-point on the `aggregate` gloo group for an aggregated file (every rank calls it, in plan order)."""
        if file.name not in self.plans:
            return self.in_place.write(folder, file, tensors) if file.writes(self.rank) else []
        group = dist.gloo_group(GROUP, timeout=dist.default_timeout())  # made in `set_up`, or here in a writer process
        if not self.plans.has_part(file.name, self.rank):  # holds none of its bytes, aggregates none of its ranges
            return []
        plan = self.plans[file.name]
        ref, tag = join(folder, file.name), self.tags[file.name]
        failure, held = None, None
        try:
            held = sorted(rank_ranges(file, self.rank, file.encoded(tensors, self.rank)), key=lambda r: r[0])
        except Exception as e:  # raised after the exchange: the aggregators wait for these bytes
            failure = e
        sends = Sends(plan.sent_by(self.rank), held, group, tag, file.name)  # zeros where `held` is None
        announcing = Sends(plan.announced_by(self.rank), held, group, tag, file.name,
                           announce=lambda h: cell_tag(tag, plan.cell_index(h.start)))
        failure = failure or sends.failure or announcing.failure
        incoming = Incoming(plan.received_by(self.rank), group, tag, file.name)
        announced = Announced([(a, b, plan.unknown_bytes(a, b), cell_tag(tag, plan.cell_index(a)))
                               for a, b in plan.cells_of(self.rank)], group, tag, file.name)
        try:
            records = self._aggregate(ref, plan, None if failure else held, incoming, announced) if plan.aggregates(
                self.rank) else []
        finally:
            incoming.drain()  # what a failure left: received and dropped, so no live sender waits for this rank
            announced.drain()
            unsent = [sends.wait(), announcing.wait()]  # both waited for: the send buffers live until here
            unsent = unsent[0] or unsent[1]
        if failure is not None or unsent is not None:
            raise failure or unsent
        if records:
            self.in_place.sync(ref)
        return records

    def _aggregate(self, ref: str, plan: AggregatedFile, held, incoming: Incoming,
                   announced: Announced) -> list[RangeRecord]:
        """Receive and write this rank's cells of `plan`, two cell buffers in turn (one written while the next is
        received): each filled from this rank's own bytes (`held`), the hand-overs of the others (`incoming`) and
        the bytes announced to it (pieces only their own rank can place: `announced`).
        Every cell is received even after a write failed (its senders wait for it), the first failure raised at the
        end; a failed transfer is raised at once (the caller drains the rest of both). `held` None: this rank could not
        produce its bytes (its caller raises that): the cells are received, nothing is written."""
        cells = plan.cells_of(self.rank)
        longest = max(b - a for a, b in cells)
        buffers = [bytearray(longest) for _ in range(min(2, len(cells)))]
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, longest * len(buffers))
        store, name, size = in_place_store(ref), plan.file.name, plan.file.size
        records, failure, pending = [], None, None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregate") as pool:
            for i, (a, b) in enumerate(cells):
                cell = memoryview(buffers[i % 2])[:b - a]
                own = copy_held(cell, a, held) if held is not None else None
                got = incoming.into(cell, a, b) + announced.into(cell, a, b)
                if own is not None and own + got != b - a:
                    raise RuntimeError(f"{name}: bytes [{a}, {b}) are neither held by rank {self.rank} nor sent to "
                                       "it; the aggregation plan and the engine's shards disagree.")
                failure = failure or _result(pending, records)
                pending = None if failure or held is None else pool.submit(
                    store.write_at, ref, [(a, cell)], size if a == 0 else None, direct_io=self.direct_io)
            failure = failure or _result(pending, records)
        if failure is not None:
            raise failure
        return [RangeRecord(name, offset, length, crc) for offset, length, crc in records]


def cell_tag(file_tag: int, cell: int) -> int:
    """The tag of the announced bytes of cell `cell` of the file of tag `file_tag` (gloo tags are non-negative
    int32): above the files' own tags, unique per cell of a file and per file among 1,024 in a row."""
    return 2**30 + (file_tag % 2**10) * 2**20 + cell % 2**20


class _Kept:
    """What one layout's saves keep from save to save (an engine following a partition rule reuses its file plans:
    `rule_plan`): whether each file is aggregated, and the last save's plans. Both are pure functions of the file's
    layout and its first aggregator's index, so they are reused only where those are the same."""

    def __init__(self):
        #: file name -> (its layout tuple, its first aggregator's index, its `range_count` if aggregated, else 0)
        self.decided: dict[str, tuple] = {}
        self.last: AggregationPlans | None = None

    def decide(self, file: FilePlan, index: int, layout: AggregationLayout, mode: str) -> int:
        """How many aggregator indices `file` takes at `index` (`range_count`; 0: it is not aggregated), decided
        and kept (`decided`: reused while the file's layout tuple and index are the same)."""
        count = range_count(file, layout) if wants_aggregation(file, layout, mode) else 0
        self.decided[file.name] = (file.layout, index, count)
        return count

    def made(self) -> Mapping[str, AggregatedFile]:
        """The plans the last save made, by file name (reused for a file whose `decided` entry still holds: the
        same layout tuple at the same index)."""
        return self.last.made if self.last is not None else {}


#: Per (layout, mode): what its saves keep (`_Kept`).
_PLANS: dict[tuple, _Kept] = {}


def agreed_layout(folder: str, options: AggregationOptions) -> AggregationLayout:
    """The layout every rank plans with: ranks per machine (LOCAL_WORLD_SIZE where the launcher set the same on every
    rank, else one rank per machine) and the folder's block size read on rank 0. Collective (one all-reduce)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    align = block_size(folder) if dist.rank() == 0 else 0
    most, least, align = dist.all_reduce_ints([local, -local, align], "max")
    local = most if most == -least else 1
    return AggregationLayout(dist.world_size(), local, align, options.range_bytes, options.per_file,
                             options.cell_bytes)


def block_size(folder: str) -> int:
    """The alignment of `folder`'s writes: its store's block size where it writes at offsets, else 4 KiB."""
    store = positional_writes_of(store_for(folder))
    return store.block_size(folder) if store is not None else ALIGN


def _result(pending: Future | None, records: list) -> Exception | None:
    """Add a cell write's records to `records`; its exception, if it failed."""
    if pending is None:
        return None
    try:
        records += pending.result()
    except Exception as e:
        return e
    return None
