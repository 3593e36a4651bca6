"""The storage seam: `Store`, the only code that touches checkpoint bytes at rest, and the string references that
name checkpoints above it.

A checkpoint, a run folder or a file is named by a *reference*: a local path (`/runs/a/checkpoint-8`) or a URL
(`memory://runs/a/checkpoint-8`). References are plain strings joined with `/` (`join`); never `pathlib.Path`,
which turns `s3://b/x` into `s3:/b/x`. `store_for(ref)` finds the store of a reference by its URL scheme (a small
registry: `register_store`); a reference without a scheme is a local path.

What a store can do is what it implements (the capability protocols below) plus what it declares in
`Capabilities`, and the algorithms above choose from those (never from the scheme): where positional writes exist and every rank sees the files, ranks write their pieces of a shared file in
place; elsewhere each file is streamed whole, in offset order, by one writer. Where rename is atomic a save is
written into a hidden staging folder and renamed into place; elsewhere it is written in place and the manifest,
written last, is the commit (`publish` does nothing), and `remove` deletes the manifest first, so a half-removed
checkpoint is never picked. Modelled on torch DCP's `FileSystemBase` / `StorageWriter` / `StorageReader`,
torchtitan's checkpoint storage and orbax's atomicity options.

What a store has or has not beyond the `Store` protocol are capabilities, each a protocol of its own:
`MultipartUploads` (several processes upload numbered parts of one file), `LocalPaths` (references are paths
other libraries open: safetensors files are then read memory-mapped) and `WritableMappings` (a file mapped for
writing: the memory tier's snapshots). A caller asks for one (`multipart_of`, `local_paths_of`,
`writable_mappings_of`: the capability, or None) and never calls a method a store lacks; `Capabilities` declares
only what no method shows (atomic rename, who sees the bytes, part sizes). Reading tensors is not the store's: `checkpoint/folder/tensor_files.py` reads
a safetensors file through `read` (ranged), or memory-mapped where the store has local paths (`open_mapped_tensors`).

Which ranks call what: every method is local to the calling process (no collective). The save algorithm
(`checkpoint/save/saving.py`) decides who calls what, in order: rank 0 stages; every writer writes its files or pieces
and `sync`s them; rank 0 `put`s the indexes and the manifest last; each folder's leader `publish`es.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..format.checksum import crc32 as _crc32

logger = logging.getLogger(__name__)

#: One byte range to write: (offset in the file, its bytes).
Range = tuple[int, memoryview]
#: What a write reports per range: (offset, length, CRC-32 of its bytes).
Written = tuple[int, int, int]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

#: The hidden siblings a store that renames (`stage` / `publish` / `retire`) leaves beside `checkpoint-N` while it
#: works, `.checkpoint-N.<host>.<pid>.<token><suffix>` (`node.owner_tag`: unique to one save of one process, so two
#: processes never share one): a save being written, the checkpoint it replaces, one being removed. Those whose
#: process is gone were left by an interrupted one (`checkpoint.folder.commit.remove_stale`).
STAGING_SUFFIX = ".incomplete"
SUPERSEDED_SUFFIX = ".superseded"
DELETING_SUFFIX = ".deleting"


@dataclass(frozen=True)
class Capabilities:
    """What a store can do that no method of it shows; the save and remove algorithms choose their strategy from
    it and from the capability protocols the store implements (`PositionalWrites`, `MultipartUploads`,
    `LocalPaths`, `WritableMappings`: asked with `positional_writes_of`...)."""

    #: Renaming a folder is atomic (a save is staged aside and renamed into place); else the manifest is the commit.
    atomic_rename: bool
    #: Every process of a job on any machine sees the same bytes (a local folder may be one machine's only: the
    #: save then finds out with writer marks).
    seen_by_all_ranks: bool
    #: Of a store with multipart uploads (`MultipartUploads`): each part at least `min_part_size` bytes but the
    #: last, and about `part_size` bytes (the target size of the parts ranks upload and of those a whole file is
    #: streamed in). 0 for others.
    min_part_size: int = 0
    part_size: int = 0


@runtime_checkable
class Store(Protocol):
    """Bytes at rest under string references (see the module docstring). Every method acts on this process's view
    of the store; none is a collective."""

    capabilities: Capabilities

    def list(self, ref: str) -> dict[str, int | None]:
        """The entries directly inside folder `ref`, name -> size in bytes (None for a sub-folder), in one call;
        {} when `ref` is not a folder. Only plain names (`listed_name`): an object key whose name is empty, `.`,
        `..` or holds a backslash is left out, with a warning."""

    def size(self, ref: str) -> int | None:
        """The size of file `ref`; None when there is no such file (or it is a folder). A store with local paths
        raises `NotRegularFileError` for an entry that is neither a regular file nor a folder (a FIFO, a device, a
        symbolic link to a file): nothing of a checkpoint is read through one."""

    def is_folder(self, ref: str) -> bool:
        """Whether `ref` is a folder (holds entries, or was made with `make_folder`)."""

    def read(self, ref: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes `[offset, offset + length)` of file `ref` (to its end when `length` is None): exactly `length` bytes,
        else `CorruptCheckpointError` naming the file and the range (`errors.short_read`: a file that ends sooner is
        never passed on short). FileNotFoundError when it is missing; `NotRegularFileError` when it is not a regular
        file (never followed through a final symbolic link, never waited on)."""

    def read_chunks(self, ref: str, chunk: int) -> Iterator[Range]:
        """File `ref` as consecutive (offset, bytes) ranges of `chunk` bytes (the last shorter; one empty range for
        an empty file), read one at a time as they are asked for: what a copy into another store streams. A
        local file is mapped, not read (no buffer is allocated per range; a range is valid until the next)."""

    def crc32(self, ref: str, offset: int, length: int) -> int | None:
        """The CRC-32 of bytes `[offset, offset + length)` of file `ref`; None when the file is missing."""

    def put(self, ref: str, data: bytes, exclusive: bool = False) -> None:
        """Write small file `ref` whole, durably and atomically (a reader sees the old bytes or the new, and a
        crash leaves no partial file under `ref`); several processes may put the same file, the last one wins.
        `exclusive`: only if there is no file `ref` (else FileExistsError): the manifest's commit."""

    def write_whole(self, ref: str, ranges: Iterable[Range], size: int, direct_io: bool = False) -> list[Written]:
        """Create file `ref` from `ranges` (offset order, tiling [0, size)), consumed one at a time so that the
        caller may produce the next while this one is written. Durable only after `sync`. `direct_io`: bypass the
        page cache where the store has one and allows it."""

    def sync(self, ref: str) -> None:
        """Make the bytes written to file `ref` durable."""

    def move(self, src: str, dst: str) -> None:
        """Rename file `src` to `dst`, replacing it (atomically where `capabilities.atomic_rename`)."""

    def make_folder(self, ref: str) -> None:
        """Create folder `ref` (and its parents) if it is missing."""

    def remove(self, ref: str) -> None:
        """Remove file or folder `ref` (everything under it); nothing when it is missing."""

    def stage(self, final: str, tag: str = "") -> str:
        """The reference a save of checkpoint `final` writes into: a hidden sibling folder renamed into place by
        `publish` where rename is atomic (`.<name>.<tag>.incomplete`: `tag`, a `node.owner_tag`, makes it this
        save's own), else `final` itself (the manifest, written last, commits it)."""

    def publish(self, staging: str, final: str) -> None:
        """Make the save written into `staging` the checkpoint `final`, durably, replacing an earlier one of the
        same name. Nothing to do where the manifest is the commit."""

    def retire(self, ref: str, commit_file: str) -> None:
        """Remove checkpoint `ref` so that no reader ever takes a half-removed one for complete: hide it by a
        rename first where rename is atomic, else delete its `commit_file` (the manifest) first."""

    def check_writable(self, probe: str) -> None:
        """Raise unless object `probe` (a name no checkpoint uses) can be written and removed here: what a run
        asks before its first step (read-only credentials, a missing bucket, an unreachable server)."""

    def close(self) -> None:
        """Release what this process holds open for the store (a client session and its thread); made again on
        next use. Nothing where the store holds nothing."""


