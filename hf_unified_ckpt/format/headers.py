"""Safetensors dtype names and header specs, without torch (`checkpoint/folder/safetensors_header.py` reads a header
through the store)."""

from __future__ import annotations


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


def tensor_specs(header: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and dtype name of every tensor a header lists (its `__metadata__` left out)."""
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


#: Bytes per element of every dtype a header may name (those of `TORCH_DTYPE_NAMES`).
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def validate_header(header, data_size: int, where: str) -> dict:
    """Check a safetensors header (parsed JSON) against its file's data section of `data_size` bytes, as strictly
    as the safetensors library loads it, and a bit more: an object of tensors, each with a known `dtype`, a `shape`
    of non-negative integers and `data_offsets` [begin, end] whose length is the shape's element count times the
    dtype's size; the ranges ordered, disjoint and covering the data section exactly (no gap, nothing after the
    last); `__metadata__` an object of strings. Returns `header`; raises `ValueError` saying what is wrong (the
    caller names the file: `where` is used in the message only)."""
    if not isinstance(header, dict):
        raise ValueError(f"the header of {where} is a JSON {type(header).__name__}, not an object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("'__metadata__' is not an object of strings")
    ranges = sorted((_tensor_range(name, entry), name) for name, entry in header.items() if name != "__metadata__")
    end = 0
    for (begin, stop), name in ranges:
        if begin != end:
            raise ValueError(f"tensor {name!r} begins at data byte {begin}, expected {end} (the tensors' ranges "
                             f"{'overlap' if begin < end else 'leave a gap'})")
        end = stop
    if end != data_size:
        raise ValueError(f"the tensors cover {end} bytes of data, the file holds {data_size}")
    return header


def _tensor_range(name: str, entry) -> tuple[int, int]:
    """The [begin, end) of one header entry, after checking its fields."""
    if not isinstance(entry, dict):
        raise ValueError(f"the entry of tensor {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor {name!r} has dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    elements = 1
    for n in shape:
        elements *= n
    if offsets[1] - offsets[0] != elements * DTYPE_SIZES[dtype]:
        raise ValueError(f"tensor {name!r} of shape {shape} and dtype {dtype} takes {elements * DTYPE_SIZES[dtype]} "
                         f"bytes, but its data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0
