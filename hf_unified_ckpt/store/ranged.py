"""A safetensors file read by byte ranges (`RangedFile`): the `FileHandle` of stores without local paths. The
header is read once; a tensor, or the rows a step-1 slice of its first dimension asks for, is one ranged read."""

from __future__ import annotations

import torch

from ..format.headers import TORCH_DTYPE_NAMES
from .safetensors_header import header_and_data_start


class RangedFile:
    """`safe_open(ref).get_tensor/get_slice` for a file of `store`, reading only the bytes asked for. With
    `blocks` (the manifest's CRC-32 per block of the file), each read is widened to whole blocks and every block
    is checked before its bytes are used (the last block read is kept: neighbouring tensors share it)."""

    def __init__(self, store, ref: str, blocks: dict | None = None):
        self.store, self.ref = store, ref
        self.header, self.data_start = header_and_data_start(ref)
        self.block = int(blocks["size"]) if blocks else None
        self.crcs = [int(c, 16) for c in blocks["crc32"]] if blocks else None
        self._kept: tuple[int, bytes] | None = None  # (index, bytes) of the last verified block
        self.fetched = 0  # bytes read from the store

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Bytes `[offset, offset + length)` of the file, checked against the block CRCs when there are some."""
        if self.block is None:
            self.fetched += length
            return self.store.read(self.ref, offset, length)
        first, last = offset // self.block, (offset + length - 1) // self.block
        kept = self._kept if self._kept is not None and first <= self._kept[0] <= last else None
        start = (first if kept is None or kept[0] != first else first + 1) * self.block
        stop = (last if kept is not None and kept[0] == last and last > first else last + 1) * self.block
        data = bytearray()
        if kept is not None and kept[0] == first:
            data += kept[1]
        if stop > start:
            fetched = self.store.read(self.ref, start, stop - start)  # the file's last block may be shorter
            self.fetched += len(fetched)
            self._check(start // self.block, fetched)
            data += fetched
        if kept is not None and kept[0] == last and last > first:
            data += kept[1]
        tail = last * self.block - first * self.block
        self._kept = (last, bytes(data[tail:]))
        begin = offset - first * self.block
        return memoryview(data)[begin:begin + length]

    def _check(self, index: int, data: bytes) -> None:
        from ..format.checksum import crc32

        view = memoryview(data)
        for i in range(0, len(view), self.block):
            block = index + i // self.block
            if block >= len(self.crcs) or crc32(view[i:i + self.block]) != self.crcs[block]:
                from ..errors import CorruptCheckpointError

                raise CorruptCheckpointError(
                    f"{self.ref}: bytes [{block * self.block}, {block * self.block + len(view[i:i + self.block])}) "
                    "do not match the CRC-32 its manifest records for them (damaged in storage or in transit). "
                    "Nothing of this read was used; resume from another checkpoint, or run `hf-unified-ckpt verify` "
                    "on this one.")

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
        data = bytearray(self.read(self.data_start + start, end - start))
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