@runtime_checkable
class PositionalWrites(Protocol):
    """A store where several processes write byte ranges of one file at offsets: shared files written in place."""

    def write_at(self, ref: str, ranges: Iterable[Range], size: int | None, direct_io: bool = False) -> list[Written]:
        """Write `ranges` (in offset order) at their offsets into file `ref`, created if missing and never
        truncated, sized to `size` first when it is given (the rank that writes the header); return each range's
        (offset, length, CRC-32), computed from memory. The ranges are consumed one at a time. `direct_io`: the
        aligned blocks bypass the page cache where the filesystem allows it. Durable only after `sync`."""

    def block_size(self, ref: str) -> int:
        """The alignment writes into folder `ref` should keep (its filesystem's block, or a parallel filesystem's
        stripe where it reports it so): a power of two of at least 4 KiB."""


@runtime_checkable
class MultipartUploads(Protocol):
    """A store where several processes upload numbered parts of one file (of about `Capabilities.part_size`
    bytes): one begins the upload, any uploads parts to it, one completes it and the file appears whole, at once."""

    def start_upload(self, ref: str) -> str:
        """Begin a multipart upload of file `ref`; its ID, to which any process may upload parts."""

    def write_part(self, ref: str, upload: str, number: int, data) -> str:
        """Upload part `number` (1-based, parts in offset order) of file `ref` in `upload`; the part's tag."""

    def finish_upload(self, ref: str, upload: str, parts: list[tuple[int, str]]) -> None:
        """Complete `upload` from its (number, tag) parts: file `ref` appears whole, at once."""

    def abort_upload(self, ref: str, upload: str) -> None:
        """Drop `upload` and its parts (nothing when it is gone)."""

    def abort_uploads(self, prefix: str, keep=()) -> list[str]:
        """Abort the uploads under `prefix` that crashed saves left, except the IDs in `keep`; the files'
        references."""


