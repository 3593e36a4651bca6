"""The direct writer's chunk size and writer threads (`store/direct.py` `CHUNK`, `WRITERS`; issue 59 part 2), beside a
raw direct write of the same number of bytes, in one run.

    python bench/decisions/direct_chunks.py [--gb 3.87] [--reps 8] [--ways 8x4,16x2,32x2,32x3,64x2] [--folder /tmp]

Tensors shaped as a 300M Llama's and its AdamW state's (two 131 MB embeddings, then 4 MB and 11.5 MB tensors in
turn; `--gb` in all, float32, in the memory torch gives them: not page-aligned, so every chunk is copied into a
writer's buffer, as a synchronous save of live tensors does), written as one file's ranges after a 5,000-byte header
by `write_at_direct` with each way's MiB chunk x writer threads, and by `raw_disk.raw_write` (random bytes from one
16 MiB buffer, `O_DIRECT`, one write in flight). Each repetition runs every way once, the order rotating; every write
ends with an fsync, every one starts after `sync`. Prints each repetition, the medians and raw / way (= the way's
throughput over the raw write's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.raw_disk

import torch  # noqa: E402

from bench.raw_disk import raw_write  # noqa: E402
from hf_unified_ckpt.store.direct import write_at_direct  # noqa: E402

HEADER = 5000


def tensors_of(nbytes: float) -> list[torch.Tensor]:
    sizes = [32000 * 1024 * 4] * 2 + [1024 * 1024 * 4, 1024 * 2816 * 4] * 10**4
    out, total = [], 0
    for size in sizes:
        if total >= nbytes:
            break
        out.append(torch.empty(size // 4).uniform_())
        total += size
    return out


def ranges(tensors: list[torch.Tensor]):
    yield 0, memoryview(b"h" * HEADER)
    offset = HEADER
    for t in tensors:
        view = memoryview(t.numpy()).cast("B")
        yield offset, view
        offset += len(view)


def ours(folder: Path, tensors: list[torch.Tensor], size: int, chunk_mib: int, writers: int) -> float:
    path = folder / f".direct_chunks_{os.getpid()}"
    started = time.perf_counter()
    write_at_direct(path, ranges(tensors), size, chunk=chunk_mib * 2**20, writers=writers)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.87)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--ways", default="8x4,16x2,32x2,32x3,64x2", help="MiB chunk x writers, comma-separated")
    parser.add_argument("--folder", type=Path, default=Path("/tmp"))
    a = parser.parse_args()
    torch.manual_seed(0)
    tensors = tensors_of(a.gb * 1e9)
    size = HEADER + sum(t.nbytes for t in tensors)
    ways = {"raw": lambda: raw_write(a.folder, size)["seconds"]}
    for way in a.ways.split(","):
        chunk, writers = (int(x) for x in way.split("x"))
        ways[way] = lambda chunk=chunk, writers=writers: ours(a.folder, tensors, size, chunk, writers)
    names, times = list(ways), {name: [] for name in ways}
    for rep in range(a.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            os.sync()
            time.sleep(0.3)
            times[name].append(ways[name]())
        print(rep, {name: round(t[-1], 2) for name, t in times.items()}, flush=True)
    raw = statistics.median(times["raw"])
    print(f"{size / 1e9:.2f} GB, medians of {a.reps}: " + ", ".join(
        f"{name} {statistics.median(t):.2f} s ({raw / statistics.median(t):.3f} of raw)" for name, t in times.items()))


if __name__ == "__main__":
    main()
