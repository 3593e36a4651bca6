"""Writing a whole file with direct I/O (`O_DIRECT`): the bytes go from an aligned bounce buffer to the disk,
bypassing the page cache, so a large one-writer save does not first fill gigabytes of page cache and then wait for
their writeback (fsync), and does not evict the page cache the job is using. Used where one process writes every
byte of a file (the offline converter); the caller still fsyncs the file for its metadata (size, extents).

Direct I/O needs the buffer address, file offset and length aligned to the device's logical block size: the
bounce buffer is page-aligned (anonymous `mmap`), reused for every file of a thread, and the file's last block is
written padded, then the file is truncated to its real size. Filesystems without direct I/O (tmpfs, some network
filesystems) refuse it with EINVAL at open or at the first write: `write_whole_direct` then returns False and
writes nothing, and the caller writes the file through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from .files import pwrite_all

#: Bounce buffer size (a multiple of every logical block size in use: 512 B and 4 KiB).
CHUNK = 8 * 2**20
_ALIGN = 4096
_local = threading.local()


def write_whole_direct(path: Path, ranges: Sequence[tuple[int, memoryview]], size: int, chunk: int = CHUNK) -> bool:
    """Write `ranges` ((offset, bytes), together covering [0, size) without gaps or overlaps, in offset order)
    into a new file `path` with direct I/O. Returns False, having written nothing that matters (the caller
    rewrites the file), where the filesystem does not support direct I/O or the ranges do not tile the file."""
    if not _tiles(ranges, size) or not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        _stream(fd, ranges, _bounce(chunk))
        os.ftruncate(fd, size)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
    return True


def _tiles(ranges: Sequence[tuple[int, memoryview]], size: int) -> bool:
    end = 0
    for offset, data in ranges:
        if offset != end:
            return False
        end += len(data)
    return end == size


def _bounce(chunk: int) -> memoryview:
    """This thread's page-aligned buffer of `chunk` bytes (kept for the thread's next file)."""
    if getattr(_local, "size", None) != chunk:
        _local.buffer, _local.size = mmap.mmap(-1, chunk), chunk
    return memoryview(_local.buffer)


def _stream(fd: int, ranges: Sequence[tuple[int, memoryview]], buf: memoryview) -> None:
    """Copy the ranges through `buf` into the file, one full buffer per write; the last one padded to a block."""
    filled = written = 0
    for _, data in ranges:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        done = 0
        while done < len(data):
            n = min(len(buf) - filled, len(data) - done)
            buf[filled:filled + n] = data[done:done + n]
            filled, done = filled + n, done + n
            if filled == len(buf):
                pwrite_all(fd, buf, written)
                written, filled = written + filled, 0
    if filled:
        pwrite_all(fd, buf[:-(-filled // _ALIGN) * _ALIGN], written)
