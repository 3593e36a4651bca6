"""Aggregation plans: which few ranks write (or upload) which large aligned ranges of a shared file. Pure.

Under ZeRO-3 and FSDP2 every rank holds a piece of every tensor; written in place, a file has N writers, each
writing 1/N of each tensor at unaligned offsets (the N-1 strided pattern parallel filesystems serve worst). An
aggregated file is cut into at most `per_file` ranges of about `range_bytes`, each aligned to `align` bytes (4 KiB,
or the filesystem's block size), each owned by one aggregator rank: the first range by the file's header rank (which
holds the header and the tensors written whole), the others spread over the machines. Each range is cut into cells
(windows of at most `cell_bytes`): an aggregator receives and writes one cell at a time, so its extra memory is
bounded. Every rank sends the bytes it holds of each cell to the cell's aggregator (`sent_by`); an aggregator
receives, per cell, the bytes it does not hold from their holders (`received_by`). Both sides cut the same way, so
the messages between two ranks match one to one, in offset order.

Each rank's answers cost O(its own pieces + the pieces within its cells), not O(ranks x tensors): the pieces are
closed forms (`planning.Strided` and what codecs make of it) answered by binary search. A piece only its own rank
can place (`planning.OwnOnly`: the residual master weights' ties, each rank's offset an exclusive scan) is
*announced*: its holder sends it with its bounds (`announced_by`), and the aggregator, which knows how many such bytes
its cell holds but not from whom (`holders` names their sender `UNKNOWN`), takes them from any rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from .parts import MAX_PARTS, HandOver, Part
from .planning import ClosedForm, FilePlan, OwnOnly, once, piece_of

#: Ranges start at multiples of this many bytes at least (direct I/O's block; a filesystem's block or stripe size
#: where it is larger and readable: `AggregationLayout.align`).
ALIGN = 4096
#: Below this many bytes per piece (on average), a file written in place by several machines is aggregated.
SMALL_PIECE = 8 * 2**20
#: The sender of bytes only their own rank can place (`AggregatedFile.holders`): announced, taken from any rank.
UNKNOWN = -1


@dataclass(frozen=True)
class AggregationLayout:
    """What every rank agrees on before planning the ranges of any file: the world, how its ranks sit on machines
    (`local_world` ranks per machine, in rank order), the filesystem's alignment, and the options' sizes."""

    world: int
    local_world: int
    align: int
    range_bytes: int
    per_file: int
    cell_bytes: int

    @property
    def machines(self) -> int:
        return max(1, self.world // self.local_world) if self.world % self.local_world == 0 else self.world

    def spread(self, index: int) -> int:
        """The `index`-th aggregator of a save (counted over the files in plan order), machine by machine first:
        machine 0's first rank, machine 1's first rank, ..., then each machine's second rank, and so on."""
        return self.spread_from(index, 1)[0]

    def spread_from(self, index: int, count: int) -> list[int]:
        """`spread` of `count` indices from `index` on."""
        world, machines = self.world, self.machines
        local = world // machines
        indices = (j % world for j in range(index, index + count))
        return [(i % machines) * local + (i // machines) % local for i in indices]

    def index_of(self, rank: int) -> int:
        """The index in [0, world) that `spread` maps to `rank` (its inverse there)."""
        local = self.world // self.machines
        return rank // local + self.machines * (rank % local)


@dataclass(frozen=True)
class AggregatedFile:
    """One file's ranges and cells (see the module docstring): `bounds` cut [0, file.size) into ranges,
    `aggregators[i]` owns range i, and each range is cut into cells of at most `cell` bytes."""

    file: FilePlan
    bounds: tuple[int, ...]
    aggregators: tuple[int, ...]
    cell: int
    align: int = ALIGN
    _cache: dict = field(repr=False, init=False, compare=False, default_factory=dict)  # the `once` answers

    @once
    def cells(self) -> tuple[tuple[int, int, int], ...]:
        """(start, end, aggregator) of every cell, in offset order: each range cut into as few cells of at most
        `cell` bytes as it needs, all but its last of one aligned length (the last takes the rest: at least as
        long), so no cell is much under half of `cell` unless its range is."""
        out = []
        for (a, b), owner in zip(zip(self.bounds, self.bounds[1:]), self.aggregators):
            count = -(-(b - a) // self.cell)
            step = max(self.align, (b - a) // count // self.align * self.align)
            cuts = [a + i * step for i in range(count)] + [b]
            out += [(x, y, owner) for x, y in zip(cuts, cuts[1:]) if y > x]
        return tuple(out)

    @once
    def _starts(self) -> list[int]:
        return [c[0] for c in self.cells]

    @once
    def _own_only(self) -> frozenset[str]:
        """The stored tensors whose pieces only their own rank can place (announced)."""
        return frozenset(name for name, *_, pieces in self.file.layout if isinstance(pieces, OwnOnly))

    def cell_index(self, offset: int) -> int:
        """The index of the cell holding byte `offset`."""
        return bisect.bisect_right(self._starts, offset) - 1

    @once
    def _runs(self) -> list[tuple[int, int, int, int, object]]:
        """The file's layout as (first byte, end byte in the file, element size, stored name, pieces or None: held
        whole by the header rank), in offset order, after the header."""
        head = len(self.file.header_bytes)
        return sorted((head + start, head + end, size, name, pieces)
                      for name, start, end, size, pieces in self.file.layout if end > start)

    def aggregates(self, rank: int) -> bool:
        return rank in self.aggregators

    def cells_of(self, rank: int) -> list[tuple[int, int]]:
        """The cells `rank` aggregates, in offset order."""
        return [(a, b) for a, b, owner in self.cells if owner == rank]

    def sent_by(self, rank: int) -> list[HandOver]:
        """The bytes `rank` holds of cells another rank aggregates, cut at the cells, in offset order (but those
        only it can place: `announced_by`)."""
        return self._cut(rank, [(a, b) for a, b, announced in self._held(rank) if not announced])

    def announced_by(self, rank: int) -> list[HandOver]:
        """What `rank` holds of pieces only it can place, within cells another rank aggregates, cut at the cells:
        sent with their bounds, as the receiver cannot know their sender."""
        return self._cut(rank, [(a, b) for a, b, announced in self._held(rank) if announced])

    def _cut(self, rank: int, held: list[tuple[int, int]]) -> list[HandOver]:
        out = []
        for start, end in held:
            i = self.cell_index(start)
            while start < end:
                a, b, owner = self.cells[i]
                stop = min(end, b)
                if owner != rank:
                    out.append(HandOver(start, stop, rank, owner))
                start, i = stop, i + 1
        return out

    def received_by(self, rank: int) -> list[HandOver]:
        """The bytes of `rank`'s cells that other ranks hold and it knows from whom, cut at the cells, in offset
        order (the rest of its cells is announced: `unknown_bytes`)."""
        return [h for a, b in self.cells_of(rank) for h in self.holders(a, b) if h.sender not in (rank, UNKNOWN)]

    def unknown_bytes(self, start: int, end: int) -> int:
        """How many bytes of [start, end) come announced (pieces only their own rank can place, not this one's)."""
        return sum(h.end - h.start for h in self.holders(start, end) if h.sender == UNKNOWN)

    def holders(self, start: int, end: int) -> list[HandOver]:
        """Who holds bytes [start, end) of the file (receiver: the cell's aggregator), in offset order: the header
        and the tensors written whole by the header rank, each piece by its holder; of a piece only its own rank can
        place, this process's rank where it holds it, else `UNKNOWN`."""
        owner = self.cells[self.cell_index(start)][2]
        header_rank, head = self.file.header_rank, len(self.file.header_bytes)
        out = [HandOver(start, min(end, head), header_rank, owner)] if start < head else []
        runs = self._runs
        i = max(0, bisect.bisect_right(runs, (start,)) - 1)
        for first, last, size, _, pieces in runs[i:]:
            if first >= end:
                break
            if last <= start:
                continue
            lo, hi = max(start, first), min(end, last)
            if pieces is None:
                out.append(HandOver(lo, hi, header_rank, owner))
            elif isinstance(pieces, OwnOnly):
                out += _announced(lo, hi, first, size, pieces, owner)
            else:
                for rank, a, n in pieces_between(pieces, (lo - first) // size, -(-(hi - first) // size)):
                    out.append(HandOver(max(lo, first + a * size), min(hi, first + (a + n) * size), rank, owner))
        return out

    def _held(self, rank: int) -> list[tuple[int, int, bool]]:
        """The byte ranges `rank` holds of the file (its header and write items), in offset order, each with whether
        only `rank` can place it (announced)."""
        head = len(self.file.header_bytes)
        held = [(0, head, False)] if rank == self.file.header_rank else []
        held += sorted((head + i.start, head + i.end, i.name in self._own_only) for i in self.file.items_of(rank)
                       if i.end > i.start)
        return held

    @once
    def parts(self) -> tuple[Part, ...]:
        """The parts of a multipart upload of this file: each cell one part, uploaded by its aggregator."""
        return tuple(Part(i + 1, a, b, owner) for i, (a, b, owner) in enumerate(self.cells))

    def uploaded_by(self, rank: int) -> list[Part]:
        return [p for p in self.parts if p.uploader == rank]

    @property
    def hand_over_bytes(self) -> int:
        """The bytes that cross ranks: what the aggregators receive."""
        return sum(h.end - h.start for rank in set(self.aggregators) for h in self.received_by(rank))


def _announced(lo: int, hi: int, first: int, size: int, pieces: OwnOnly, owner: int) -> list[HandOver]:
    """Bytes [lo, hi) of a tensor whose pieces only their own rank can place (`pieces`: this process's view): its
    own piece's bytes there by this rank, the rest `UNKNOWN`."""
    a, n = pieces.of(pieces.rank)
    mine = (max(lo, first + a * size), min(hi, first + (a + n) * size)) if n else (hi, hi)
    if mine[0] >= mine[1]:
        return [HandOver(lo, hi, UNKNOWN, owner)]
    out = [HandOver(lo, mine[0], UNKNOWN, owner)] if lo < mine[0] else []
    out.append(HandOver(*mine, pieces.rank, owner))
    return out + ([HandOver(mine[1], hi, UNKNOWN, owner)] if mine[1] < hi else [])


def pieces_between(pieces, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(rank, first element, count) of the non-empty pieces overlapping elements [lo, hi), in element order: a
    binary search over the holders of a closed form (`Strided`, `Mapped`), or over a listed tuple."""
    if isinstance(pieces, tuple):
        firsts = [first for _, first, _ in pieces]
        i = max(0, bisect.bisect_right(firsts, lo) - 1)
        return [(r, a, n) for r, a, n in pieces[i:] if a < hi and a + n > lo and n]
    holders = pieces.holders()
    left, right = 0, len(holders)
    while left < right:  # the first holder whose piece ends after `lo`
        mid = (left + right) // 2
        first, count = piece_of(pieces, holders[mid])
        if first + count <= lo:
            left = mid + 1
        else:
            right = mid
    out = []
    for rank in holders[left:]:
        first, count = piece_of(pieces, rank)
        if first >= hi:
            break
        if count:
            out.append((rank, first, count))
    return out


def writers_of(file: FilePlan) -> int:
    """How many ranks write `file` in place: its header rank and the holders of its pieces (a union of rank
    ranges for closed forms). O(tensors of the file)."""
    spans = [(file.header_rank, file.header_rank + 1)]
    for *_, pieces in file.layout:
        if pieces is None:
            continue
        holders = pieces.holders() if isinstance(pieces, ClosedForm) else sorted({r for r, _, n in pieces if n})
        if isinstance(holders, range):
            spans.append((holders.start, holders.stop))
        else:
            spans += [(r, r + 1) for r in holders]
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def mean_piece_bytes(file: FilePlan) -> float:
    """The file's bytes written in pieces over its number of pieces (inf: none)."""
    count = total = 0
    for _, start, end, _, pieces in file.layout:
        if pieces is not None:
            count += len(pieces)
            total += end - start
    return total / count if count else float("inf")


def wants_aggregation(file: FilePlan, layout: AggregationLayout, mode: str) -> bool:
    """Whether `file` is aggregated: `mode` "always" / "never", or "auto": it has pieces every rank can place and
    more than `layout.per_file` writers, or several machines write it in pieces of under `SMALL_PIECE` bytes."""
    if mode == "never" or not file.pieces:
        return False
    if mode == "always":
        return True
    if _many_holders(file, layout.per_file):
        return True
    writers = writers_of(file)
    return writers > layout.per_file or (writers > 1 and layout.machines > 1 and mean_piece_bytes(file) < SMALL_PIECE)


def _many_holders(file: FilePlan, limit: int) -> bool:
    """Whether one tensor of `file` alone has more than `limit` holders (so has the file): a closed form's range of
    holders is counted without listing them."""
    for *_, pieces in file.layout:
        holders = pieces.holders() if isinstance(pieces, ClosedForm) else None
        if isinstance(holders, range) and len(holders) > limit:
            return True
    return False


def range_count(file: FilePlan, layout: AggregationLayout, min_range: int = 1) -> int:
    """How many ranges `file` is cut into at most (`aggregate` may need fewer): as many as `layout.range_bytes` asks of
    its data, at most `layout.per_file`, each at least `min_range` bytes. From the data's size alone, so that a rank
    counts the aggregators of every file without encoding the headers of the files it has no part in."""
    data = file.data_bytes
    return max(1, min(layout.per_file, -(-data // layout.range_bytes), data // max(min_range, 1) or 1))


def aggregate(file: FilePlan, layout: AggregationLayout, first_index: int, min_range: int = 1,
              cell_bytes: int | None = None, count: int | None = None) -> AggregatedFile:
    """The ranges of `file`: at most `range_count` (as many as `layout.range_bytes` asks, at most `layout.per_file`,
    each at least `min_range` bytes: an object store's smallest part), starting at multiples of `layout.align`; the
    first range's aggregator is the header rank, the others `layout.spread(first_index + 1), ...`. Cells of at most
    `cell_bytes` (default `layout.cell_bytes`; an object store's part size for uploads), aligned too. `count`:
    `range_count`'s answer, where the caller has it."""
    size, align = file.size, layout.align
    count = range_count(file, layout, min_range) if count is None else count
    step = -(-(-(-size // count)) // align) * align
    bounds = (*range(0, size, step), size)
    owners = [file.header_rank] + layout.spread_from(first_index + 1, len(bounds) - 2)
    cell = max(align, (cell_bytes or layout.cell_bytes) // align * align)
    if min_range > 1:  # parts: a cell cut from a longer range is over half of `cell`, so at least the smallest part
        cell = max(cell, 2 * (-(-min_range // align) + 1) * align)
        if sum(-(-(b - a) // cell) for a, b in zip(bounds, bounds[1:])) > MAX_PARTS:
            raise ValueError(f"{file.name}: {size} bytes in cells of {cell} need more than {MAX_PARTS} parts; raise "
                             "unified_checkpoint_aggregate_buffer or lower unified_checkpoint_max_shard_size.")
    return AggregatedFile(file, bounds, tuple(owners), cell, align)


class AggregationPlans(Mapping):
    """The aggregated files of a save (file name -> `AggregatedFile`), each planned when first asked for: a rank that
    has no part in a file (holds none of its bytes, aggregates none of its ranges) never plans it, so planning costs
    a rank O(the files it has a part in) beyond a count per file. `add` numbers the files' aggregators in plan order
    (`AggregationLayout.spread`), the same on every rank."""

    def __init__(self, layout: AggregationLayout):
        self.layout = layout
        self._files: dict[str, tuple[FilePlan, int, int]] = {}  # name -> (file, its first aggregator's index, count)
        self._plans: dict[str, AggregatedFile] = {}

    def add(self, file: FilePlan, first_index: int, plan: AggregatedFile | None = None,
            count: int | None = None) -> int:
        """Add `file`, its aggregators numbered from `first_index` (`plan`: already planned; `count`: its
        `range_count`, where known). Returns how many indices it takes (`range_count`)."""
        count = range_count(file, self.layout) if count is None else count
        self._files[file.name] = (file, first_index, count)
        if plan is not None:
            self._plans[file.name] = plan
        return count

    def __getitem__(self, name: str) -> AggregatedFile:
        plan = self._plans.get(name)
        if plan is None:
            file, first, count = self._files[name]
            plan = self._plans[name] = aggregate(file, self.layout, first, count=count)
        return plan

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name) -> bool:
        return name in self._files

    @property
    def planned(self) -> frozenset[str]:
        """The files planned so far."""
        return frozenset(self._plans)

    @property
    def made(self) -> Mapping[str, AggregatedFile]:
        """The plans made here so far, by file name (a file not asked for, or not aggregated, has none)."""
        return self._plans

    def has_part(self, name: str, rank: int) -> bool:
        """Whether `rank` holds bytes of aggregated file `name` or may aggregate one of its ranges (without planning
        it: the plan's aggregators are among the first `range_count` of its indices)."""
        file, first, count = self._files[name]
        if file.writes(rank):
            return True
        gap = (self.layout.index_of(rank) - first) % self.layout.world  # its next index from `first` on
        return (gap or self.layout.world) < count