@runtime_checkable
class LocalPaths(Protocol):
    """A store whose references are local paths other libraries can open."""

    def local_path(self, ref: str) -> str:
        """`ref` as a path of this machine."""


@runtime_checkable
class WritableMappings(Protocol):
    """A store that maps a file for writing (the memory tier copies a snapshot straight into its file)."""

    def map_writable(self, ref: str, size: int, maps) -> memoryview:
        """A writable shared mapping of file `ref` (created if missing) of `size` bytes, its blocks taken (ENOSPC
        raised here), kept in `maps` (`local_io.WritableMaps`) for the next write of the same file. Bytes copied
        into it are in the file; `sync` makes them durable."""


def positional_writes_of(store: Store) -> PositionalWrites | None:
    """`store` as `PositionalWrites`, or None where files are written whole."""
    return store if isinstance(store, PositionalWrites) else None


def multipart_of(store: Store) -> MultipartUploads | None:
    """`store` as `MultipartUploads`, or None where it has none."""
    return store if isinstance(store, MultipartUploads) else None


def local_paths_of(store: Store) -> LocalPaths | None:
    """`store` as `LocalPaths`, or None where its references are not local paths."""
    return store if isinstance(store, LocalPaths) else None


def writable_mappings_of(store: Store) -> WritableMappings | None:
    """`store` as `WritableMappings`, or None where it maps no file for writing."""
    return store if isinstance(store, WritableMappings) else None


def open_mapped_tensors(store: LocalPaths, ref: str):
    """Safetensors file `ref` of a store with local paths, memory-mapped by `safe_open` (a `format.reader
    .FileHandle`). The one place a local file is handed to the safetensors library: tensor reading lives above the
    store (`checkpoint/folder/tensor_files.py`), the path below it."""
    from safetensors import safe_open  # torch is imported only where tensors are read

    from .local_io import open_regular

    path = store.local_path(ref)
    fd = open_regular(path)  # a regular file, not followed through a link: the mapping is of this very file
    try:
        return safe_open(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path, framework="pt")
    finally:
        os.close(fd)


def probe_write(store: Store, probe: str) -> None:
    """`check_writable` by writing small file `probe` and removing it."""
    store.put(probe, b"hf_unified_ckpt write check\n")
    store.remove(probe)


class ManifestCommit:
    """The commit of a store without atomic rename: a save is written in place and committed by its manifest,
    written last; a checkpoint is removed manifest first."""

    def stage(self, final: str, tag: str = "") -> str:
        return as_ref(final).rstrip("/")

    def publish(self, staging: str, final: str) -> None:
        """The manifest, written last into `final`, committed it."""

    def retire(self, ref: str, commit_file: str) -> None:
        """The manifest first: a removal cut short leaves files no reader takes for a checkpoint."""
        self.remove(posixpath.join(as_ref(ref).rstrip("/"), commit_file))
        self.remove(ref)


class RangedReads:
    """`read_chunks` and `crc32` of a store without local paths, from its `size` and ranged `read`."""

    def read_chunks(self, ref: str, chunk: int) -> Iterator[Range]:
        size = self.size(ref)
        if size is None:
            raise FileNotFoundError(ref)
        for offset in range(0, size, chunk) if size else [0]:
            yield offset, memoryview(self.read(ref, offset, min(chunk, size - offset)))

    def crc32(self, ref: str, offset: int, length: int) -> int | None:
        size = self.size(ref)
        if size is None or size < offset + length:
            return None
        return _crc32(self.read(ref, offset, length)) if length else 0


