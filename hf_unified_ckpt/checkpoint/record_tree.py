"""One record per file (issue 57): the byte ranges every rank wrote of the planned files, combined into one CRC-32
per file on the way to rank 0, instead of every rank's records sent to every rank.

Each rank folds its own ranges (`RangeRecord`s) into rows (file, first byte, end byte, CRC-32), neighbouring ranges
of one file joined (`crc32_combine`). The rows then go up a binomial tree over the ranks (rank r + d sends to rank r
at round d = 1, 2, 4, ...): a rank merges what it receives with its own rows, joining every pair of rows of a file
that meet. Ranks below rank r + d hold the pieces that come before theirs in the engines that follow a partition
rule, so the rows a subtree sends are about one per stored tensor it touches: a rank receives at most log2(N)
messages, rank 0 ends with one row per file. Rows that overlap are never joined: rank 0 reports them (a plan bug),
as `files.combine_ranges` does.

A rank's other records (its small files', whole files', the parts of multipart uploads) go straight to rank 0, one
message per rank. Nothing is sent to any rank but rank 0 and a rank's tree parent.
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Iterable

import numpy as np

from .. import dist
from .files import FileRecord, RangeRecord, crc32_combine

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


def tree_children(rank: int, world: int) -> list[int]:
    """The ranks that send their rows to `rank`, in the order it receives them."""
    out, step = [], 1
    while step < world and rank % (2 * step) == 0:
        if rank + step < world:
            out.append(rank + step)
        step *= 2
    return out


def tree_parent(rank: int) -> int | None:
    """The rank `rank` sends its rows to (None for rank 0)."""
    return rank - (rank & -rank) if rank else None


def reduce_records(records: list, files: list, group=None) -> tuple[list[Row], list] | None:
    """Rank 0: (one row per file where the ranks' ranges tile it, more where they do not; every rank's other
    records); None on the other ranks. Collective (point-to-point on `group`: the binomial tree, then one message
    from every rank to rank 0): all its ranks must call it."""
    names = {f.name: i for i, f in enumerate(files)}
    rows, others = split(records, names)
    me, world = dist.rank(), dist.world_size()
    for child in tree_children(me, world):
        rows = merged(heapq.merge(rows, unpack(dist.recv_bytes(child, group=group))))
    parent = tree_parent(me)
    if parent is not None:
        dist.send_bytes(pack(rows), parent, group=group)
        dist.send_bytes(pickle.dumps(others), 0, group=group)
        return None
    for q in range(1, world):
        others += pickle.loads(dist.recv_bytes(q, group=group))
    return rows, others


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
