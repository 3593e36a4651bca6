"""File records and checksums of a checkpoint (CRC-32 combination of ranges), small files and JSON written and read
through the store (`..store`), and the plain-file-name rule."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from ...errors import CorruptCheckpointError
from ...store import as_ref, name_of, store_for
from ...format.bounded_json import MAX_JSON_BYTES, parse_json, too_large
from ...format.checksum import crc32, crc32_combine

CHECKSUM_ALGORITHM = "crc32"


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as the manifest records it."""

    name: str
    size: int
    crc32: str

    def as_dict(self) -> dict:
        return {"size": self.size, CHECKSUM_ALGORITHM: self.crc32}


@dataclass(frozen=True)
class RangeRecord:
    """One byte range `[offset, offset + length)` of file `name` that one rank wrote, with its CRC-32."""

    name: str
    offset: int
    length: int
    crc32: int


def combine_ranges(sizes: Mapping[str, int], records: Iterable[RangeRecord]) -> list[FileRecord]:
    """The record of every file in `sizes` (name -> planned size) from the ranges all ranks wrote of it, after
    checking that they tile the file exactly (a gap or an overlap is a bug in the plan: the save fails)."""
    by_file: dict[str, list[RangeRecord]] = {name: [] for name in sizes}
    for record in records:
        by_file[record.name].append(record)
    out = []
    for name, ranges in by_file.items():
        crc, end = 0, 0
        for r in sorted(ranges, key=lambda r: r.offset):
            if r.offset != end:
                raise RuntimeError(f"{name}: the ranks' writes leave bytes [{min(end, r.offset)}, "
                                   f"{max(end, r.offset)}) {'unwritten' if r.offset > end else 'written twice'}.")
            crc, end = crc32_combine(crc, r.crc32, r.length), end + r.length
        if end != sizes[name]:
            raise RuntimeError(f"{name}: the ranks wrote {end} bytes of the {sizes[name]} planned.")
        out.append(FileRecord(name, end, f"{crc:08x}"))
    return out


def check_plain_name(name: str, where: str) -> str:
    """Accept only a plain file name inside the checkpoint folder (no directories, absolute paths or `..`)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or os.path.isabs(name)):
        raise CorruptCheckpointError(
            f"{where} names the file {name!r}; only plain file names inside the checkpoint folder are allowed "
            "(no directories, absolute paths or '..'). The checkpoint is corrupt or hostile; do not load it."
        )
    return name


def put_file(ref: str | os.PathLike, data: bytes, exclusive: bool = False) -> FileRecord:
    """Write small file `ref` durably and atomically through its store (with `exclusive`, only if it does not
    exist: FileExistsError); return its record (from `data`)."""
    store_for(ref).put(as_ref(ref), data, exclusive=exclusive)
    return FileRecord(name_of(ref), len(data), f"{crc32(data):08x}")


def json_bytes(obj) -> bytes:
    """The bytes every JSON file of a checkpoint is written as (indented, keys sorted, newline-terminated)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_json(ref: str | os.PathLike, obj, exclusive: bool = False) -> FileRecord:
    """Write JSON durably and atomically (see `put_file`); return its record."""
    return put_file(ref, json_bytes(obj), exclusive=exclusive)


def read_json(ref: str | os.PathLike, what: str):
    """Read a JSON file of a checkpoint (`what` names its role: "manifest", "index file"), bounded in size (checked
    on disk before reading) and nesting (`format.bounded_json`), turning any failure into a `CorruptCheckpointError`
    that names the file (FileNotFoundError when it is missing; `NotRegularFileError` when it is no regular file)."""
    ref = as_ref(ref)
    store = store_for(ref)
    where = f"{what} {ref!r}"
    size = store.size(ref)
    if size is not None and size > MAX_JSON_BYTES:
        raise too_large(where, size)
    return parse_json(store.read(ref), where)


def file_crc32(ref: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes, as 8 lowercase hex digits (read through its store)."""
    ref = as_ref(ref)
    store = store_for(ref)
    size = store.size(ref)
    if size is None:
        raise FileNotFoundError(f"no such file: {ref}")
    return f"{store.crc32(ref, 0, size):08x}"
