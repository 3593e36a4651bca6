"""Writing files with direct I/O (`O_DIRECT`): the bytes go from aligned memory to the disk, bypassing the page
cache, so a large save does not first fill gigabytes of page cache and then wait for their writeback (fsync), does
not take the training's cores for that writeback, and does not evict the page cache the job is using. The caller
still fsyncs each file for its metadata (size, extents). Direct I/O needs the file offset and length aligned to the
device's logical block size, and the buffer address to its DMA alignment (4 bytes on many NVMe drives, 512 here).

One writer, `write_at_direct`: a rank's ranges of a file, gaps allowed (other ranks' bytes; every save to a local
folder, issue 49). The aligned blocks of each contiguous run go to disk in chunks by several threads, each with one
write in flight (a raw `dd oflag=direct` speed from one process), copied into their page-aligned buffers with the
GIL released, or written straight from memory laid out as the file where its alignment is one the kernel takes (the
snapshot's host buffers made ahead, a mapped memory checkpoint the persister copies, a tensor that happens to sit
so); the partial blocks at a run's edges, which another rank's bytes may share,
go through the page cache. Each range's CRC-32 is computed from its parts where they are read anyway (a writer
thread's buffer right after its copy, while it is in the CPU's cache; the memory a straight write reads; the edges
written through the page cache) and the parts joined (`crc32_combine`): the tensors' memory is read once, not once
for the copy and once more for the checksum. `write_whole_direct` is the same writer for a new file written whole
(machine-local folders, the memory tier's persister, the converter's whole files), its ranges checked to tile the
file.
`direct_io_works` probes a filesystem once (tmpfs and some network filesystems refuse direct I/O); where it does not,
the caller writes through the page cache.

The ranges are consumed as an iterable, one at a time, so that the caller can produce (read, assemble, copy off a
device) the next range while these are written.
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..format.checksum import crc32, crc32_combine
from .local_io import file_mode, grow_to, pwrite_all

#: Bytes of one direct write (a multiple of every logical block size in use: 512 B and 4 KiB). With `WRITERS`, measured
#: on this project's CPU VM (bench/decisions/direct_chunks.py, 3.9 GB of tensors, medians of 8 beside a raw direct
#: write): 8 MiB x 4 writers 0.80 of the raw write, 16 MiB x 2 0.95, 32 MiB x 2 1.01, 32 MiB x 3 0.99, 64 MiB x 2 1.01.
CHUNK = 32 * 2**20
_ALIGN = 4096


def _open_direct(path: Path, buf: memoryview) -> int | None:
    """`path` created for direct I/O, after one aligned block was written to it (the probe of `direct_io_works`);
    None where either is refused."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, file_mode(path))
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    try:
        pwrite_all(fd, buf[:_ALIGN], 0)
    except OSError as e:
        os.close(fd)
        if e.errno == errno.EINVAL:
            return None
        raise
    return fd


# ---- ranges of a shared file, several writes in flight -------------------------------------------------------------
#: Direct writes in flight per file: two, so that the disk's queue stays full while the next chunk is copied (more
#: threads copying at once slowed the disk down: each copy takes memory bandwidth the disk's own transfers need).
WRITERS = 2
#: A contiguous run shorter than this is written through the page cache whole (not worth aligning).
SMALL_RUN = 256 * 1024
#: The least memory alignment a straight direct write is tried from. The kernel asks for the device's `dma_alignment`
#: (4 bytes on many NVMe drives, 512 on virtio disks): each refusal raises it above the refused address's alignment.
_MEMORY_ALIGN = 4
_support: dict[int, bool] = {}
_support_lock = threading.Lock()


def direct_io_works(folder: str | os.PathLike) -> bool:
    """Whether the filesystem of `folder` takes direct writes (probed once per device with a throw-away file: tmpfs
    and some network filesystems refuse them with EINVAL)."""
    device = os.stat(folder).st_dev
    with _support_lock:
        if device not in _support:
            probe = Path(folder, f".direct_probe_{os.getpid()}_{threading.get_native_id()}")
            buf = _aligned(_ALIGN)
            fd = _open_direct(probe, memoryview(buf))
            if fd is not None:
                os.close(fd)
            probe.unlink(missing_ok=True)
            buf.close()
            _support[device] = fd is not None
        return _support[device]


