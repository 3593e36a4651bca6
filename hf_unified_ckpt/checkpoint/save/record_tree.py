"""One record per file (issue 57): the byte ranges every rank wrote of the planned files, combined into one CRC-32
per file on the way to rank 0, instead of every rank's records sent to every rank.

Each rank folds its own ranges (`RangeRecord`s) into rows (file, first byte, end byte, CRC-32), neighbouring ranges
of one file joined (`crc32_combine`). The rows are then reduce-scattered by file over the ranks (recursive halving:
at step d = 1, 2, 4, ... a rank keeps half of its files and swaps the other half's rows with rank r ^ d, merging
what it receives, every two rows of a file that meet joined). Partners are chosen nearest first, so the rows merged
at each step come from a block of neighbouring ranks, which in the engines that follow a partition rule hold
neighbouring pieces: a block's rows are about one per stored tensor it touches, and a rank receives about one row
per stored tensor in all (half the files' rows, then a quarter's...), whatever the number of ranks. Each rank then
sends the rows of the files it holds, fully combined, with its other records (its small files', whole files', the
parts of multipart uploads) to rank 0: rank 0 receives one message per rank and one row per file. Rows that overlap
are never joined: rank 0 reports them (a plan bug), as `files.combine_ranges` does. With N not a power of two, the
ranks from the largest power of two P up first hand their rows to rank r - P.
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Iterable

import numpy as np

from ... import dist
from ..folder.files import FileRecord, RangeRecord, crc32_combine

Row = tuple[int, int, int, int]  # (file index, first byte, end byte, CRC-32)


def merged(rows: Iterable[Row]) -> list[Row]:
    """`rows` (sorted by file and first byte) with every two rows of a file that meet joined into one."""
    out: list[Row] = []
    for row in rows:
        f, a, b, c = row
        if b == a:
            continue
        if out and out[-1][0] == f and out[-1][2] == a:
            _, a0, _, c0 = out[-1]
            out[-1] = (f, a0, b, crc32_combine(c0, c, b - a))
        else:
            out.append((f, a, b, c))
    return out


def pack(rows: list[Row]) -> bytes:
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4).tobytes()


def unpack(data: bytes) -> list[Row]:
    return [tuple(r) for r in np.frombuffer(data, dtype=np.int64).reshape(-1, 4).tolist()]


def split(records: list, names: dict[str, int]) -> tuple[list[Row], list]:
    """This rank's rows (its `RangeRecord`s of planned files, folded) and its other records."""
    rows = sorted((names[r.name], r.offset, r.offset + r.length, r.crc32) for r in records
                  if type(r) is RangeRecord and r.name in names)
    return merged(rows), [r for r in records if not (type(r) is RangeRecord and r.name in names)]


def halving_steps(rank: int, world: int, files: int) -> tuple[list[tuple[int, int, int, int, int]], tuple[int, int]]:
    """This rank's steps of the reduce-scatter (recursive halving of the files, distance doubling of the ranks) over
    the largest power of two P <= world of ranks: (partner, first file kept, end kept, first file sent, end sent) per
    step, and the files it holds at the end (fully combined). Ranks P and above fold into rank - P first and hold
    none."""
    p2 = 1 << (world.bit_length() - 1)
    if rank >= p2:
        return [], (0, 0)
    lo, hi, steps, d = 0, files, [], 1
    while d < p2:
        mid = (lo + hi) // 2
        keep, send = ((lo, mid), (mid, hi)) if not rank & d else ((mid, hi), (lo, mid))
        steps.append((rank ^ d, *keep, *send))
        (lo, hi), d = keep, d * 2
    return steps, (lo, hi)


def _swap(rows_out: list[Row], partner: int, group) -> list[Row]:
    """Send `rows_out` to `partner` and receive its rows (the lower rank sends first). Point-to-point."""
    if dist.rank() < partner:
        dist.send_bytes(pack(rows_out), partner, group=group)
        return unpack(dist.recv_bytes(partner, group=group))
    got = unpack(dist.recv_bytes(partner, group=group))
    dist.send_bytes(pack(rows_out), partner, group=group)
    return got


def reduce_records(records: list, files: list, group=None) -> tuple[list[Row], list] | None:
    """Rank 0: (one row per file where the ranks' ranges tile it, more where they do not; every rank's other
    records); None on the other ranks. Collective (point-to-point on `group`): all its ranks must call it.

    The rows are reduce-scattered by file (recursive halving, partners 1, 2, 4... apart, so that the ranks whose
    rows meet are merged first: a rank receives about one row per stored tensor in all, whatever the number of
    ranks), then each rank sends the rows of its files and its other records to rank 0, one message."""
    names = {f.name: i for i, f in enumerate(files)}
    rows, others = split(records, names)
    me, world = dist.rank(), dist.world_size()
    p2 = 1 << (world.bit_length() - 1)
    if me >= p2:
        dist.send_bytes(pack(rows), me - p2, group=group)
        rows = []
    elif me + p2 < world:
        rows = merged(heapq.merge(rows, unpack(dist.recv_bytes(me + p2, group=group))))
    steps, _ = halving_steps(me, world, len(files))
    for partner, k0, k1, s0, s1 in steps:
        out = [r for r in rows if s0 <= r[0] < s1]
        kept = [r for r in rows if k0 <= r[0] < k1]
        rows = merged(heapq.merge(kept, _swap(out, partner, group)))
    if me:
        dist.send_bytes(pickle.dumps((pack(rows), others)), 0, group=group)
        return None
    for q in range(1, world):
        packed, theirs = pickle.loads(dist.recv_bytes(q, group=group))
        rows += unpack(packed)
        others += theirs
    return merged(sorted(rows)), others


def file_records(rows: list[Row], files: list) -> tuple[list[FileRecord], set[str]]:
    """The record of every file `rows` cover (rank 0, after `reduce_records`), and the names of the files they
    cover; raises RuntimeError where the ranks' ranges leave a gap or overlap in a file, or end short of it."""
    by_file: dict[int, list[Row]] = {}
    for row in rows:
        by_file.setdefault(row[0], []).append(row)
    out = []
    for index, parts in sorted(by_file.items()):
        file = files[index]
        end = 0
        for _, a, b, _ in sorted(parts, key=lambda r: r[1]):
            if a != end:
                raise RuntimeError(f"{file.name}: the ranks' writes leave bytes [{min(end, a)}, {max(end, a)}) "
                                   f"{'unwritten' if a > end else 'written twice'}.")
            end = b
        if end != file.size:
            raise RuntimeError(f"{file.name}: the ranks wrote {end} bytes of the {file.size} planned.")
        out.append(FileRecord(file.name, file.size, f"{parts[0][3]:08x}"))
    return out, {files[i].name for i in by_file}
