"""Storage writers: how the bytes of a planned file (`planning.FilePlan`: header + write items) land on disk.

The save loop (`save.py`) is the same for every strategy and for sync and async saves: every rank walks the files
of the plan in the same order, the strategy assembles what it needs for each file (a collective on sharded
engines), hands the tensors this rank writes to `local_tensors`, and `write` puts them on disk (in a writer thread,
or in the background after a snapshot).

- `SharedFileWriter` (every rank sees one folder): every rank writes the byte ranges it holds straight into the
  shared files at their planned offsets. The header rank creates the file at its final size and writes the header;
  every writer opens it without truncating, `pwrite`s its items, and fsyncs it (in the background while it writes its
  next file; the save waits for every fsync before it reports its ranges). Sharded tensors (`FilePlan.pieces`)
  never cross ranks; only what no rank holds whole in one piece (other layouts, codec-encoded tensors) is assembled
  on the header rank first. Each rank reports a `RangeRecord` (offset, length, CRC-32 computed from memory) per
  range it wrote; rank 0 combines them into the file's record (`combine_ranges`), checking they tile the file.
- `WholeFileWriter` (machine-local folders: a rank cannot write into another machine's file): each file is written
  whole by its one writer with safetensors' own `save_file` (`safetensors_io.write_shard`), after its tensors were
  assembled there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from ..planning import FilePlan, WriteItem
from .checksum import crc32
from .direct import write_whole_direct
from .files import FileRecord, RangeRecord, fsync_file, pwrite_all
from .safetensors_io import write_shard


class StorageWriter(Protocol):
    """One way of writing the planned files."""

    def assemble(self, engine, file: FilePlan) -> None:
        """Bring together what `file`'s writers need. Collective: all ranks call it, file by file, in plan order."""

    def writes(self, file: FilePlan, rank: int) -> bool:
        """Whether `rank` writes (part of) `file`."""

    def local_tensors(self, engine, file: FilePlan) -> dict[str, torch.Tensor]:
        """What this rank writes of `file` (after `assemble`), by stored name: whole tensors, or the 1-D piece this
        rank holds of a tensor in `file.pieces`. Local reads only (may run in a writer thread)."""

    def write(self, folder: Path, file: FilePlan, tensors: Mapping) -> list[FileRecord | RangeRecord]:
        """Write this rank's part of `file` into `folder` from `local_tensors`' result; local I/O only. Durable on
        return, or (inside `syncing`) by the end of the `syncing` block."""

    def syncing(self) -> contextlib.AbstractContextManager:
        """A block of `write`s whose fsyncs may run in the background, all done (their errors raised) when the
        block ends without an exception."""


class WholeFileWriter:
    """Each file is written whole by its one writer (every write item names the same rank)."""

    def assemble(self, engine, file: FilePlan) -> None:
        """Assemble the file's tensors on its writer. Collective: all ranks must call it, in plan order."""
        engine.exchange(file.component, file.tensor_names, owner_of(file))

    def writes(self, file: FilePlan, rank: int) -> bool:
        return owner_of(file) == rank

    def local_tensors(self, engine, file: FilePlan) -> dict[str, torch.Tensor]:
        return engine.tensors(file.component, file.tensor_names)

    def write(self, folder: Path, file: FilePlan, tensors: Mapping) -> list[FileRecord | RangeRecord]:
        return [write_shard(Path(folder) / file.name, file.stored_tensors(dict(tensors)))]

    def syncing(self) -> contextlib.AbstractContextManager:
        """`write_shard` fsyncs each file itself (its CRC pass overlaps the wait)."""
        return contextlib.nullcontext()


def owner_of(file: FilePlan) -> int:
    """The one rank that writes `file` whole: its header's writer, which every write item names."""
    assert file.writers <= {file.header_rank}, f"{file.name} has several writers; WholeFileWriter writes files whole"
    return file.header_rank


class SharedFileWriter:
    """Every rank writes its own byte ranges of the shared files in place (see the module docstring)."""

    def __init__(self, rank: int, direct_io: bool = False):
        self.rank = rank
        self.direct_io = direct_io
        self._fsyncs: list[Future] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def assemble(self, engine, file: FilePlan) -> None:
        """Assemble on the header rank the tensors it writes whole (engines skip those it already holds whole).
        Collective: all ranks must call it, in plan order."""
        engine.exchange(file.component, file.whole_names, file.header_rank)

    def writes(self, file: FilePlan, rank: int) -> bool:
        return rank in file.writers

    def local_tensors(self, engine, file: FilePlan) -> dict[str, torch.Tensor]:
        out = {}
        if self.rank == file.header_rank and file.whole_names:
            out.update(file.stored_tensors(engine.tensors(file.component, file.whole_names)))
        mine = [n for n in file.pieces if any(r == self.rank and count for r, _, count in file.pieces[n])]
        if mine:
            out.update({n: f.values for n, f in engine.fragments(file.component, mine).items()})
        return out

    def write(self, folder: Path, file: FilePlan, tensors: Mapping) -> list[FileRecord | RangeRecord]:
        path = Path(folder) / file.name
        records = write_ranges(path, file, self.rank, tensors, direct_io=self.direct_io)
        if self._pool is None:
            fsync_file(path)
        else:  # the disk flushes this file while the next one is written; `syncing` waits for it
            self._fsyncs.append(self._pool.submit(fsync_file, path))
        return records

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """Within the block, each written file is fsynced by a helper thread (fsync releases the GIL) while the
        writer goes on with the next file; leaving the block waits for every fsync and raises the first failure."""
        self._pool, self._fsyncs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync"), []
        try:
            yield
        finally:
            self._pool.shutdown(wait=True)
            fsyncs, self._pool, self._fsyncs = self._fsyncs, None, None
        for done in fsyncs:
            done.result()


def write_ranges(path: Path, file: FilePlan, rank: int, tensors: Mapping[str, torch.Tensor],
                 direct_io: bool = False) -> list[RangeRecord]:
    """Write `rank`'s items of `file` (and the header, if it is the header rank) at their offsets in `path`, created
    if missing and never truncated, and compute each range's CRC-32 from memory once the bytes are in the page
    cache. With `direct_io`, a file this rank writes whole goes to disk through `direct.write_whole_direct`
    (bypassing the page cache) where the filesystem allows it. Returns one record per range written. The caller
    fsyncs the file (`SharedFileWriter.write`)."""
    head = file.header_bytes
    ranges = [(0, memoryview(head))] if rank == file.header_rank else []
    ranges += [(len(head) + item.start, _item_bytes(item, tensors[item.name])) for item in file.items_of(rank)]
    if not (direct_io and write_whole_direct(path, sorted(ranges, key=lambda r: r[0]), file.size)):
        _write_buffered(path, file, rank, ranges)
    return [RangeRecord(file.name, offset, len(data), crc32(data)) for offset, data in ranges]


def _write_buffered(path: Path, file: FilePlan, rank: int, ranges: list[tuple[int, memoryview]]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if rank == file.header_rank:
            os.ftruncate(fd, file.size)
        for offset, data in ranges:
            pwrite_all(fd, data, offset)
    finally:
        os.close(fd)


def _item_bytes(item: WriteItem, tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()) if tensor.nbytes else memoryview(b"")
    if len(data) != item.end - item.start:
        raise ValueError(f"{item.name}: rank {item.rank} holds {len(data)} bytes of the {item.end - item.start} it "
                         "was planned to write; the engine's shards changed after the save was planned.")
    return data
