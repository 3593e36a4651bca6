"""The step after each background save, on one device (issue 49, part 2): how much the first save costs training
against the later ones.

    python bench/gpu/first_save_profile.py async|flash [--device cpu|cuda] [--size 100m] [--steps 21] [--every 5]

Trains bench_gpu.py's Llama (batch 1 x 32 tokens on a CPU, 8 x 1024 on a GPU) with a save every `--every` steps,
each save first waiting (untimed) for the previous one's writes, and prints the median step, every save call's
time, and every step after a save over the median step: the first of them is what the first save adds.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import bench_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("async", "flash"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=list(bench_gpu.SIZES), default="100m")
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--every", type=int, default=5)
    a = parser.parse_args()
    batch, seq = (1, 32) if a.device == "cpu" else (8, 1024)
    r = bench_gpu.run(a.size, a.device, Path("/tmp/hf_uc_first_save"), a.mode, a.steps, a.every, batch=batch,
                      seq=seq, isolate=True)
    steps, median = r["steps_s"], statistics.median(r["steps_s"])
    after = [round(steps[(k + 1) * a.every] - median, 3) for k in range(len(r["saves_s"]))
             if (k + 1) * a.every < len(steps)]
    print(f"{a.mode}: median step {median:.3f} s; save calls {[round(x, 3) for x in r['saves_s']]} s; "
          f"the step after each save over the median {after} s")


if __name__ == "__main__":
    main()
