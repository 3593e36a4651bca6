"""What the disk takes: `nbytes` of random bytes written raw, as `dd if=random of=F bs=16M oflag=direct` then `sync`
would (issue 49). The yardstick our save's throughput is divided by, measured in the same run as the save.

    python bench/raw_disk.py FOLDER NBYTES      # prints the GB/s of a direct write and of a buffered write + fsync

Random bytes, never zeros (a virtual disk may shortcut zeros); 16 MiB blocks from one page-aligned buffer; `O_DIRECT`
where the filesystem takes it (tmpfs does not: then buffered writes, said in the result's `direct`), an fsync at the
end either way. The file is deleted afterwards.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

BLOCK = 16 * 2**20


def _aligned_random(nbytes: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, nbytes)  # page-aligned: what O_DIRECT asks of the memory it writes from
    buffer.write(os.urandom(nbytes))
    return buffer


def raw_write(folder: str | Path, nbytes: int, direct: bool = True) -> dict:
    """Write `nbytes` random bytes into a new file under `folder` in 16 MiB blocks (direct I/O where possible), fsync,
    delete. Returns {"seconds", "bytes", "gb_s", "direct"}: `direct` False where the filesystem refused `O_DIRECT`."""
    path = Path(folder) / f".raw_disk_{os.getpid()}_{time.monotonic_ns()}"
    buffer = _aligned_random(BLOCK)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    used_direct = False
    fd = None
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
            used_direct = True
        except OSError:  # EINVAL on tmpfs
            fd = None
    if fd is None:
        fd = os.open(path, flags, 0o644)
    view = memoryview(buffer)
    try:
        started = time.perf_counter()
        left = -(-nbytes // 4096) * 4096 if used_direct else nbytes  # direct writes take whole sectors (< 4 KiB more)
        while left > 0:
            n = min(left, BLOCK)
            os.write(fd, view[:n])
            left -= n
        os.fsync(fd)
        seconds = time.perf_counter() - started
    finally:
        view.release()
        os.close(fd)
        buffer.close()
        path.unlink(missing_ok=True)
    return {"seconds": seconds, "bytes": nbytes, "gb_s": nbytes / seconds / 1e9, "direct": used_direct}


def main() -> None:
    folder, nbytes = sys.argv[1], int(float(sys.argv[2]))
    for direct in (True, False):
        r = raw_write(folder, nbytes, direct)
        print(f"{'direct' if r['direct'] else 'buffered + fsync'}: {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.2f} s "
              f"= {r['gb_s']:.2f} GB/s")


if __name__ == "__main__":
    main()
