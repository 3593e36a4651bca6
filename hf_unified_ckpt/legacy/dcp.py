"""A torch.distributed.checkpoint (DCP) folder read without running pickled code. DCP pickles its `.metadata` and
reads it with a plain `pickle.load` (`FileSystemReader.read_metadata`, also inside `dcp.load`); its non-tensor
entries (an optimizer's param groups) with `torch.load(weights_only=False)` (`DefaultLoadPlanner.load_bytes`).
Here `.metadata` is unpickled allowing only DCP's metadata classes and plain values, read once per folder, and the
entries with `weights_only`."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..store.pickles import TRUST_OPT_IN, load_pickle
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError

METADATA_FILE = ".metadata"
_METADATA_MODULE = dcp_metadata.__name__
#: Globals of a `.metadata` pickle besides DCP's metadata classes and torch's dtypes, layouts and memory formats
#: (torch 2.0 to 2.13 write these; `StorageMeta.checkpoint_id` is a path).
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                                       "PureWindowsPath"))}
_PLAIN_BUILTINS = {"set", "frozenset", "list", "tuple", "dict", "int", "float", "complex", "bool", "str", "bytes",
                   "bytearray", "slice"}


class _Refused(pickle.UnpicklingError):
    """A global `_MetadataUnpickler` does not allow (its dotted name)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its classes, plain builtins and torch's value types; any other global is refused
    before it is looked up."""

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED or (module in ("builtins", "__builtin__") and name in _PLAIN_BUILTINS):
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    if module == _METADATA_MODULE:
        value = getattr(dcp_metadata, name, None)
        return isinstance(value, type) and value.__module__ == _METADATA_MODULE
    return False


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The `Metadata` of the DCP file `path` (`.metadata`), unpickled by `_MetadataUnpickler`. Raises
    `UnsupportedCheckpointError` naming the global and the opt-in for a file that needs another global,
    `CorruptCheckpointError` for one that is not DCP metadata."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise UnsupportedCheckpointError(
            f"{path} pickles {e}: unpickling that could run any code, so it is not done. Only DCP's metadata "
            f"classes and plain Python values are read from a DCP .metadata file. {TRUST_OPT_IN}") from None
    except Exception as e:  # missing, truncated, damaged
        raise CorruptCheckpointError(f"{path.parent} is not a readable torch.distributed.checkpoint folder "
                                     f"({path.name}: {type(e).__name__}: {e}).") from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata.")
    return metadata


class RestrictedReader(FileSystemReader):
    """DCP's `FileSystemReader` of a folder whose `read_metadata` (the caller's, and the one inside `dcp.load`)
    unpickles `.metadata` with `_MetadataUnpickler`, once (later calls return the same metadata)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self._metadata: dcp_metadata.Metadata | None = None
        self._file = Path(path) / METADATA_FILE

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(self._file)
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = dcp_metadata.StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's `DefaultLoadPlanner` for a flat dict of entries (keys as DCP's metadata names them, not flattened:
    the caller's dict is filled) whose non-tensor entries are unpickled with `weights_only`, refused naming the
    entry, the folder and the opt-in when they need any other global."""

    def __init__(self, folder: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.folder = folder

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        self.original_state_dict[key] = load_pickle(value, f"entry {key!r} of the DCP folder {self.folder}",
                                           opt_in=TRUST_OPT_IN)
