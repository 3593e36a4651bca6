"""Sharded safetensors: writing one shard durably, HF-style index files, and lazy name-keyed reading
(`ComponentReader`, a `format.reader.TensorReader`). Header parsing lives in the torch-free `headers` module
(`read_safetensors_header` is re-exported here)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping

import torch

from ...errors import CorruptCheckpointError
from ...store import as_ref, join, local_paths_of, name_of, store_for
from .files import FileRecord, crc32_combine, read_json, write_json
from .manifest import read_manifest
from .manifest_fields import check_index_fields
from ...format.headers import tensor_specs
from .safetensors_header import read_safetensors_header
from .tensor_files import open_tensors
from ...format.reader import FileHandle, FileOpener, LogicalReader, Specs, TensorReader, TensorSlice

__all__ = ["SAFETENSORS_METADATA", "ComponentReader", "LocalFiles", "StoredFiles", "index_name",
           "read_safetensors_header", "write_index", "write_shard"]

SAFETENSORS_METADATA = {"format": "pt"}


def _writable(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous tensor; views into larger buffers (ZeRO fragments) are written without a copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def write_shard(ref: str | os.PathLike, tensors: Mapping[str, torch.Tensor], direct_io: bool = False) -> FileRecord:
    """Write one safetensors file with `{"format": "pt"}` metadata, durably, through its store (`direct_io`: past
    the page cache where the store allows it); return its record.

    The bytes are those `safetensors.torch.save_file` writes (`planning.safetensors_header`: wider dtypes first,
    then by name), streamed tensor by tensor (`Store.write_whole`); the CRC-32 of each range is computed from
    memory as it is written and combined. Tensors sharing storage (one per-group scalar under several names) are
    written as copies."""
    from ...format.planning import TensorSpec, header_bytes, safetensors_header

    ref = as_ref(ref)
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = _writable(tensor)
        if tensor.nbytes and (tensor.data_ptr(), tensor.nbytes) in seen:
            tensor = tensor.clone()
        seen.add((tensor.data_ptr(), tensor.nbytes))
        out[name] = tensor
    header, offsets = safetensors_header([TensorSpec.of(n, t) for n, t in out.items()])
    head = header_bytes(header)
    size = len(head) + sum(t.nbytes for t in out.values())
    ranges = itertools.chain([(0, memoryview(head))],
                             ((len(head) + offsets[n][0], _bytes_of(out[n])) for n in sorted(out, key=offsets.get)))
    store = store_for(ref)
    crc = 0
    for _, length, range_crc in store.write_whole(ref, ranges, size, direct_io=direct_io):
        crc = crc32_combine(crc, range_crc, length)
    store.sync(ref)
    return FileRecord(name_of(ref), size, f"{crc:08x}")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.nbytes else memoryview(b"")


def index_name(file_stem: str) -> str:
    return f"{file_stem}.safetensors.index.json"


def write_index(folder: str | os.PathLike, file_stem: str, weight_map: Mapping[str, str], total_size: int,
                extra_metadata: Mapping | None = None) -> FileRecord:
    """Write `<stem>.safetensors.index.json` in the HF layout, with optional extra metadata keys."""
    metadata = {"total_size": int(total_size), **(extra_metadata or {})}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return write_json(join(folder, index_name(file_stem)), index)


class LocalFiles(FileOpener):
    """The files of one checkpoint folder as its store holds them (the name is historical: any store): headers
    read by ranged reads, handles from `tensor_files.open_tensors` (memory-mapped where the store has local
    paths)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = as_ref(folder)
        self.store = store_for(self.folder)
        self._blocks: dict | None = None

    def exists(self, file: str) -> bool:
        return self.store.size(join(self.folder, file)) is not None

    def header(self, file: str) -> dict:
        return read_safetensors_header(join(self.folder, file))

    def open(self, file: str) -> FileHandle:
        return open_tensors(join(self.folder, file), self.blocks(file))

    def blocks(self, file: str) -> dict | None:
        """The manifest's CRC-32 per block of `file` (files uploaded in parts to an object store), which a ranged
        read checks; None where there are none (local folders are verified whole before loading)."""
        if local_paths_of(self.store) is not None:
            return None
        if self._blocks is None:
            try:
                table = read_manifest(self.folder)["files"]
            except FileNotFoundError:
                table = {}
            self._blocks = {name: entry["blocks"] for name, entry in table.items() if "blocks" in entry}
        return self._blocks.get(file)


class StoredFiles(TensorReader):
    """The tensors of one component's safetensors files, as stored: named by `<stem>.safetensors.index.json` if
    present, else by the header of the single `<stem>.safetensors`.

    Each file's header and handle come from one `FileOpener`, chosen once per file: the local folder, or `remote` (a
    `file_service.FileService`) for a file this rank does not see. Handles are opened on first use.
    """

    def __init__(self, folder: str | os.PathLike, file_stem: str, remote=None):
        self.folder, self.file_stem = as_ref(folder), file_stem
        self._local, self._remote = LocalFiles(self.folder), remote
        index_path = join(self.folder, index_name(file_stem))
        if self._local.exists(index_name(file_stem)):
            self.metadata, self.weight_map = _read_index(index_path)
            self.files = sorted(set(self.weight_map.values()))
            self._openers = {file: self._opener(file) for file in self.files}
        else:
            single = f"{file_stem}.safetensors"
            self.metadata, self.files, self._openers = {}, [single], {single: self._opener(single)}
            if not self._openers[single].exists(single):
                raise FileNotFoundError(f"{self.folder} has neither {index_name(file_stem)} nor {single}.")
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


def _read_index(index_path: str) -> tuple[dict, dict[str, str]]:
    """The metadata and weight map of an index file, every field's type checked and its file names plain names."""
    return check_index_fields(read_json(index_path, "index file"), str(index_path))


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
        from ...format.codecs import codec_from_metadata

        stored = StoredFiles(folder, file_stem, remote)
        where = f"the {file_stem} files of {stored.folder}"
        codec = codec if codec is not None else codec_from_metadata(stored.metadata, where, anchor,
                                                                    index=index_name(file_stem))
        super().__init__(stored, codec, where=where, file_of=stored.weight_map.get)
        self.folder, self.file_stem = stored.folder, file_stem