def listed_name(name: str, folder: str) -> bool:
    """Whether a name a listing returned is a plain entry name; a hostile key (`..`, `.`, empty, a backslash) is
    refused with a warning, so no caller joins it into a path."""
    if name and name not in (".", "..") and "/" not in name and "\\" not in name and "\x00" not in name:
        return True
    logger.warning("Ignoring the entry %r listed in %s: not a plain name (hostile or damaged storage).", name,
                   folder)
    return False


# ---- references -------------------------------------------------------------------------------------------------

def as_ref(ref: str | os.PathLike) -> str:
    """A reference from a string or a path object (a path's `/` separators kept)."""
    return os.fspath(ref) if isinstance(ref, os.PathLike) else str(ref)


def scheme_of(ref: str) -> str:
    """The URL scheme of `ref` ("" for a local path)."""
    match = _SCHEME.match(ref)
    return match.group(1).lower() if match else ""


def join(ref: str | os.PathLike, *names: str) -> str:
    """`ref`/`names...` (plain names, or relative parts with `/`)."""
    ref = as_ref(ref)
    if scheme_of(ref):
        return "/".join([ref.rstrip("/"), *names])
    return os.path.join(ref, *names)


def name_of(ref: str | os.PathLike) -> str:
    """The last part of `ref` (a file or folder name)."""
    ref = as_ref(ref)
    return posixpath.basename(ref.rstrip("/")) if scheme_of(ref) else os.path.basename(os.path.normpath(ref))


def parent_of(ref: str | os.PathLike) -> str:
    """The folder holding `ref`."""
    ref = as_ref(ref)
    if scheme_of(ref):
        head, _, _ = ref.rstrip("/").rpartition("/")
        return head if not head.endswith(":/") else head + "/"
    return os.path.dirname(os.path.normpath(ref))


def sibling(ref: str | os.PathLike, name: str) -> str:
    """The reference named `name` beside `ref`."""
    return join(parent_of(ref), name)


def canonical(ref: str | os.PathLike) -> str:
    """`ref` in the form two references to the same checkpoint share: a local path resolved (symbolic links,
    `..`), a URL without a trailing `/`."""
    ref = as_ref(ref)
    if scheme_of(ref) == "file":
        ref = ref[len("file://"):]
    return ref.rstrip("/") if scheme_of(ref) else os.path.realpath(ref)


# ---- registry ---------------------------------------------------------------------------------------------------

_FACTORIES: dict[str, Callable[[str], Store]] = {}
_STORES: dict[str, Store] = {}


def register_store(scheme: str, factory: Callable[[str], Store]) -> None:
    """Make `store_for` answer references of URL `scheme` ("" for local paths) with `factory(scheme)`."""
    _FACTORIES[scheme.lower()] = factory
    _STORES.pop(scheme.lower(), None)


def store_for(ref: str | os.PathLike) -> Store:
    """The store that holds `ref`, by its URL scheme (one instance per scheme and process)."""
    scheme = scheme_of(as_ref(ref))
    if scheme not in _STORES:
        if scheme not in _FACTORIES:
            known = ", ".join(f"{s}://" for s in sorted(_FACTORIES) if s) or "none"
            raise ValueError(f"no checkpoint store handles {as_ref(ref)!r} (scheme {scheme!r}); known URL schemes: "
                             f"{known}, and local paths. Use a local path, or register a store for {scheme}://.")
        _STORES[scheme] = _FACTORIES[scheme](scheme)
    return _STORES[scheme]


def is_file(ref: str | os.PathLike) -> bool:
    """Whether file `ref` exists in its store."""
    ref = as_ref(ref)
    return store_for(ref).size(ref) is not None


def is_folder(ref: str | os.PathLike) -> bool:
    ref = as_ref(ref)
    return store_for(ref).is_folder(ref)


def read_bytes(ref: str | os.PathLike) -> bytes:
    ref = as_ref(ref)
    return store_for(ref).read(ref)


def put_bytes(ref: str | os.PathLike, data: bytes) -> None:
    ref = as_ref(ref)
    store_for(ref).put(ref, data)


def listing(ref: str | os.PathLike) -> dict[str, int | None]:
    ref = as_ref(ref)
    return store_for(ref).list(ref)


def remove(ref: str | os.PathLike) -> None:
    ref = as_ref(ref)
    store_for(ref).remove(ref)