def write_at_direct(path: str | os.PathLike, ranges: Iterable[tuple[int, memoryview]], size: int | None,
                    chunk: int = CHUNK, writers: int = WRITERS) -> list[tuple[int, int, int]]:
    """Write `ranges` ((offset, bytes) in offset order, no overlaps; gaps are other writers' bytes) into `path`,
    created if missing and never truncated, grown to `size` first where given; return each range's (offset, length,
    CRC-32), computed from memory (from its parts, as they are written). The aligned blocks of each contiguous run of
    ranges go to the disk with direct I/O, copied (GIL released) into page-aligned buffers by `writers` threads, each
    with one write in flight; the partial blocks at a run's edges (which other writers' bytes may share) and runs
    under `SMALL_RUN` go through the page cache. The ranges are consumed one at a time, at most `2 * writers` chunks
    ahead of the disk: the caller may produce the next while these are written, and what it produced is released
    once written. The caller checked `direct_io_works` and makes the file durable (fsync) afterwards."""
    buffered = os.open(path, os.O_WRONLY | os.O_CREAT, file_mode(path))
    try:
        if size is not None:
            grow_to(buffered, size, path)
        direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            with _ChunkWriters(direct, chunk, writers) as pool:
                runs, extents = _Runs(buffered, pool), []
                for offset, data in ranges:
                    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
                    runs.add(offset, data, len(extents))
                    extents.append((offset, len(data)))
                    del data
                runs.close_run()
                pool.wait()
                return _joined(extents, pool.parts)
        finally:
            os.close(direct)
    finally:
        os.close(buffered)


