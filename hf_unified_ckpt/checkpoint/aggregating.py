"""`AggregatingWriter`: files the ranks hold in pieces are written by a few aggregator ranks, each a large aligned
range, from bytes the holders send it point-to-point (a folder every rank sees: `Staging.in_place`).

The plan of each aggregated file (`format.aggregation`: its ranges, their aggregators, cells of at most half of
`unified_checkpoint_aggregate_buffer`) is made in `prepare`, the same on every rank; the files it does not aggregate
are written in place (`writer.SharedFileWriter`, which this strategy holds and hands them to). For an aggregated
file, in `write` (in plan order, on every rank: `collective_write`):

- every rank posts a non-blocking send of each piece of each cell it holds and another rank aggregates
  (`AggregatedFile.sent_by`: views of its host copies, no extra memory), on the `aggregate` gloo group, tagged with
  the file's index in the plan, before it does anything else;
- an aggregator then takes its cells in offset order: it receives the cell's bytes into one of two cell buffers
  (its own pieces copied in), then hands the cell to a write thread (direct I/O, `PositionalWrites.write_at`) and
  receives the next cell into the other buffer while it is written: at most two cells of extra memory;
- once its sends completed and its cells are written, each rank returns one `RangeRecord` per cell written; the
  records are combined into one per file on the way to rank 0 (`record_tree`).

Each byte crosses the network at most once, and a rank receives only bytes it writes. A rank that failed to produce
its pieces still sends the planned number of bytes (zeros), so no aggregator waits for it, and still receives the
cells it aggregates (writing none), then raises; an aggregator whose write failed receives its remaining cells before
it raises: the save then fails on every rank (`save.conclude`) and nothing is committed. A dead peer fails the
transfers with it at once (gloo reports the closed connection), named in the error; the other transfers are still
completed, so no live rank waits for one that gave up. A peer that hangs fails them after the `aggregate` group's
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

from .. import dist
from ..format.aggregation import ALIGN, AggregatedFile, AggregationLayout, aggregate, wants_aggregation
from ..format.parts import HandOver
from ..format.planning import FilePlan
from ..options import AggregationOptions
from ..store import join, scheme_of
from .files import RangeRecord
from .writer import LocalWrites, SharedFileWriter, in_place_store, rank_ranges

logger = logging.getLogger(__name__)

#: The name of the gloo group that carries the aggregated files' bytes (`dist.gloo_group`).
GROUP = "aggregate"
#: The largest alignment taken from a filesystem's block size.
MAX_ALIGN = 64 * 2**20


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
        self.plans: dict[str, AggregatedFile] = {}
        self.tags: dict[str, int] = {}
        self.peak_buffer_bytes = 0

    def prepare(self, folder: str, files: list[FilePlan]) -> tuple[bool, object]:
        """Agree on the layout (ranks per machine, the folder's block size: one all-reduce), plan which files are
        aggregated and how (the same on every rank), and make the `aggregate` gloo group where any is (with the
        default group's timeout). Collective: all ranks must call it."""
        self.layout = layout = agreed_layout(folder, self.options)
        known = _PLANS.setdefault((layout, self.options.mode), {})
        index = 0
        for tag, file in enumerate(files):
            plan = _plan(known, file, layout, self.options.mode, index)
            if plan is not None:
                self.plans[file.name], self.tags[file.name] = plan, tag
                index += len(plan.aggregators)
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
        plan = self.plans.get(file.name)
        if plan is None:
            return self.in_place.write(folder, file, tensors) if file.writes(self.rank) else []
        group = dist.gloo_group(GROUP, timeout=dist.default_timeout())  # made in `prepare`, or here in a writer process
        ref, tag = join(folder, file.name), self.tags[file.name]
        failure, held = None, []
        try:
            held = [(offset, _as_bytes(data)) for offset, data in
                    rank_ranges(file, self.rank, file.encoded(tensors, self.rank))]
        except Exception as e:  # raised after the exchange: the aggregators wait for these bytes
            failure = e
        sends = [_send(h, held if failure is None else None, group, tag) for h in plan.sent_by(self.rank)]
        try:
            records = self._aggregate(ref, plan, None if failure else held, group, tag) if plan.aggregates(
                self.rank) else []
        finally:
            _wait_all(sends, file.name)
        if failure is not None:
            raise failure
        if records:
            self.in_place.sync(ref)
        return records

    def _aggregate(self, ref: str, plan: AggregatedFile, held: list | None, group, tag: int) -> list[RangeRecord]:
        """Receive and write this rank's cells of `plan`, two cell buffers in turn (one written while the next is
        received). Every cell is received even after a write or a transfer failed (its live senders wait for it);
        the first failure is raised at the end. `held` None: this rank could not produce its pieces (its caller
        raises that): the cells are received, nothing is written."""
        cells = plan.cells_of(self.rank)
        longest = max(b - a for a, b in cells)
        buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(min(2, len(cells)))]
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, longest * len(buffers))
        store, name, size = in_place_store(ref), plan.file.name, plan.file.size
        records, failure, pending = [], None, None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregate") as pool:
            for i, (a, b) in enumerate(cells):
                cell = buffers[i % 2][:b - a]
                lost = _receive(cell, a, plan.holders(a, b), held, self.rank, group, tag, name)
                failure = failure or _result(pending, records) or lost
                pending = None if failure or held is None else pool.submit(
                    store.write_at, ref, [(a, memoryview(cell.numpy()))], size if a == 0 else None,
                    direct_io=self.direct_io)
            failure = failure or _result(pending, records)
        if failure is not None:
            raise failure
        return [RangeRecord(name, offset, length, crc) for offset, length, crc in records]


