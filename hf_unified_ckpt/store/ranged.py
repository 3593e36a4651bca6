"""A safetensors file read by byte ranges (`RangedFile`): the `FileHandle` of stores without local paths. The
header is read once; a tensor, or the rows a step-1 slice of its first dimension asks for, is one ranged read."""

from __future__ import annotations

import torch

from ..format.headers import TORCH_DTYPE_NAMES
from .safetensors_header import header_and_data_start


class RangedFile:
    """`safe_open(ref).get_tensor/get_slice` for a file of `store`, reading only the bytes asked for."""

    def __init__(self, store, ref: str):
        self.store, self.ref = store, ref
        self.header, self.data_start = header_and_data_start(ref)

    def keys(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def metadata(self) -> dict | None:
        return self.header.get("__metadata__")

    def _entry(self, name: str) -> tuple[torch.dtype, list[int], int, int]:
        try:
            entry = self.header[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in {self.ref}") from None
        start, end = entry["data_offsets"]
        return getattr(torch, TORCH_DTYPE_NAMES[entry["dtype"]]), list(entry["shape"]), start, end

    def _tensor(self, dtype: torch.dtype, shape: list[int], start: int, end: int) -> torch.Tensor:
        if end <= start:
            return torch.empty(shape, dtype=dtype)
        data = bytearray(self.store.read(self.ref, self.data_start + start, end - start))
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensor(*self._entry(name))

    def get_slice(self, name: str) -> "RangedSlice":
        return RangedSlice(self, name)


class RangedSlice:
    """Tensor `name` of a `RangedFile`, read when indexed: a leading step-1 slice reads only its rows."""

    def __init__(self, file: RangedFile, name: str):
        self.file, self.name = file, name

    def get_shape(self) -> list[int]:
        return self.file._entry(self.name)[1]

    def get_dtype(self) -> str:
        return self.file.header[self.name]["dtype"]

    def __getitem__(self, index) -> torch.Tensor:
        dtype, shape, start, end = self.file._entry(self.name)
        index = index if isinstance(index, tuple) else (index,)
        if not shape or not index or not isinstance(index[0], slice):
            return self.file._tensor(dtype, shape, start, end)[index]
        first, stop, step = index[0].indices(shape[0])
        if step != 1:
            return self.file._tensor(dtype, shape, start, end)[index]
        stop = max(first, stop)
        row = (end - start) // shape[0] if shape[0] else 0
        rows = self.file._tensor(dtype, [stop - first, *shape[1:]], start + first * row, start + stop * row)
        return rows[(slice(None), *index[1:])]
