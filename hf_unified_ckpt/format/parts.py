"""Multipart plans: which rank uploads which part of a shared file in an object store. Pure.

A file's bytes are held by ranks in runs (the header and the tensors its header rank writes whole, each rank's
pieces of sharded tensors: `FilePlan.items`). An object store assembles a file from numbered parts in offset
order, every part but the last at least `min_part` bytes (5 MiB on S3). So: a run of at least `min_part` bytes is
uploaded by its own rank, cut into parts of about `part_size`; runs smaller than that are handed to a neighbour —
small runs in a row that together reach `min_part` become one part, uploaded by the rank that holds most of it;
fewer join the part before them (or, at the start of the file, the part after). The bytes that cross ranks this
way are the hand-overs, each smaller than `min_part` per joined group: `hand_over_bytes` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The most parts one multipart upload may have (S3).
MAX_PARTS = 10_000
#: Files uploaded in parts carry a CRC-32 per block of this many bytes (the manifest's `blocks`), so a reader of a
#: byte range checks what it fetched without reading the rest of the file. A read is widened to whole blocks:
#: 1 MiB blocks cost FSDP2 x 2 reading row halves of 8 MB tensors 12-14 % extra bytes, 256 KiB 3.3 %
#: (bench/bench_s3_reshard.py, 20m and 50m); the manifest holds 11 bytes per block (45 KB per GB).
VERIFY_BLOCK = 256 * 2**10


def block_pieces(start: int, end: int, block: int = VERIFY_BLOCK) -> list[tuple[int, int]]:
    """`[start, end)` cut at the multiples of `block`: (offset, length) pieces in order."""
    cuts = [start] + list(range((start // block + 1) * block, end, block)) + [end]
    return [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass(frozen=True)
class Run:
    """Bytes `[start, end)` of a file, held by `rank`."""

    start: int
    end: int
    rank: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Part:
    """Part `number` (1-based, in offset order) of a file: bytes `[start, end)`, uploaded by `uploader`."""

    number: int
    start: int
    end: int
    uploader: int


@dataclass(frozen=True)
class HandOver:
    """Bytes `[start, end)` that `sender` holds and sends to `receiver`, which uploads them within a part."""

    start: int
    end: int
    sender: int
    receiver: int


@dataclass(frozen=True)
class PartPlan:
    """A file's parts and hand-overs, both in offset order. A multipart save asks it only `uploaded_by`, `sent_by`
    and `received_by` of its own rank."""

    parts: tuple[Part, ...]
    hand_overs: tuple[HandOver, ...]

    @property
    def hand_over_bytes(self) -> int:
        return sum(h.end - h.start for h in self.hand_overs)

    def uploaded_by(self, rank: int) -> list[Part]:
        return [p for p in self.parts if p.uploader == rank]

    def sent_by(self, rank: int) -> list[HandOver]:
        """The hand-overs `rank` sends, in offset order."""
        return [h for h in self.hand_overs if h.sender == rank]

    def received_by(self, rank: int) -> list[HandOver]:
        """The hand-overs `rank` receives (the other ranks' bytes within the parts it uploads), in offset order."""
        return [h for h in self.hand_overs if h.receiver == rank]


def merged_runs(runs: list[Run]) -> list[Run]:
    """`runs` sorted, with neighbours of the same rank joined, checked to tile `[0, end)` without gap or overlap."""
    out: list[Run] = []
    for run in sorted((r for r in runs if r.length), key=lambda r: r.start):
        end = out[-1].end if out else 0
        if run.start != end:
            raise ValueError(f"the runs leave bytes [{min(end, run.start)}, {max(end, run.start)}) "
                             f"{'uncovered' if run.start > end else 'covered twice'}")
        if out and out[-1].rank == run.rank:
            out[-1] = Run(out[-1].start, run.end, run.rank)
        else:
            out.append(run)
    return out


def plan_parts(runs: list[Run], min_part: int, part_size: int) -> PartPlan:
    """The parts and hand-overs of one file whose bytes `runs` hold (see the module docstring). Every part but the
    last is at least `min_part` bytes; a span longer than `part_size` is cut into equal parts of at most
    `part_size` (so at least half of it)."""
    if part_size < 2 * min_part:
        raise ValueError(f"part_size {part_size} is below twice the store's smallest part {min_part} (a span cut "
                         "into parts of at most part_size must leave each at least the smallest part)")
    runs = merged_runs(runs)
    segments = _segments(runs, min_part)
    parts = []
    for start, end, uploader in segments:
        count = max(1, -(-(end - start) // part_size))
        bounds = [start + (end - start) * i // count for i in range(count + 1)]
        parts += [(a, b, uploader) for a, b in zip(bounds, bounds[1:])]
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a file needs {len(parts)} parts, more than the {MAX_PARTS} an upload may have: raise the "
                         "part size or lower unified_checkpoint_max_shard_size")
    numbered = tuple(Part(i + 1, a, b, u) for i, (a, b, u) in enumerate(parts))
    return PartPlan(numbered, tuple(_hand_overs(numbered, runs)))


def _segments(runs: list[Run], min_part: int) -> list[tuple[int, int, int]]:
    """(start, end, uploader) spans, each at least `min_part` bytes unless it is the whole file."""
    segments: list[list[int]] = []
    pending: list[Run] = []  # small runs in a row, not placed yet

    def place_pending(before_big: bool) -> None:
        if not pending:
            return
        start, end = pending[0].start, pending[-1].end
        if end - start >= min_part or (not segments and not before_big):
            segments.append([start, end, _majority(pending)])
        elif segments:
            segments[-1][1] = end  # joins the part before it
        else:
            pending_start[0] = start  # joins the big run after it
        pending.clear()

    pending_start = [None]
    for run in runs:
        if run.length >= min_part:
            place_pending(before_big=True)
            start = pending_start[0] if pending_start[0] is not None else run.start
            pending_start[0] = None
            segments.append([start, run.end, run.rank])
        else:
            pending.append(run)
    place_pending(before_big=False)
    return [tuple(s) for s in segments]


def _majority(runs: list[Run]) -> int:
    """The rank holding most bytes of `runs` (the lowest such rank on a tie)."""
    held: dict[int, int] = {}
    for run in runs:
        held[run.rank] = held.get(run.rank, 0) + run.length
    return min(held, key=lambda r: (-held[r], r))


def _hand_overs(parts: tuple[Part, ...], runs: list[Run]) -> list[HandOver]:
    out, i = [], 0
    for part in parts:
        while runs[i].end <= part.start:
            i += 1
        j = i
        while j < len(runs) and runs[j].start < part.end:
            run = runs[j]
            if run.rank != part.uploader:
                out.append(HandOver(max(run.start, part.start), min(run.end, part.end), run.rank, part.uploader))
            j += 1
    return out


def file_runs(file) -> list[Run]:
    """The runs of a planned file (`planning.FilePlan`): its header, held by the header rank, and every write item
    (offsets in the file, after the header)."""
    head = len(file.header_bytes)
    return [Run(0, head, file.header_rank)] + [Run(head + i.start, head + i.end, i.rank) for i in file.items]
