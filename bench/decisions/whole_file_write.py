"""A safetensors file written whole (`write_shard`: machine-local folders, `save_model` under a sharded engine, the
converter's whole files) through the page cache vs with the direct writers (`unified_checkpoint_direct_io`), against a
raw direct write of the same number of bytes, in one run (issue 49).

    python bench/decisions/whole_file_write.py [--mb 2400] [--reps 3] [--folder .]

150 fp32 tensors of uneven sizes (`--mb` MB in all), each way `--reps` times, alternating; every write ends with an
fsync. Prints the median wall time, GB/s and CPU (user + system of this process) per way, and the ratios of the
direct writers' GB/s to the raw write's and to the page cache's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.raw_disk

import torch  # noqa: E402

from bench.raw_disk import raw_write  # noqa: E402
from hf_unified_ckpt.checkpoint.folder.safetensors_io import write_shard  # noqa: E402

WAYS = ("page cache", "direct", "raw direct")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=2400)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--folder", default=".")
    a = parser.parse_args()
    per_tensor = a.mb * 10**6 // 4 // 150
    tensors = {f"layer{i}.weight": torch.randn(per_tensor + i) for i in range(150)}
    nbytes = sum(t.nbytes for t in tensors.values())
    path = os.path.join(a.folder, f".whole_file_write_{os.getpid()}.safetensors")
    times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    try:
        for rep in range(a.reps):
            for way in (WAYS if rep % 2 == 0 else tuple(reversed(WAYS))):
                cpu, wall = cpu_seconds(), time.perf_counter()
                if way == "raw direct":
                    seconds = raw_write(a.folder, nbytes)["seconds"]  # its writes and fsync, not its random fill
                else:
                    write_shard(path, tensors, direct_io=way == "direct")
                    seconds = time.perf_counter() - wall
                times[way].append((seconds, cpu_seconds() - cpu))
                Path(path).unlink(missing_ok=True)
    finally:
        Path(path).unlink(missing_ok=True)
    rate = {}
    print(f"{nbytes / 1e9:.2f} GB written whole into {os.path.abspath(a.folder)}, {a.reps} reps, medians:")
    for way, measured in times.items():
        wall, cpu = statistics.median(w for w, _ in measured), statistics.median(c for _, c in measured)
        rate[way] = nbytes / wall / 1e9
        print(f"  {way:11s} wall {wall:6.2f} s  {rate[way]:5.2f} GB/s  CPU {cpu:5.2f} s")
    print(f"direct / raw direct: {rate['direct'] / rate['raw direct']:.2f}; "
          f"direct / page cache: {rate['direct'] / rate['page cache']:.2f}")


if __name__ == "__main__":
    main()
