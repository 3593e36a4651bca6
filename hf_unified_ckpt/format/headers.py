"""Safetensors dtype names and header specs, without torch (`checkpoint/safetensors_header.py` reads a header
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
