"""The read side, declared once: `TensorReader` (what every engine calls on a component it loads from), the file
handles and openers a reader gets its bytes from, and the `Codec` seam between stored and logical tensors.

Readers: `safetensors_io.ComponentReader` (one component of a unified folder; each of its files opened locally
with `safe_open` or, for a file only another machine holds, through `file_service.FileService`) and
`legacy.sources.TensorSource` (tensors computed from a legacy folder on demand). `ComponentReader` is a
`LogicalReader`: it shows engines the logical tensors a codec makes of the stored ones (the identity codec
today), so auxiliary stored tensors such as scales never reach an engine. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

#: Tensor name -> (shape, safetensors dtype name such as "F32").
Specs = dict[str, tuple[tuple[int, ...], str]]


@runtime_checkable
class TensorSlice(Protocol):
    """A tensor not read yet: `safe_open(...).get_slice(name)`, `file_service.RemoteSlice`, `LoadedSlice`."""

    def __getitem__(self, index) -> torch.Tensor:
        """The part `index` (a slice of rows, or a tuple of slices, one per leading dimension) of the tensor. Reads
        only that part where the backing store allows (a local or remote safetensors file); a tensor computed on
        demand is computed whole, then indexed."""
        ...


@runtime_checkable
class TensorReader(Protocol):
    """Lazy, name-keyed access to the tensors of one component (model weights, master weights, optimizer state):
    what engines load from, whatever the folder (unified or legacy, local or spread over machines). A context
    manager: leaving it closes the reader."""

    #: The component's index metadata (`total_size`; for optimizer state also `param_groups`, `state_types`); {}
    #: when there is none.
    metadata: dict

    def keys(self) -> list[str]:
        """The names of the tensors, in a stable order (never a codec's auxiliary tensors)."""
        ...

    def __contains__(self, name: str) -> bool:
        """Whether `name` is one of `keys()`."""
        ...

    def specs(self) -> Specs:
        """Name -> (shape tuple, safetensors dtype name) of every tensor of `keys()`, without reading tensor data."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, on CPU. KeyError naming `name` when the reader has no such tensor."""
        ...

    def get_slice(self, name: str) -> TensorSlice:
        """Tensor `name`, not read yet: `get_slice(name)[index]` reads only the requested part where the backing
        store allows. KeyError naming `name` when the reader has no such tensor."""
        ...

    def close(self) -> None:
        """Let go of open files; the reader is not used after."""
        ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@runtime_checkable
class FileHandle(Protocol):
    """One open safetensors file: the part of `safe_open(path, framework="pt")` that readers use."""

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name` of the file."""
        ...

    def get_slice(self, name: str) -> TensorSlice:
        """Tensor `name` of the file, read when indexed (only the part asked for)."""
        ...


@runtime_checkable
class FileOpener(Protocol):
    """Where a reader gets one file's header and handle: `safetensors_io.LocalFiles` (the local folder) or
    `file_service.FileService` (a file held by another machine). A reader chooses one opener per file, once."""

    def exists(self, file: str) -> bool:
        """Whether `file` (a plain name in the checkpoint folder) can be opened."""
        ...

    def header(self, file: str) -> dict:
        """The safetensors JSON header of `file` (no tensor data read)."""
        ...

    def open(self, file: str) -> FileHandle:
        """A handle on `file`."""
        ...


@runtime_checkable
class Codec(Protocol):
    """How logical tensors (what engines see) are stored (what the files hold), e.g. an optimizer moment kept as
    8-bit codes plus per-block scales under auxiliary names. `LogicalReader` shows the logical specs minus the
    `hidden` names; a logical tensor stored under its own name with its logical shape and dtype is read as stored
    (sliced lazily), every other one is built by `decode`."""

    def logical_specs(self, stored_specs: Specs, metadata: dict) -> Specs:
        """The logical tensors (name -> (shape, dtype name)) that the stored ones and the index `metadata` stand for."""
        ...

    def decode(self, name: str, reader: TensorReader) -> torch.Tensor:
        """Logical tensor `name`, built from the stored tensors of `reader`."""
        ...

    def hidden(self, name: str) -> bool:
        """Whether stored tensor `name` is auxiliary (codes, scales): never shown to an engine."""
        ...

    def problems(self, stored_specs: Specs) -> list[tuple[str, str]]:
        """(stored name, what is wrong) of every stored tensor that is missing or not of the shape and dtype the
        codec's metadata gives it (`format.state_shapes.codec_stored_problems`): checked on the headers, before any
        tensor is decoded or any buffer allocated from the metadata."""
        ...


@runtime_checkable
class RowDecoder(Protocol):
    """A codec that decodes a slice of rows from the stored bytes that cover them (a `Codec` without it is decoded
    whole, then indexed)."""

    def decode_rows(self, name: str, reader: TensorReader, rows: slice) -> torch.Tensor:
        """Rows `rows` (a slice of the first dimension) of logical tensor `name`, reading only the stored bytes
        that cover them."""
        ...


class IdentityCodec(Codec):
    """The stored tensors are the logical ones (every checkpoint this version writes)."""

    def logical_specs(self, stored_specs: Specs, metadata: dict) -> Specs:
        return dict(stored_specs)

    def decode(self, name: str, reader: TensorReader) -> torch.Tensor:
        return reader.get(name)

    def hidden(self, name: str) -> bool:
        return False

    def problems(self, stored_specs: Specs) -> list[tuple[str, str]]:
        return []


IDENTITY = IdentityCodec()


class DecodedSlice(TensorSlice):
    """A logical tensor a codec builds: a slice of rows is decoded from the stored bytes that cover it when the
    codec can (`RowDecoder`), anything else is decoded whole, then indexed."""

    def __init__(self, codec: Codec, name: str, stored: TensorReader):
        self._codec, self._name, self._stored = codec, name, stored

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(self._codec, RowDecoder) and isinstance(index, slice) and index.step in (None, 1):
            return self._codec.decode_rows(self._name, self._stored, index)
        return self._codec.decode(self._name, self._stored)[index]


class LoadedSlice(TensorSlice):
    """A tensor produced whole by `load` when indexed (a legacy or a decoded tensor), then indexed."""

    def __init__(self, load: Callable[[], torch.Tensor]):
        self._load = load

    def __getitem__(self, index) -> torch.Tensor:
        return self._load()[index]


class LogicalReader(TensorReader):
    """The `TensorReader` engines see over a `stored` one: the logical tensors `codec` (default: identity) makes of
    the stored tensors. The logical specs are worked out once, from the stored headers, on first use, after the
    codec checked that the stored tensors are what its metadata says (`CorruptCheckpointError` naming each, with
    its file where `file_of` tells it); `where` completes the KeyError for a name it does not have ("'x' is not in
    <where>")."""

    def __init__(self, stored: TensorReader, codec: Codec | None = None, where: str = "this checkpoint",
                 file_of: Callable[[str], str | None] | None = None):
        self.stored = stored
        self.codec = IDENTITY if codec is None else codec
        self.metadata = stored.metadata
        self._where = where
        self._file_of = file_of or (lambda name: None)
        self._logical: Specs | None = None
        self._as_stored: frozenset[str] = frozenset()

    def _specs(self) -> Specs:
        if self._logical is None:
            stored = self.stored.specs()
            problems = self.codec.problems(stored)
            if problems:
                shown = [f"{self._file_of(key) or self._where}: {key!r} {problem}" for key, problem in problems]
                raise CorruptCheckpointError(
                    f"the stored tensors of {self._where} do not match their codec metadata "
                    f"({len(shown)} problem(s)):\n  " + "\n  ".join(shown[:20]) + ("\n  ..." if len(shown) > 20 else "")
                    + "\nThe files were changed after the save; nothing was decoded. Resume from another checkpoint.")
            logical = self.codec.logical_specs(stored, self.metadata)
            self._logical = {n: spec for n, spec in logical.items() if not self.codec.hidden(n)}
            self._as_stored = frozenset(n for n, spec in self._logical.items() if stored.get(n) == spec)
        return self._logical

    def keys(self) -> list[str]:
        return list(self._specs())

    def file_of(self, name: str) -> str | None:
        """The file holding (the stored form of) tensor `name`, where known: for naming it in an error."""
        return self._file_of(name)

    def __contains__(self, name: str) -> bool:
        return name in self._specs()

    def specs(self) -> Specs:
        return dict(self._specs())

    def get(self, name: str) -> torch.Tensor:
        return self.stored.get(name) if self._read_as_stored(name) else self.codec.decode(name, self.stored)

    def get_slice(self, name: str) -> TensorSlice:
        if self._read_as_stored(name):
            return self.stored.get_slice(name)
        return DecodedSlice(self.codec, name, self.stored)

    def _read_as_stored(self, name: str) -> bool:
        """Whether logical tensor `name` is read as stored (else decoded); KeyError when there is no such tensor."""
        if name not in self._specs():
            raise KeyError(f"{name!r} is not in {self._where}")
        return name in self._as_stored

    def close(self) -> None:
        self.stored.close()


def read_flat_range(reader: TensorReader, name: str, shape: Sequence[int], start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of the flattened tensor `name` of `reader`, reading only the rows that cover
    them (how sharded engines load a flat fragment or partition)."""
    if len(shape) == 0:
        return reader.get(name).reshape(1)[start:start + numel]
    row = math.prod(shape[1:])
    first, last = start // row, -(-(start + numel) // row)
    rows = reader.get_slice(name)[first:last].reshape(-1)
    return rows[start - first * row: start - first * row + numel]