def _joined(extents: list[tuple[int, int]], parts: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """Each range's (offset, length, CRC-32) from the CRC-32s of its parts ((range, offset, length, crc), in any
    order), which must tile it."""
    by_range: list[list[tuple[int, int, int]]] = [[] for _ in extents]
    for index, at, length, crc in parts:
        by_range[index].append((at, length, crc))
    records = []
    for (offset, length), pieces in zip(extents, by_range):
        crc, end = 0, offset
        for at, n, part in sorted(pieces):
            if at != end:
                raise RuntimeError(f"the written parts of the range at byte {offset} do not tile it (byte {end})")
            crc, end = crc32_combine(crc, part, n), end + n
        if end != offset + length:
            raise RuntimeError(f"the written parts of the range at byte {offset} end at {end}, not {offset + length}")
        records.append((offset, length, crc))
    return records


def write_whole_direct(path: str | os.PathLike, ranges: Iterable[tuple[int, memoryview]], size: int,
                       chunk: int = CHUNK, writers: int = WRITERS) -> list[tuple[int, int, int]]:
    """`write_at_direct` into a new file `path` from `ranges` that tile [0, size) in offset order; a gap or an
    overlap raises ValueError before the range is written, ranges that end short of `size` after. The caller checked
    `direct_io_works`, made sure no file is at `path` (one that may be mapped is never truncated), and fsyncs."""
    return write_at_direct(path, _tiling(ranges, size, path), size, chunk, writers)


def _tiling(ranges: Iterable[tuple[int, memoryview]], size: int, path) -> Iterable[tuple[int, memoryview]]:
    end = 0
    for offset, data in ranges:
        if offset != end:
            raise ValueError(f"{path}: a range starts at byte {offset}, expected {end} (gap or overlap)")
        end += data.nbytes
        yield offset, data
        del data
    if end != size:
        raise ValueError(f"{path}: the ranges end at {end}, the file is {size} bytes")


def _ceil(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class _Runs:
    """Cuts a stream of ranges into contiguous runs: each run's partial first block buffered, its whole blocks handed
    to the writers chunk by chunk as the ranges arrive, its partial last block buffered; a run under `SMALL_RUN`
    buffered whole. Holds only the ranges not yet handed over; every piece keeps the index of its range (its CRC-32
    is one part of that range's)."""

    def __init__(self, fd: int, pool: "_ChunkWriters"):
        self.fd, self.pool = fd, pool
        self.pending: collections.deque[tuple[int, memoryview, int]] = collections.deque()
        self.start = self.end = self.pos = None  # the run's first byte, its end, the first byte not handed over
        self.direct = False

    def add(self, offset: int, data: memoryview, index: int) -> None:
        if self.end is not None and offset < self.end:
            raise ValueError(f"a range starts at byte {offset}, before the previous one ends ({self.end})")
        if self.end is not None and offset != self.end:
            self.close_run()
        if self.start is None:
            self.start = self.pos = offset
        self.pending.append((offset, data, index))
        self.end = offset + len(data)
        if not self.direct and self.end - self.start >= SMALL_RUN:
            self.direct = True
            self._buffered(_ceil(self.start))
        while self.direct and self.end - self.pos >= self.pool.chunk:
            self._hand(self.pos + self.pool.chunk)

    def close_run(self) -> None:
        if self.start is None:
            return
        if self.direct and self.end // _ALIGN * _ALIGN > self.pos:
            self._hand(self.end // _ALIGN * _ALIGN)
        self._buffered(self.end)
        self.pending.clear()
        self.start = self.end = self.pos = None
        self.direct = False

    def _buffered(self, hi: int) -> None:
        for offset, data, index in self._take(hi):
            pwrite_all(self.fd, data, offset)
            self.pool.parts.append((index, offset, len(data), crc32(data)))

    def _hand(self, hi: int) -> None:
        self.pool.submit(self.pos, hi - self.pos, self._take(hi))

    def _take(self, hi: int) -> list[tuple[int, memoryview, int]]:
        """The pending bytes in [pos, hi), as (file offset, bytes, range index); ranges wholly before `hi` are let
        go."""
        pieces, lo = [], self.pos
        while self.pending and lo < hi:
            offset, data, index = self.pending[0]
            a, b = max(lo, offset), min(hi, offset + len(data))
            if a < b:
                pieces.append((a, data[a - offset:b - offset], index))
            if offset + len(data) <= hi:
                self.pending.popleft()
            lo = b
        self.pos = max(self.pos, hi)
        return pieces


class _ChunkWriters:
    """Threads that each copy one aligned chunk into their page-aligned buffer and write it with direct I/O (or write
    it straight from memory where the kernel takes that memory), adding each piece's CRC-32 to `parts` as
    (range index, file offset, length, crc); at most `2 * writers` chunks handed over and not yet written (`submit`
    blocks beyond). `wait` returns once every chunk is written, and raises the first failure."""

    def __init__(self, fd: int, chunk: int, writers: int):
        self.fd, self.chunk = fd, chunk
        self.parts: list[tuple[int, int, int, int]] = []  # appended to by every writer thread
        self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="hf_unified_ckpt-direct")
        self._buffers = [_aligned(chunk) for _ in range(writers)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for buf in self._buffers:
            self._free.put(buf)
        self._slots = threading.BoundedSemaphore(2 * writers)
        self._futures: list = []
        self._memory_align = _MEMORY_ALIGN

    def submit(self, offset: int, length: int, pieces: list[tuple[int, memoryview, int]]) -> None:
        self._slots.acquire()
        self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
        self._futures.append(self._pool.submit(self._write, offset, length, pieces))

    def _write(self, offset: int, length: int, pieces: list[tuple[int, memoryview, int]]) -> None:
        try:
            if not self._straight(offset, pieces):
                self._through_buffer(offset, length, pieces)
        finally:
            self._slots.release()

    def _straight(self, offset: int, pieces: list[tuple[int, memoryview, int]]) -> bool:
        """Write a chunk that is one piece of memory straight from it, where its address is aligned as the kernel's
        direct I/O asks (memory laid out as the file: a snapshot's host buffer placed so, `snapshot.HostBuffers`; a
        tensor whose bytes happen to sit as they do in the file); False where it is not, or where the kernel refuses
        that memory (EINVAL, before anything is written: the alignment asked of later chunks is raised above it)."""
        address = _address(pieces[0][1]) if len(pieces) == 1 else 1
        if address % self._memory_align:
            return False
        at, data, index = pieces[0]
        try:
            pwrite_all(self.fd, data, offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._memory_align = max(self._memory_align, (address & -address) * 2)  # a benign race: it only grows
            return False
        self.parts.append((index, at, len(data), crc32(data)))
        return True

    def _through_buffer(self, offset: int, length: int, pieces: list[tuple[int, memoryview, int]]) -> None:
        buf = self._free.get()
        try:
            self._copy_in(np.frombuffer(buf, dtype=np.uint8, count=length), offset, pieces)
            del pieces  # the caller's memory is let go before the write
            pwrite_all(self.fd, memoryview(buf)[:length], offset)
        finally:
            self._free.put(buf)

    def _copy_in(self, target: np.ndarray, offset: int, pieces: list[tuple[int, memoryview, int]]) -> None:
        """Copy `pieces` (GIL released) into `target`, which holds the file's bytes from `offset`, each piece's
        CRC-32 taken from the bytes just copied (still in the CPU's cache)."""
        for at, data, index in pieces:
            copy = target[at - offset:at - offset + len(data)]
            np.copyto(copy, np.frombuffer(data, dtype=np.uint8))
            self.parts.append((index, at, len(data), crc32(copy)))

    def wait(self) -> None:
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def __enter__(self) -> "_ChunkWriters":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)  # on a failure too: no write outlives the file's descriptor
        for buf in self._buffers:
            try:
                buf.close()
            except BufferError:  # a failed write's traceback still holds a view of it: unmapped once that goes
                pass


def _address(data: memoryview) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data if len(data) else 0


def _aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of `nbytes`."""
    return mmap.mmap(-1, nbytes)
