"""A safetensors file's JSON header, read through its store (`Store.read`) without touching tensor data (and without
torch: the `info` / `verify` command line judges files by it)."""

from __future__ import annotations

import json
import os
import struct

from ..errors import CorruptCheckpointError
from ..store import as_ref, store_for

#: A header longer than this is taken for a damaged length field.
MAX_HEADER = 100 * 2**20


def read_safetensors_header(ref: str | os.PathLike) -> dict:
    """Read a safetensors file's JSON header (two ranged reads through its store, no tensor data); raise if it is
    malformed, or if the file is shorter than its header says."""
    return header_and_data_start(ref)[0]


def header_and_data_start(ref: str | os.PathLike) -> tuple[dict, int]:
    """A safetensors file's header and the offset of its data section (see `read_safetensors_header`)."""
    ref = as_ref(ref)
    store = store_for(ref)
    try:
        size = store.size(ref)
        if size is None:
            raise FileNotFoundError(f"no such file: {ref}")
        raw = store.read(ref, 0, 8)
        if len(raw) != 8:
            raise ValueError("file shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"header length {n} is implausible")
        header = json.loads(store.read(ref, 8, n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"tensor data ends at byte {8 + n + end} but the file has {size}")
        return header, 8 + n
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"safetensors file {ref!r} is truncated or malformed: {e}.") from e
