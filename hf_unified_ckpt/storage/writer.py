"""Storage writers: how the bytes of a planned file (`planning.FilePlan`: header + write items) land on disk.

The save loop (`save.py`) is the same for every strategy and for sync and async saves: every rank walks the files
of the plan in the same order, the strategy assembles what it needs for each file (a collective on sharded
engines), and the files this rank takes part in are handed to `write` (in a writer thread, or in the background
after a snapshot).

- `WholeFileWriter` (the strategy in use): each file is written whole by the one rank its write items name, with
  safetensors' own `save_file` (see `safetensors_io.write_shard`); sharded engines first assemble its tensors on
  that rank with `engine.exchange`.

A strategy in which every rank writes its own byte ranges of shared files (the planned header, then its
`WriteItem`s at their offsets, no assembly) is another class with these three methods, not another save loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from ..planning import FilePlan
from .files import FileRecord
from .safetensors_io import write_shard


class StorageWriter(Protocol):
    """One way of writing the planned files."""

    def assemble(self, engine, file: FilePlan) -> None:
        """Bring together what `file`'s writers need. Collective: all ranks call it, file by file, in plan order."""

    def writes(self, file: FilePlan, rank: int) -> bool:
        """Whether `rank` writes (part of) `file`."""

    def write(self, folder: Path, file: FilePlan, tensors: Mapping) -> FileRecord:
        """Write this rank's part of `file` into `folder` from `tensors` (name -> tensor); local I/O only."""


class WholeFileWriter:
    """Each file is written whole by its one writer (every write item names the same rank)."""

    def assemble(self, engine, file: FilePlan) -> None:
        """Assemble the file's tensors on its writer. Collective: all ranks must call it, in plan order."""
        engine.exchange(file.component, file.tensor_names, owner_of(file))

    def writes(self, file: FilePlan, rank: int) -> bool:
        return owner_of(file) == rank

    def write(self, folder: Path, file: FilePlan, tensors: Mapping) -> FileRecord:
        return write_shard(Path(folder) / file.name, file.stored_tensors(dict(tensors)))


def owner_of(file: FilePlan) -> int:
    """The one rank that writes `file` whole: its header's writer, which every write item names."""
    assert file.writers <= {file.header_rank}, f"{file.name} has several writers; WholeFileWriter writes files whole"
    return file.header_rank