#: Aggregation plans kept from save to save (an engine following a partition rule reuses its file plans: `rule_plan`):
#: per (layout, mode), per file name, (the file's layout tuple, its index among the aggregators, the plan or None).
_PLANS: dict[tuple, dict[str, tuple]] = {}


def _plan(known: dict, file: FilePlan, layout: AggregationLayout, mode: str, index: int) -> AggregatedFile | None:
    """`file`'s aggregation plan (None: written in place), reused where an earlier save planned the same file layout
    at the same aggregator index (the result is the same either way: a pure function of these)."""
    entry = known.get(file.name)
    if entry is not None and entry[0] is file.layout and entry[1] == index:
        return entry[2]
    plan = aggregate(file, layout, index) if wants_aggregation(file, layout, mode) else None
    known[file.name] = (file.layout, index, plan)
    return plan


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
    """The alignment of a local or mounted `folder`'s writes: its filesystem's block size (a parallel filesystem's
    stripe where it reports it so) where that is a power of two between 4 KiB and 64 MiB, else 4 KiB."""
    if scheme_of(folder):
        return ALIGN
    try:
        size = max(os.statvfs(folder).f_bsize, os.stat(folder).st_blksize)
    except OSError:
        return ALIGN
    return size if ALIGN <= size <= MAX_ALIGN and size & (size - 1) == 0 else ALIGN


def _as_bytes(data: memoryview) -> torch.Tensor:
    """A flat uint8 tensor over `data` (a tensor's bytes, shared; the header's bytes, copied: they are read-only)."""
    view = memoryview(data)
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


def _slice(held: list, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) of the file from this rank's `held` ranges ((offset, uint8 tensor), offset order); the
    plan cuts every transfer within one held range."""
    for offset, data in held:
        if offset <= start and end <= offset + len(data):
            return data[start - offset:end - offset]
    raise RuntimeError(f"bytes [{start}, {end}) are not held by this rank in one range; the aggregation plan and the "
                       "engine's shards disagree.")


def _send(h: HandOver, held: list | None, group, tag: int):
    """Post the send of `h` (zeros where this rank failed to produce its bytes: its receiver must not wait); (h, its
    work or the error of posting it (a dead receiver), the bytes)."""
    data = _slice(held, h.start, h.end) if held is not None else torch.zeros(h.end - h.start, dtype=torch.uint8)
    try:
        return h, torch.distributed.isend(data, h.receiver, group=group, tag=tag), data
    except Exception as e:
        return h, e, data


def _receive(cell: torch.Tensor, at: int, parts: list[HandOver], held: list | None, rank: int, group, tag: int,
             name: str) -> Exception | None:
    """Fill `cell` (bytes from offset `at`) from this rank's own ranges (zeros: `held` None) and from the holders
    of the rest; every
    transfer is waited for, and the first that failed (its sender died) is returned, naming the sender."""
    waits = []
    for h in parts:
        target = cell[h.start - at:h.end - at]
        if h.sender == rank:
            target.copy_(_slice(held, h.start, h.end)) if held is not None else target.zero_()
            continue
        try:
            waits.append((h, torch.distributed.irecv(target, h.sender, group=group, tag=tag)))
        except Exception as e:  # posting to a connection known to be closed raises at once
            waits.append((h, e))
    return _wait_each(waits, lambda h: f"{name}: receiving bytes [{h.start}, {h.end}) from rank {h.sender}")


def _wait_all(sends: list, name: str) -> None:
    """Wait for every send (the live receivers take theirs even where one failed); raise the first failure, naming
    its receiver."""
    failure = _wait_each([(h, work) for h, work, _ in sends],
                         lambda h: f"{name}: sending bytes [{h.start}, {h.end}) to rank {h.receiver}")
    if failure is not None:
        raise failure


def _wait_each(transfers: list, what) -> Exception | None:
    """Wait for every (hand-over, work or the error of posting it); the first failure, as a `RuntimeError` that
    names the peer (`what(hand-over)`), chained to gloo's."""
    failure = None
    for h, work in transfers:
        try:
            if isinstance(work, Exception):
                raise work
            work.wait()
        except Exception as e:
            if failure is None:
                failure = RuntimeError(f"{what(h)} failed (that rank died or its connection broke): {e}")
                failure.__cause__ = e
    return failure


def _result(pending: Future | None, records: list) -> Exception | None:
    """Add a cell write's records to `records`; its exception, if it failed."""
    if pending is None:
        return None
    try:
        records += pending.result()
    except Exception as e:
        return e
    return None
