"""Storage writers: how the bytes of a planned file (`planning.FilePlan`: header + write items) land on disk.

The save loop (`save/saving.py`) is the same for every strategy and for sync and async saves: every rank walks the files
of the plan in the same order, the strategy assembles what it needs for each file (a collective on sharded
engines), hands the tensors this rank writes to `local_tensors`, and `write` puts them on disk (in a writer thread,
or in the background after a snapshot).

- `SharedFileWriter` (every rank sees one folder): every rank writes the byte ranges it holds straight into the
  shared files at their planned offsets. The header rank creates the file at its final size and writes the header;
  every writer opens it without truncating, `pwrite`s its items, and fsyncs it (in the background while it writes its
  next file; the save waits for every fsync before it reports its ranges). Sharded tensors (`FilePlan.held`)
  never cross ranks (through a codec, each rank encodes its own piece where it lies: the bf16 residual element by
  element, O1/O2 the blocks that start among its elements, completed by a few elements of the next piece shared
  when the save is planned); only what no rank holds in one contiguous piece (other layouts) is assembled on the
  header rank first. Each rank reports a `RangeRecord` (offset, length, CRC-32 computed from memory) per
  range it wrote; the ranks combine them into one record per file on the way to rank 0 (`record_tree`), which
  checks they tile the file.
  The memory tier's strategy (`memory_tier.MemoryTierWriter`) writes through this one, and also places
  snapshots (`PlacesSnapshots`) and reuses spare files.
- `WholeFileWriter` (machine-local folders: a rank cannot write into another machine's file; or a store without
  positional writes): each file is written whole by its one writer, streamed in offset order
  (`safetensors_io.write_shard`: the bytes of safetensors' `save_file`), after its tensors were assembled there.

Which one a save uses follows the store's capabilities (`saving.Staging.in_place`). All bytes go through the store
(`..store`): this module opens no file itself.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch

from ...format.planning import FilePlan, WriteItem
from ...store import PositionalWrites, WritableMaps, as_ref, join, positional_writes_of, store_for
from ..folder.files import FileRecord, RangeRecord
from ..folder.safetensors_io import write_shard


class StorageWriter(Protocol):
    """One write strategy: how the bytes of the planned files land in a folder, in one call order — `set_up`
    (training thread, once per save), then file by file in plan order `assemble` and, on the ranks it `writes`,
    `local_tensors` (training thread), then `write` within `syncing` (wherever the executor runs the save), then
    `complete` (rank 0, before the manifest), or `abort` (the folder's leader, when the save failed)."""

    #: Whether `write` transfers bytes to other ranks' writes (multipart hand-overs, aggregators): every rank then
    #: writes every file it is handed, in plan order, point to point on the strategy's own group.
    collective_write: bool

    def set_up(self, folder: str, files: list[FilePlan]) -> tuple[bool, object]:
        """Make ready what the writes need; the same report on every rank (`reports.guarded`'s). Collective where
        the strategy needs it: all ranks must call it."""

    def assemble(self, engine, file: FilePlan) -> None:
        """Bring together what `file`'s writers need. Collective: all ranks call it, file by file, in plan order."""

    def writes(self, file: FilePlan, rank: int) -> bool:
        """Whether `rank` writes (part of) `file`."""

    def local_tensors(self, engine, file: FilePlan) -> dict[str, torch.Tensor]:
        """What this rank writes of `file` (after `assemble`), by logical name, before any codec: whole tensors, or
        the 1-D piece this rank holds of a tensor in `file.held`. Local reads only (may run in a writer thread)."""

    def write(self, folder: str, file: FilePlan, tensors: Mapping) -> list[FileRecord | RangeRecord]:
        """Write this rank's part of `file` into `folder` from `local_tensors`' result (or a copy of it), encoded
        through the file's codec here. Durable on return, or (inside `syncing`) by the end of the `syncing`
        block."""

    def syncing(self) -> contextlib.AbstractContextManager:
        """A block of `write`s whose fsyncs may run in the background, all done (their errors raised) when the
        block ends without an exception."""

    def complete(self, folder: str, files: list[FilePlan], records: list) -> dict:
        """Rank 0, once every rank wrote, before the manifest: complete what the writes began; returns what the
        manifest records of it (`{"files": {name: entry}, "saved_by": {...}}`, merged into the manifest)."""

    def abort(self, folder: str) -> None:
        """The folder's leader, after a failed save: drop what the writes began and did not finish."""


@runtime_checkable
class PlacesSnapshots(Protocol):
    """A write strategy whose snapshot may be the written file itself (the memory tier's:
    `memory_tier.MemoryTierWriter`): the background save asks it to `place` each file before it copies into host
    buffers (`snapshot.Snapshots`), and hands what it placed to its `write`."""

    def place(self, folder: str, file: FilePlan, tensors: Mapping[str, torch.Tensor], maps: WritableMaps):
        """Copy `tensors` (`local_tensors`' result) straight into file `folder/file.name`, through a mapping kept in
        `maps`; returns what `write` takes instead of tensors (a `memory_tier.Placed`), or None where the file is
        not placed (the caller copies into host buffers). Local."""


class LocalWrites:
    """The steps of a strategy whose writes need nothing set up, completed or aborted beyond the files (every
    byte is in the folder once `write` returned): whole files, or pieces in place."""

    collective_write = False

    def set_up(self, folder: str, files: list[FilePlan]) -> tuple[bool, object]:
        return True, None

    def complete(self, folder: str, files: list[FilePlan], records: list) -> dict:
        return {}

    def abort(self, folder: str) -> None:
        pass


class WholeFileWriter(LocalWrites):
    """Each file is written whole by its one writer (every write item names the same rank); `direct_io` as
    `SharedFileWriter`'s."""

    def __init__(self, direct_io: bool = False):
        self.direct_io = direct_io

    def assemble(self, engine, file: FilePlan) -> None:
        """Assemble the file's tensors on its writer. Collective: all ranks must call it, in plan order."""
        engine.exchange(file.component, file.tensor_names, owner_of(file))

    def writes(self, file: FilePlan, rank: int) -> bool:
        return owner_of(file) == rank

    def local_tensors(self, engine, file: FilePlan) -> dict[str, torch.Tensor]:
        return engine.tensors(file.component, file.tensor_names)

    def write(self, folder: str, file: FilePlan, tensors: Mapping) -> list[FileRecord | RangeRecord]:
        return [write_shard(join(folder, file.name), file.stored_tensors(dict(tensors)), self.direct_io)]

    def syncing(self) -> contextlib.AbstractContextManager:
        """`write_shard` fsyncs each file itself (its CRC pass overlaps the wait)."""
        return contextlib.nullcontext()


def owner_of(file: FilePlan) -> int:
    """The one rank that writes `file` whole: its header's writer, which every write item names."""
    assert not file.pieces, f"{file.name} has several writers; WholeFileWriter writes files whole"
    return file.header_rank


class SharedFileWriter(LocalWrites):
    """Every rank writes its own byte ranges of the shared files in place (see the module docstring)."""

    def __init__(self, rank: int, direct_io: bool = False):
        self.rank = rank
        self.direct_io = direct_io
        self._fsyncs: list[Future] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def assemble(self, engine, file: FilePlan) -> None:
        """`assemble_whole`. Collective: all ranks must call it, in plan order."""
        assemble_whole(engine, file)

    def writes(self, file: FilePlan, rank: int) -> bool:
        return file.writes(rank)

    def local_tensors(self, engine, file: FilePlan) -> Mapping[str, torch.Tensor]:
        return held_tensors(engine, file, self.rank)

    def write(self, folder: str, file: FilePlan, tensors: Mapping) -> list[FileRecord | RangeRecord]:
        ref = join(folder, file.name)
        records = write_ranges(ref, file, self.rank, file.encoded(tensors, self.rank), direct_io=self.direct_io)
        self.sync(ref)
        return records

    def sync(self, ref: str) -> None:
        """Make file `ref` durable: now, or within `syncing`, in the background while the next file is written
        (the block's end waits for it)."""
        store = store_for(ref)
        if self._pool is None:
            store.sync(ref)
        else:
            self._fsyncs.append(self._pool.submit(store.sync, ref))

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


def assemble_whole(engine, file: FilePlan) -> None:
    """Assemble on `file`'s header rank the tensors it writes whole (engines skip those it already holds whole; a
    file with none asks nothing of the engine: every rank has the same plan), where the ranks write their pieces of
    shared files themselves (in place, or as parts of uploads). Collective: all ranks must call it, in plan order."""
    if file.whole_names:
        engine.exchange(file.component, file.whole_names, file.header_rank)


def held_tensors(engine, file: FilePlan, rank: int) -> Mapping[str, torch.Tensor]:
    """What `rank` writes of `file` after `assemble_whole`: whole logical tensors (on the header rank) and its pieces
    (flat), not yet encoded (`write` encodes them: in the background under async save); a mapping that may compute
    each whole tensor when it is looked up (`engine.tensors` of the offline converter). Local."""
    whole, pieces = {}, {}
    if rank == file.header_rank and file.whole_names:
        whole = engine.tensors(file.component, file.whole_names)
    mine = file.pieces_held(rank)
    if mine:
        pieces = {n: f.values for n, f in engine.fragments(file.component, mine).items()}
    return collections.ChainMap(pieces, whole)


def write_ranges(ref: str | os.PathLike, file: FilePlan, rank: int, tensors: Mapping[str, torch.Tensor],
                 direct_io: bool = False) -> list[RangeRecord]:
    """Write `rank`'s items of `file` (and the header, if it is the header rank) at their offsets in file `ref`
    (`PositionalWrites.write_at`: created if missing, never truncated), each range's CRC-32 computed from memory.
    The ranges are produced one at a time (`tensors` may compute each on access, a device tensor is copied to the
    host) while the ones before are written; with `direct_io`, the aligned blocks go to the disk with direct I/O and
    several writes in flight where the store allows it (`store.direct.write_at_direct`). Returns one record per
    range written. The caller makes the file durable (`SharedFileWriter.write`)."""
    ref = as_ref(ref)
    written = in_place_store(ref).write_at(ref, rank_ranges(file, rank, tensors),
                                           file.size if rank == file.header_rank else None, direct_io=direct_io)
    return [RangeRecord(file.name, offset, length, crc) for offset, length, crc in written]


def in_place_store(ref: str) -> PositionalWrites:
    """The store of `ref` as `PositionalWrites` (the strategy that writes pieces in place is chosen only where it
    has them)."""
    store = positional_writes_of(store_for(ref))
    if store is None:
        raise TypeError(f"{ref}: its store has no positional writes; pieces cannot be written in place there.")
    return store


def rank_ranges(file: FilePlan, rank: int, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[int, memoryview]]:
    """What `rank` holds of `file`, as (offset in the file, bytes) in offset order: the header on the header rank,
    then its write items, from `tensors` (by stored name, encoded), each taken when the writer asks for it (a device
    tensor copied to the host a slice at a time, `item_ranges`)."""
    head = file.header_bytes
    if rank == file.header_rank:
        yield 0, memoryview(head)
    for item in sorted(file.items_of(rank), key=lambda item: item.start):
        yield from item_ranges(item, tensors[item.name], len(head) + item.start)


def writes_whole(file: FilePlan, rank: int, items: list[WriteItem]) -> bool:
    """Whether `rank`'s items (in offset order) and the header tile `file` (from the plan; no tensor is touched)."""
    end = 0
    for item in items:
        if item.start != end:
            return False
        end = item.end
    return rank == file.header_rank and len(file.header_bytes) + end == file.size


#: Bytes of a device tensor copied to the host at a time when it is written (a synchronous save of a model on a GPU):
#: the writers write one slice while the next is copied. Copied whole, a tensor of hundreds of MB left the disk idle
#: for its whole copy (the writers hold a few chunks); under glibc's largest mmap threshold (32 MiB), the slices'
#: host memory is reused from slice to slice, not faulted in anew.
DEVICE_SLICE = 16 * 2**20


def item_ranges(item: WriteItem, tensor: torch.Tensor, offset: int,
                slice_bytes: int = DEVICE_SLICE) -> Iterator[tuple[int, memoryview]]:
    """`item`'s bytes from `tensor` as (offset in the file, bytes) from `offset` on: a host tensor's memory as one
    range; a device tensor's bytes copied to the host `slice_bytes` at a time, each when the writer asks for it."""
    flat = _flat_bytes(item, tensor.detach())
    if flat.device.type == "cpu":
        yield offset, memoryview(flat.numpy()) if len(flat) else memoryview(b"")
        return
    yield from host_slices(flat, offset, slice_bytes)


def host_slices(flat: torch.Tensor, offset: int, slice_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """The bytes of `flat` (a flat uint8 tensor, on any device) copied to the host `slice_bytes` at a time, as
    (offset + where the slice starts, bytes)."""
    for start in range(0, len(flat), slice_bytes):
        yield offset + start, memoryview(flat[start:start + slice_bytes].cpu().numpy())


def _flat_bytes(item: WriteItem, tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.nbytes else torch.empty(0, dtype=torch.uint8)
    if len(flat) != item.end - item.start:
        raise ValueError(f"{item.name}: rank {item.rank} holds {len(flat)} bytes of the {item.end - item.start} it "
                         "was planned to write; the engine's shards changed after the save was planned.")
    return flat
