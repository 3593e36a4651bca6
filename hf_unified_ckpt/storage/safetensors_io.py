"""Sharded safetensors: writing one shard durably, HF-style index files, and lazy name-keyed reading."""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CorruptCheckpointError
from .files import FileRecord, check_plain_name, crc32_combine, file_crc32, fsync_file, read_json, write_json

SAFETENSORS_METADATA = {"format": "pt"}
_MAX_HEADER = 100 * 2**20


def _writable(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous tensor; views into larger buffers (ZeRO fragments) are written without a copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def write_shard(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor]) -> FileRecord:
    """Write one safetensors file with `{"format": "pt"}` metadata, fsync it and return its record.

    `save_file` then `fsync` run in a helper thread (both release the GIL). Once the bytes are in the page cache,
    this thread computes the CRC-32 of the tensor bytes from memory, in the order safetensors lays them out,
    while the helper waits for the disk; the header's CRC is combined after. If the layout is not the predicted
    one, the file is read back instead. Tensors sharing storage (one per-group scalar under several names) are
    written as copies."""
    path = Path(path)
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = _writable(tensor)
        if tensor.nbytes and (tensor.data_ptr(), tensor.nbytes) in seen:
            tensor = tensor.clone()
        seen.add((tensor.data_ptr(), tensor.nbytes))
        out[name] = tensor
    order = sorted(out, key=lambda n: (-out[n].element_size(), n))  # safetensors' layout: wide dtypes first
    in_page_cache = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        durable = pool.submit(_save_and_fsync, out, path, in_page_cache)
        while not in_page_cache.wait(0.05):
            if durable.done():  # save_file failed: surface its error
                durable.result()
        data_crc = 0
        for name in order:
            data_crc = zlib.crc32(_bytes_of(out[name]), data_crc)
        durable.result()
    return FileRecord(path.name, path.stat().st_size, _file_crc(path, out, order, data_crc))


def _save_and_fsync(tensors: dict[str, torch.Tensor], path: Path, in_page_cache: threading.Event) -> None:
    save_file(tensors, str(path), metadata=dict(SAFETENSORS_METADATA))
    in_page_cache.set()
    fsync_file(path)


def _bytes_of(tensor: torch.Tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.nbytes else b""


def _file_crc(path: Path, tensors: dict[str, torch.Tensor], order: list[str], data_crc: int) -> str:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header_bytes = f.read(n)
    header = json.loads(header_bytes)
    offsets = [tuple(header[name]["data_offsets"]) for name in order]
    expected, start = [], 0
    for name in order:
        expected.append((start, start + tensors[name].nbytes))
        start += tensors[name].nbytes
    if offsets != expected or path.stat().st_size != 8 + n + start:
        return file_crc32(path)
    head_crc = zlib.crc32(header_bytes, zlib.crc32(struct.pack("<Q", n)))
    return f"{crc32_combine(head_crc, data_crc, start):08x}"


def index_name(file_stem: str) -> str:
    return f"{file_stem}.safetensors.index.json"


def write_index(folder: str | os.PathLike, file_stem: str, weight_map: Mapping[str, str], total_size: int,
                extra_metadata: Mapping | None = None) -> FileRecord:
    """Write `<stem>.safetensors.index.json` in the HF layout, with optional extra metadata keys."""
    metadata = {"total_size": int(total_size), **(extra_metadata or {})}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return write_json(Path(folder) / index_name(file_stem), index)


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """Read a safetensors file's JSON header without touching tensor data; raise if it is malformed."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > path.stat().st_size:
            raise ValueError(f"tensor data ends at byte {8 + n + end} but the file has {path.stat().st_size}")
        return header
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"safetensors file {str(path)!r} is truncated or malformed: {e}.") from e


class ComponentReader:
    """Lazy, name-keyed access to one component (`model`, `optimizer`, ...) of a checkpoint folder.

    Reads `<stem>.safetensors.index.json` if present, else the single `<stem>.safetensors`. Files are opened
    with `safe_open` on first use; `get_slice` reads only the requested part of a tensor. With `remote` (a
    `file_service.FileService`), files this rank does not see are read from a rank that does.
    """

    def __init__(self, folder: str | os.PathLike, file_stem: str, remote=None):
        self.folder = Path(folder)
        self.file_stem = file_stem
        self.remote = remote
        self.metadata: dict = {}
        index_path = self.folder / index_name(file_stem)
        if index_path.is_file():
            index = read_json(index_path, "index file")
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                raise CorruptCheckpointError(f"index {str(index_path)!r} has no 'weight_map' object.")
            self.metadata = index.get("metadata") or {}
            self.weight_map = {k: check_plain_name(v, f"index {index_path.name}") for k, v in index["weight_map"].items()}
            self.files = sorted(set(self.weight_map.values()))
        else:
            single = f"{file_stem}.safetensors"
            if not self._is_remote(single) and not (self.folder / single).is_file():
                raise FileNotFoundError(f"{self.folder} has neither {index_path.name} nor {single}.")
            self.files = [single]
            self.weight_map = {k: single for k in sorted(self._header(single)) if k != "__metadata__"}
        self._handles: dict[str, object] = {}

    def _is_remote(self, file: str) -> bool:
        return self.remote is not None and not self.remote.is_local(file)

    def _header(self, file: str) -> dict:
        return self.remote.header(file) if self._is_remote(file) else read_safetensors_header(self.folder / file)

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        try:
            file = self.weight_map[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the {self.file_stem} files of {self.folder}") from None
        if file not in self._handles:
            self._handles[file] = self.remote.open(file) if self._is_remote(file) else \
                safe_open(str(self.folder / file), framework="pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str):
        return self._handle(name).get_slice(name)

    def specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and dtype string of every tensor, from the headers only."""
        out = {}
        for file in self.files:
            header = self._header(file)
            out.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"})
        return out

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

