"""A safetensors file read by byte ranges (`RangedFile`): the `FileHandle` of stores without local paths, over
`Store.read` (`tensor_files.open_tensors` chooses it). The header is read once; a tensor, or the rows a step-1
slice of its first dimension asks for, is one ranged read."""

from __future__ import annotations

import collections

import torch

from ...errors import CorruptCheckpointError
from ...format.checksum import crc32
from ...format.headers import TORCH_DTYPE_NAMES
from .safetensors_header import read_header


#: Blocks a `RangedFile` keeps after reading them (the first and last of each read: where neighbouring tensors meet).
KEPT_BLOCKS = 32


class RangedFile:
    """`safe_open(ref).get_tensor/get_slice` for a file of `store`, reading only the bytes asked for. With
    `blocks` (the manifest's CRC-32 per block of the file), each read is widened to whole blocks and every block
    is checked before its bytes are used; the first and last block of each read are kept (up to `KEPT_BLOCKS`),
    since tensors stored side by side share them and are not loaded in file order."""

    def __init__(self, store, ref: str, blocks: dict | None = None):
        self.store, self.ref = store, ref
        self.header, self.data_start, self.size = read_header(ref)
        self.block = int(blocks["size"]) if blocks else None
        self.crcs = [int(c, 16) for c in blocks["crc32"]] if blocks else None
        self._kept: collections.OrderedDict[int, memoryview] = collections.OrderedDict()
        self.fetched = 0  # bytes read from the store

    def read(self, offset: int, length: int) -> memoryview:
        """Bytes `[offset, offset + length)` of the file, checked against the block CRCs when there are some."""
        buffer, begin = self._read(offset, length)
        return memoryview(buffer)[begin:begin + length]

    def _read(self, offset: int, length: int) -> tuple[bytearray, int]:
        """A writable buffer holding bytes `[offset, offset + length)` of the file from its index `begin`."""
        if self.block is None:
            self.fetched += length
            return bytearray(self.store.read(self.ref, offset, length)), 0
        first, last = offset // self.block, (offset + length - 1) // self.block
        pieces, index = [], first
        while index <= last:
            if index in self._kept:
                self._kept.move_to_end(index)
                pieces.append(self._kept[index])
                index += 1
                continue
            stop = index
            while stop < last and stop + 1 not in self._kept:
                stop += 1
            begin = index * self.block  # the last block of the file may be short: never ask past its end
            fetched = memoryview(self.store.read(self.ref, begin, min((stop + 1) * self.block, self.size) - begin))
            self.fetched += len(fetched)
            self._check(index, fetched)
            blocks = [fetched[i:i + self.block] for i in range(0, len(fetched), self.block)]
            pieces += blocks
            self._keep(index, blocks[0])  # copies: a view would keep the whole fetched range alive
            self._keep(stop, blocks[-1])
            index = stop + 1
        return bytearray().join(pieces), offset - first * self.block

    def _keep(self, index: int, block: memoryview) -> None:
        self._kept[index] = memoryview(bytes(block))
        self._kept.move_to_end(index)
        while len(self._kept) > KEPT_BLOCKS:
            self._kept.popitem(last=False)

    def _check(self, index: int, data: bytes) -> None:
        view = memoryview(data)
        for i in range(0, len(view), self.block):
            block = index + i // self.block
            if block >= len(self.crcs) or crc32(view[i:i + self.block]) != self.crcs[block]:
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
        buffer, begin = self._read(self.data_start + start, end - start)
        if len(buffer) > (end - start) * 9 // 8:  # a small tensor: do not keep the blocks around it alive
            buffer, begin = buffer[begin:begin + end - start], 0
        count = (end - start) // dtype.itemsize
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=begin).reshape(shape)

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
