"""`FsspecStore`: a store over an fsspec file system without positional writes or atomic rename: each file is
streamed whole by one writer, a save is written in place and committed by its manifest written last, and a
checkpoint is removed manifest first. Registered for `memory://` (fsspec's in-process file system: one process's
memory, not seen by other ranks), which proves the seam: the same save, verify, load and rotation code runs on it
as on `LocalStore`."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Iterable

from ..format.checksum import crc32
from ..errors import short_read
from .base import Capabilities, ManifestCommit, RangedReads, Range, Written, as_ref, listed_name, probe_write


class FsspecStore(RangedReads, ManifestCommit):
    """References are URLs of one fsspec protocol (see the module docstring). No capability beyond the `Store`
    protocol."""

    capabilities = Capabilities(atomic_rename=False, seen_by_all_ranks=False)

    def __init__(self, scheme: str, **storage_options):
        import fsspec

        self.scheme = scheme
        self.fs = fsspec.filesystem(scheme, **storage_options)

    def _key(self, ref) -> str:
        return self.fs._strip_protocol(as_ref(ref))

    # ---- reading ------------------------------------------------------------------------------------------------
    def list(self, ref: str) -> dict[str, int | None]:
        key = self._key(ref)
        if not self.fs.isdir(key):
            return {}
        out = {}
        for entry in self.fs.ls(key, detail=True):
            name = posixpath.basename(entry["name"].rstrip("/"))
            if not listed_name(name, as_ref(ref)):
                continue
            out[name] = None if entry["type"] == "directory" else int(entry["size"])
        return out

    def size(self, ref: str) -> int | None:
        key = self._key(ref)
        try:
            info = self.fs.info(key)
        except FileNotFoundError:
            return None
        return None if info["type"] == "directory" else int(info["size"])

    def is_folder(self, ref: str) -> bool:
        return self.fs.isdir(self._key(ref))

    def read(self, ref: str, offset: int = 0, length: int | None = None) -> bytes:
        key = self._key(ref)
        if self.size(ref) is None:
            raise FileNotFoundError(f"no such file: {as_ref(ref)}")
        data = self.fs.cat_file(key, start=offset or None, end=None if length is None else offset + length)
        if length is not None and len(data) != length:
            raise short_read(as_ref(ref), offset, length, len(data))
        return data

    # ---- writing ------------------------------------------------------------------------------------------------
    def put(self, ref: str, data: bytes, exclusive: bool = False) -> None:
        """`exclusive` is checked, then written: not atomic, enough for one process's memory."""
        if exclusive and self.size(ref) is not None:
            raise FileExistsError(f"{as_ref(ref)} already exists")
        self.fs.pipe_file(self._key(ref), bytes(data))

    def write_whole(self, ref: str, ranges: Iterable[Range], size: int, direct_io: bool = False) -> list[Written]:
        """Streamed into one file object. A failed write leaves no file under `ref`: what it wrote is removed (an
        fsspec file may be visible, or uploaded, with the bytes written so far: the memory file system shows a
        file from the moment it is opened, and a buffered remote file uploads what it holds when it is closed)."""
        key = self._key(ref)
        written, end = [], 0
        try:
            with self.fs.open(key, "wb") as f:
                for offset, data in ranges:
                    if offset != end:
                        raise ValueError(f"{ref}: a range starts at byte {offset}, expected {end} (gap or overlap)")
                    f.write(data)
                    written.append((offset, len(data), crc32(data)))
                    end += len(data)
                if end != size:
                    raise ValueError(f"{ref}: the ranges end at {end}, the file is {size} bytes")
        except BaseException:
            with contextlib.suppress(Exception):  # the write's own error is the one to report
                if self.fs.isfile(key):
                    self.fs.rm_file(key)
            raise
        return written

    def sync(self, ref: str) -> None:
        """A closed file is committed: nothing more to do."""

    def move(self, src: str, dst: str) -> None:
        self.fs.mv(self._key(src), self._key(dst))

    def make_folder(self, ref: str) -> None:
        self.fs.makedirs(self._key(ref), exist_ok=True)

    def remove(self, ref: str) -> None:
        key = self._key(ref)
        if self.fs.exists(key):
            self.fs.rm(key, recursive=True)

    def check_writable(self, probe: str) -> None:
        probe_write(self, probe)

    def close(self) -> None:
        """Nothing held open."""
