"""`MemoryTierWriter`: the memory tier's write strategy (`flash/`, docs/memory-tier.md).

Its files are written in place as `writer.SharedFileWriter` writes them (which it holds and hands them to), with two
differences, both for a folder of memory (`/dev/shm`):

- **Spare files reused.** A file one rank writes alone takes the place of the spare file of its name that an evicted
  checkpoint left (`take_spare`, in `spare`: a set folder per evicted checkpoint, the oldest first), and overwrites its
  memory rather than taking fresh pages. A spare file is taken only at exactly the planned size: no file that may be
  mapped is ever shrunk.
- **Snapshots placed** (`writer.PlacesSnapshots`). An async save's snapshot of a file one rank writes whole is copied
  straight into the file (`place`, through a mapping kept from save to save), and `write` only checksums it: one copy
  instead of a copy into host buffers and a `pwrite` of them.

All bytes go through the store (`...store`): this module opens no file itself.
"""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...format.checksum import crc32
from ...format.planning import FilePlan, WriteItem
from ...store import WritableMaps, is_file, join, listing, name_of, store_for, writable_mappings_of
from ..folder.files import FileRecord, RangeRecord
from .writer import LocalWrites, SharedFileWriter, in_place_store, writes_whole


class MemoryTierWriter(LocalWrites):
    """See the module docstring: `SharedFileWriter`'s writes, over the spare files of `spare`, with placed
    snapshots."""

    def __init__(self, rank: int, spare: str, direct_io: bool = False):
        self.rank = rank
        self.spare = spare
        self.in_place = SharedFileWriter(rank, direct_io)

    def assemble(self, engine, file: FilePlan) -> None:
        """As in place. Collective: all ranks must call it, in plan order."""
        self.in_place.assemble(engine, file)

    def writes(self, file: FilePlan, rank: int) -> bool:
        return self.in_place.writes(file, rank)

    def local_tensors(self, engine, file: FilePlan) -> Mapping[str, torch.Tensor]:
        return self.in_place.local_tensors(engine, file)

    def place(self, folder: str, file: FilePlan, tensors: Mapping[str, torch.Tensor],
              maps: WritableMaps) -> Placed | None:
        """Copy the header and `tensors` (`local_tensors`' result) straight into file `folder/file.name` through a
        mapping kept in `maps` (`map_writable`): a snapshot that is already the written file, where this rank
        writes it whole, without a codec, from host tensors, into the memory tier (the file is taken over the spare
        file of its name where an evicted checkpoint left one: `take_spare`). None where not (the caller copies into
        host buffers), or where the folder is full (that copy's write then fails the same way, and the save goes to
        its fallback). Local."""
        ref = join(folder, file.name)
        items = sorted(file.items_of(self.rank), key=lambda item: item.start)
        mappings = writable_mappings_of(store_for(ref))
        if (file.codec is not None or mappings is None or not writes_whole(file, self.rank, items)
                or any(tensors[item.name].device.type != "cpu" for item in items)):
            return None
        take_spare(self.spare, ref, file.size)
        try:
            view = mappings.map_writable(ref, file.size, maps)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return None
            raise
        head = file.header_bytes
        view[:len(head)] = head
        for item in items:
            _copy_into(view, len(head) + item.start, item, tensors[item.name])
        return Placed(ref, view)

    def write(self, folder: str, file: FilePlan, tensors: Mapping | Placed) -> list[FileRecord | RangeRecord]:
        """A placed file checksummed (and written first where the save moved to its fallback); else this rank's
        ranges written in place, a file it writes alone over a spare file of its size."""
        ref = join(folder, file.name)
        if not isinstance(tensors, Placed):
            if file.writes_alone(self.rank):
                take_spare(self.spare, ref, file.size)
            return self.in_place.write(folder, file, tensors)
        records = tensors.records(ref, file)
        self.in_place.sync(ref)
        return records

    def syncing(self) -> contextlib.AbstractContextManager:
        return self.in_place.syncing()


@dataclass(frozen=True)
class Placed:
    """A file whose bytes a snapshot copied straight into place (`MemoryTierWriter.place`): `view` maps all of
    file `ref`, header and data."""

    ref: str
    view: memoryview

    def records(self, ref: str, file: FilePlan) -> list[RangeRecord]:
        """The record of the placed bytes, written at `ref` first where the save moved elsewhere (its fallback)."""
        if ref != self.ref:
            in_place_store(ref).write_at(ref, [(0, self.view)], file.size)
        return [RangeRecord(file.name, 0, len(self.view), crc32(self.view))]


def _copy_into(view: memoryview, offset: int, item: WriteItem, tensor: torch.Tensor) -> None:
    """Copy `tensor`'s bytes into `view` at `offset` (elementwise where aligned: no contiguous temporary)."""
    tensor, length = tensor.detach(), item.end - item.start
    if tensor.nbytes != length:
        raise ValueError(f"{item.name}: rank {item.rank} holds {tensor.nbytes} bytes of the {length} it was planned "
                         "to write; the engine's shards changed after the save was planned.")
    if not length:
        return
    target = torch.frombuffer(view, dtype=torch.uint8, count=length, offset=offset)
    if offset % tensor.element_size() == 0:
        target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    else:
        target.copy_(tensor.contiguous().reshape(-1).view(torch.uint8))


def take_spare(spare: str, ref: str, size: int) -> bool:
    """`reuse_spare` for a file of exactly `size` bytes: a spare file of another size is removed instead of being
    resized (fresh memory is taken for `ref` then). A file is never shrunk or truncated, because it may still be
    mapped: by the persister copying it, or by a process holding tensors read from it (a shrunk file drops even
    the privately written pages of a copy-on-write mapping beyond its new end: SIGBUS, issue 47). Removing a file
    is safe: its memory lives on until the last mapping of it goes. Returns whether a spare file was used."""
    store = store_for(ref)
    while reuse_spare(spare, ref):
        if store.size(ref) == size:
            return True
        store.remove(ref)
    return False


def reuse_spare(spare: str, ref: str) -> bool:
    """Move a spare file named like `ref` (an evicted checkpoint's, in a set folder of `spare`, the oldest set
    first) to `ref`, so that writing `ref` overwrites memory already in use instead of taking fresh pages (on a VM
    that hands free pages back to its host, writing into fresh ones costs several times a copy: measured 2.0 s
    against 0.2-0.4 s for 600 MB in /dev/shm). Only for a file one rank writes alone (no other process may have
    opened `ref`). Returns whether a spare file was used; the writers call it through `take_spare`, which takes
    one of the planned size only."""
    for source in (join(spare, s, name_of(ref)) for s in spare_sets(spare)):
        if not is_file(source):
            continue
        try:
            store_for(ref).move(source, ref)
        except OSError:  # taken meanwhile, or on another filesystem (a save that fell back to durable storage)
            continue
        return True
    return False


def spare_sets(spare: str) -> list[str]:
    """The names of the spare sets (folders, one per evicted checkpoint) in `spare`, the oldest first."""
    return sorted((n for n, size in listing(spare).items() if size is None), key=natural_order)


def natural_order(name: str) -> tuple:
    """Sort key: `checkpoint-9` before `checkpoint-10`."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
