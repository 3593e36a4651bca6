"""`LocalStore`: checkpoints in a local (or network-mounted POSIX) folder, as they have always been written.

Shared files are written in place (`pwrite` at planned offsets, several processes into one file), whole files
streamed in order; both bypass the page cache where asked (`direct_io`) and the filesystem allows it (`direct.py`),
and a save is staged in a hidden sibling folder that one `rename` publishes. Whether every rank sees the folder is
found out per save (machine-local disks), so `seen_by_all_ranks` is not promised.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Iterable, Iterator

from . import local_io
from .base import (DELETING_SUFFIX, STAGING_SUFFIX, SUPERSEDED_SUFFIX, Capabilities, Range, Written, as_ref,
                   listed_name, probe_write)
from .direct import direct_io_works, write_at_direct, write_whole_direct
from .node import owner_tag

logger = logging.getLogger(__name__)


class LocalStore:
    """References are local paths (see the module docstring). Capabilities beyond the `Store` protocol:
    `LocalPaths` (`local_path`) and `WritableMappings` (`map_writable`); no multipart uploads."""

    capabilities = Capabilities(atomic_rename=True, seen_by_all_ranks=False)

    def __init__(self, scheme: str = ""):
        self.scheme = scheme

    def _path(self, ref) -> str:
        ref = as_ref(ref)
        return ref[len("file://"):] if ref.startswith("file://") else ref

    # ---- reading ------------------------------------------------------------------------------------------------
    def list(self, ref: str) -> dict[str, int | None]:
        out = {}
        try:
            with os.scandir(self._path(ref)) as entries:
                for entry in entries:
                    if not listed_name(entry.name, ref):
                        continue
                    try:
                        st = entry.stat()
                    except FileNotFoundError:  # removed while listed
                        continue
                    out[entry.name] = None if stat.S_ISDIR(st.st_mode) else st.st_size
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return out

    def size(self, ref: str) -> int | None:
        return local_io.regular_size(self._path(ref))

    def is_folder(self, ref: str) -> bool:
        return os.path.isdir(self._path(ref))

    def read(self, ref: str, offset: int = 0, length: int | None = None) -> bytes:
        return local_io.read_file(self._path(ref), offset, length)

    def read_chunks(self, ref: str, chunk: int) -> Iterator[Range]:
        return local_io.mapped_chunks(self._path(ref), chunk)

    def crc32(self, ref: str, offset: int, length: int) -> int | None:
        return local_io.range_crc32(self._path(ref), offset, length)

    # ---- writing ------------------------------------------------------------------------------------------------
    def put(self, ref: str, data: bytes, exclusive: bool = False) -> None:
        local_io.write_atomic(self._path(ref), data, exclusive=exclusive)

    def write_whole(self, ref: str, ranges: Iterable[Range], size: int, direct_io: bool = False) -> list[Written]:
        path = self._path(ref)
        if direct_io and direct_io_works(os.path.dirname(path) or "."):
            local_io.unlink_existing(path)  # a new file: one that may be mapped is never truncated
            return write_whole_direct(path, ranges, size)
        return local_io.write_whole(path, ranges, size)

    def write_at(self, ref: str, ranges: Iterable[Range], size: int | None, direct_io: bool = False) -> list[Written]:
        path = self._path(ref)
        if direct_io and direct_io_works(os.path.dirname(path) or "."):
            return write_at_direct(path, ranges, size)
        return local_io.write_at(path, ranges, size)

    def block_size(self, ref: str) -> int:
        """`statvfs`'s block or the folder's `st_blksize` (a parallel filesystem reports its stripe there), where
        it is a power of two from 4 KiB to 64 MiB; else 4 KiB."""
        try:
            path = self._path(ref)
            size = max(os.statvfs(path).f_bsize, os.stat(path).st_blksize)
        except OSError:
            return 4096
        return size if 4096 <= size <= 64 * 2**20 and size & (size - 1) == 0 else 4096

    def sync(self, ref: str) -> None:
        local_io.fsync_file(self._path(ref))

    def move(self, src: str, dst: str) -> None:
        os.replace(self._path(src), self._path(dst))

    def make_folder(self, ref: str) -> None:
        local_io.make_folders(self._path(ref))

    def remove(self, ref: str) -> None:
        _remove_entry(self._path(ref))

    # ---- commit -------------------------------------------------------------------------------------------------
    def stage(self, final: str, tag: str = "") -> str:
        head, name = os.path.split(os.path.normpath(self._path(final)))
        return os.path.join(head, f".{name}.{tag}{STAGING_SUFFIX}" if tag else f".{name}{STAGING_SUFFIX}")

    def publish(self, staging: str, final: str) -> None:
        """Rename the staging folder into place (an existing `final` set aside first under a name of this save's
        own, removed after), durably. A `final` that is a symbolic link is replaced as a link: its target is left
        as it is (never removed through the link)."""
        staging, final = self._path(staging), os.path.normpath(self._path(final))
        head, name = os.path.split(final)
        stem = os.path.basename(staging)
        stem = stem[:-len(STAGING_SUFFIX)] if stem.endswith(STAGING_SUFFIX) else f".{name}.{owner_tag()}"
        aside = os.path.join(head, f"{stem}{SUPERSEDED_SUFFIX}")
        _remove_entry(aside)
        if os.path.lexists(final):
            logger.warning("Replacing the existing %s with the checkpoint just written for the same step%s.", final,
                           " (a symbolic link: the link is replaced, its target left as it is)"
                           if os.path.islink(final) else "")
            os.rename(final, aside)
        os.rename(staging, final)
        local_io.fsync_dir(head or ".")
        _remove_entry(aside)

    def retire(self, ref: str, commit_file: str) -> None:
        """Hidden first (`.checkpoint-N.<owner tag>.deleting`): a kill mid-delete leaves no half-deleted
        checkpoint-N. A symbolic link is removed as a link, never through it."""
        path = os.path.normpath(self._path(ref))
        head, name = os.path.split(path)
        doomed = os.path.join(head, f".{name.lstrip('.')}.{owner_tag()}{DELETING_SUFFIX}")
        os.rename(path, doomed)
        _remove_entry(doomed)

    def check_writable(self, probe: str) -> None:
        probe_write(self, probe)

    def close(self) -> None:
        """Nothing held open."""

    # ---- capabilities -------------------------------------------------------------------------------------------
    def local_path(self, ref: str) -> str:
        return self._path(ref)

    def map_writable(self, ref: str, size: int, maps: local_io.WritableMaps) -> memoryview:
        return maps.view(self._path(ref), size)


def _remove_entry(path: str) -> None:
    """Remove `path`: a folder with everything under it, a file, or a symbolic link as a link (never what it points
    to); nothing when it is missing."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
