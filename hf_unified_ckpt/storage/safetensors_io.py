"""Sharded safetensors: writing one shard durably, HF-style index files, and lazy name-keyed reading
(`ComponentReader`, a `storage.reader.TensorReader`). Header parsing lives in the torch-free `headers` module
(`read_safetensors_header` is re-exported here)."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CorruptCheckpointError
from .checksum import crc32
from .files import FileRecord, check_plain_name, crc32_combine, file_crc32, fsync_file, read_json, write_json
from .headers import read_safetensors_header, tensor_specs
from .reader import FileHandle, FileOpener, LogicalReader, Specs, TensorReader, TensorSlice

__all__ = ["SAFETENSORS_METADATA", "ComponentReader", "LocalFiles", "StoredFiles", "index_name",
           "read_safetensors_header", "write_index", "write_shard"]

SAFETENSORS_METADATA = {"format": "pt"}


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
            data_crc = crc32(_bytes_of(out[name]), data_crc)
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
    head_crc = crc32(header_bytes, crc32(struct.pack("<Q", n)))
    return f"{crc32_combine(head_crc, data_crc, start):08x}"


def index_name(file_stem: str) -> str:
    return f"{file_stem}.safetensors.index.json"


def write_index(folder: str | os.PathLike, file_stem: str, weight_map: Mapping[str, str], total_size: int,
                extra_metadata: Mapping | None = None) -> FileRecord:
    """Write `<stem>.safetensors.index.json` in the HF layout, with optional extra metadata keys."""
    metadata = {"total_size": int(total_size), **(extra_metadata or {})}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return write_json(Path(folder) / index_name(file_stem), index)


class LocalFiles(FileOpener):
    """The files of a local checkpoint folder: headers read from disk, handles from `safe_open`."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def exists(self, file: str) -> bool:
        return (self.folder / file).is_file()

    def header(self, file: str) -> dict:
        return read_safetensors_header(self.folder / file)

    def open(self, file: str) -> FileHandle:
        return safe_open(str(self.folder / file), framework="pt")


class StoredFiles(TensorReader):
    """The tensors of one component's safetensors files, as stored: named by `<stem>.safetensors.index.json` if
    present, else by the header of the single `<stem>.safetensors`.

    Each file's header and handle come from one `FileOpener`, chosen once per file: the local folder, or `remote` (a
    `file_service.FileService`) for a file this rank does not see. Handles are opened on first use.
    """

    def __init__(self, folder: str | os.PathLike, file_stem: str, remote=None):
        self.folder, self.file_stem = Path(folder), file_stem
        self._local, self._remote = LocalFiles(self.folder), remote
        index_path = self.folder / index_name(file_stem)
        if index_path.is_file():
            self.metadata, self.weight_map = _read_index(index_path)
            self.files = sorted(set(self.weight_map.values()))
            self._openers = {file: self._opener(file) for file in self.files}
        else:
            single = f"{file_stem}.safetensors"
            self.metadata, self.files, self._openers = {}, [single], {single: self._opener(single)}
            if not self._openers[single].exists(single):
                raise FileNotFoundError(f"{self.folder} has neither {index_path.name} nor {single}.")
            self.weight_map = {k: single for k in sorted(tensor_specs(self._header(single)))}
        self._handles: dict[str, FileHandle] = {}

    def _opener(self, file: str) -> FileOpener:
        return self._remote if self._remote is not None and not self._remote.is_local(file) else self._local

    def _header(self, file: str) -> dict:
        return self._openers[file].header(file)

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def specs(self) -> Specs:
        """Shape and dtype name of every stored tensor, from the headers only (in the index's order)."""
        headers = {file: tensor_specs(self._header(file)) for file in self.files}
        out = {}
        for name, file in self.weight_map.items():
            if name not in headers[file]:
                raise CorruptCheckpointError(f"{index_name(self.file_stem)} in {self.folder} puts {name!r} in {file}, "
                                             "whose header does not list it.")
            out[name] = headers[file][name]
        return out

    def _handle(self, name: str) -> FileHandle:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the {self.file_stem} files of {self.folder}") from None
        if file not in self._handles:
            self._handles[file] = self._openers[file].open(file)
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str) -> TensorSlice:
        return self._handle(name).get_slice(name)

    def close(self) -> None:
        self._handles.clear()


def _read_index(index_path: Path) -> tuple[dict, dict[str, str]]:
    """The metadata and weight map of an index file, its file names checked to be plain names."""
    index = read_json(index_path, "index file")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CorruptCheckpointError(f"index {str(index_path)!r} has no 'weight_map' object.")
    weight_map = {k: check_plain_name(v, f"index {index_path.name}") for k, v in index["weight_map"].items()}
    return index.get("metadata") or {}, weight_map


class ComponentReader(LogicalReader):
    """Lazy, name-keyed access to one component (`model`, `optimizer`, ...) of a checkpoint folder: the
    `TensorReader` engines load unified checkpoints from.

    The stored tensors (`StoredFiles`: the index, or the single file; with `remote`, a `file_service.FileService`,
    files this rank does not see are read from a rank that does) are shown through the codec their index metadata
    names (`codecs.codec_from_metadata`; identity when none), so engines see logical tensors only: decoded moments,
    rebuilt master weights (whose codec reads the bf16 weights from `anchor`, the model's reader), never scales;
    an explicit `codec` overrides the metadata's.
    `get_slice(name)[index]` reads only the requested part of a tensor stored as it is.
    """

    def __init__(self, folder: str | os.PathLike, file_stem: str, remote=None, codec=None, anchor=None):
        from ..codecs import codec_from_metadata

        stored = StoredFiles(folder, file_stem, remote)
        where = f"the {file_stem} files of {stored.folder}"
        codec = codec if codec is not None else codec_from_metadata(stored.metadata, where, anchor)
        super().__init__(stored, codec, where=where)
        self.folder, self.file_stem = stored.folder, file_stem
