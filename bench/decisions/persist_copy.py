"""How the persister's copy of one memory-tier file into durable storage costs CPU (issue 32; a diagnostic, no
target): the CPU it takes is CPU training does not get on a machine whose cores all train.

    python bench/decisions/persist_copy.py [--mb 600] [--reps 3] [--durable DIR]

A `--mb` MB file of random bytes is written into /dev/shm (its pages in use, as a committed memory checkpoint's
are), then copied into `--durable` (default: the working folder's filesystem, `.` ) and fsynced, four ways,
alternating, `--reps` times: the source read into fresh buffers (`Store.read` per 64 MB range: what the persister
did until this was measured) or mapped (`Store.read_chunks`: views of one mapping), written through the page
cache or with direct I/O (`direct.write_whole_direct`: four writer threads since 2026-11-27, one before). Prints wall and CPU (user + system of this process)
medians per way and the CPU ratio of each to the persister's way (mapped + direct).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from hf_unified_ckpt.store import store_for  # noqa: E402
from hf_unified_ckpt.store.direct import write_whole_direct  # noqa: E402
from hf_unified_ckpt.store.local_io import write_whole  # noqa: E402

CHUNK = 64 * 2**20


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_ranges(src: str, size: int):
    store = store_for(src)
    for offset in range(0, size, CHUNK):
        yield offset, memoryview(store.read(src, offset, min(CHUNK, size - offset)))


WAYS = {
    "read + page cache": lambda src, dst, n: write_whole(dst, read_ranges(src, n), n),
    "mapped + page cache": lambda src, dst, n: write_whole(dst, store_for(src).read_chunks(src, CHUNK), n),
    "read + direct": lambda src, dst, n: write_whole_direct(dst, read_ranges(src, n), n),
    "mapped + direct": lambda src, dst, n: write_whole_direct(dst, store_for(src).read_chunks(src, CHUNK), n),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=600)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--durable", default=".")
    a = parser.parse_args()
    size = a.mb * 2**20
    src = f"/dev/shm/hf_unified_ckpt-persist-copy-{uuid.uuid4().hex[:8]}.bin"
    dst = os.path.join(a.durable, f".persist-copy-{uuid.uuid4().hex[:8]}.bin")
    block = os.urandom(2**20)
    try:
        with open(src, "wb") as f:
            for _ in range(a.mb):
                f.write(block)
        times = {way: [] for way in WAYS}
        for rep in range(a.reps):
            for way in (list(WAYS) if rep % 2 == 0 else list(reversed(WAYS))):
                cpu, wall = cpu_seconds(), time.perf_counter()
                WAYS[way](src, dst, size)
                fd = os.open(dst, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                times[way].append((time.perf_counter() - wall, cpu_seconds() - cpu))
                os.unlink(dst)
    finally:
        for path in (src, dst):
            if os.path.exists(path):
                os.unlink(path)
    base = statistics.median(c for _, c in times["mapped + direct"])
    print(f"copy of {a.mb} MB from /dev/shm into {os.path.abspath(a.durable)}, {a.reps} reps, medians "
          f"({os.cpu_count()} CPUs):")
    for way, runs in times.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        print(f"  {way:20s} wall {wall:5.2f} s   CPU {cpu:5.2f} s   CPU / mapped + direct {cpu / base:4.1f}")


if __name__ == "__main__":
    main()
