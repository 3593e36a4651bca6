"""Safetensors headers and dtype names, without torch: what `layout`, `manifest` and the `info` / `verify` command
line need to judge a file from its first bytes."""

from __future__ import annotations

import json
import os
import struct

from ..errors import CorruptCheckpointError

MAX_HEADER = 100 * 2**20

#: safetensors dtype name -> the name of the torch dtype (`getattr(torch, name)`).
TORCH_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
    "U16": "uint16", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_SAFETENSORS_NAMES = {v: k for k, v in TORCH_DTYPE_NAMES.items()}


def safetensors_dtype(dtype) -> str:
    """The safetensors name (`"F32"`, `"BF16"`, ...) of a torch dtype; KeyError for one safetensors cannot store."""
    return _SAFETENSORS_NAMES[str(dtype).removeprefix("torch.")]


def read_safetensors_header(ref: str | os.PathLike) -> dict:
    """Read a safetensors file's JSON header (two ranged reads through its store, no tensor data); raise if it is
    malformed, or if the file is shorter than its header says."""
    from ..store import as_ref, store_for  # here: the store package reads headers with this module's names

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
        return header
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"safetensors file {ref!r} is truncated or malformed: {e}.") from e


def tensor_specs(header: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and dtype name of every tensor a header lists (its `__metadata__` left out)."""
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}
