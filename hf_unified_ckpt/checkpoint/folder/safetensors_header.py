"""A safetensors file's JSON header, read through its store (`Store.read`) without touching tensor data (and without
torch: the `info` / `verify` command line judges files by it), and validated in full (`format.headers
.validate_header`): the one check of a header that verify, info, resume and export share."""

from __future__ import annotations

import os
import struct

from ...errors import CorruptCheckpointError
from ...format.bounded_json import parse_json
from ...format.headers import validate_header
from ...store import as_ref, store_for

#: A header longer than this is taken for a damaged length field.
MAX_HEADER = 100 * 2**20


def read_safetensors_header(ref: str | os.PathLike) -> dict:
    """Read a safetensors file's JSON header (two ranged reads through its store, no tensor data); raise
    `CorruptCheckpointError` naming the file if it is malformed in any way `validate_header` checks, or if the
    file's size is not exactly what its header says."""
    return read_header(ref)[0]


def header_and_data_start(ref: str | os.PathLike) -> tuple[dict, int]:
    """A safetensors file's header and the offset of its data section (see `read_safetensors_header`)."""
    return read_header(ref)[:2]


def read_header(ref: str | os.PathLike) -> tuple[dict, int, int]:
    """A safetensors file's validated header, the offset of its data section and the file's size."""
    ref = as_ref(ref)
    store = store_for(ref)
    where = f"safetensors file {ref!r}"
    try:
        size = store.size(ref)
        if size is None:
            raise FileNotFoundError(f"no such file: {ref}")
        if size < 8:
            raise ValueError(f"the file has {size} bytes, fewer than the 8-byte header length")
        (n,) = struct.unpack("<Q", store.read(ref, 0, 8))
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} is implausible (the file has {size} bytes)")
        header = parse_json(store.read(ref, 8, n), f"the header of {where}")
        return validate_header(header, size - 8 - n, where), 8 + n, size
    except CorruptCheckpointError as e:
        if ref in str(e):
            raise
        raise CorruptCheckpointError(f"{where} is truncated or malformed: {e}") from e
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{where} is truncated or malformed: {e}.") from e
