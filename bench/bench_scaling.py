"""How the unified save scales with ranks and model size, against the native save (issue 15 item 5).

    python bench/bench_scaling.py [--engines zero3[,fsdp2]] [--ranks 2,4] [--sizes 50m,200m] [--reps 5] [--json]

For every engine, size and rank count (in that order), one `bench/bench_save.py --engine E --nproc N --size S
--no-resume --json` launch: our unified save, the native Trainer save (fsync'd) and a raw parallel write + fsync of
the same bytes, alternating per repetition in that launch (see bench_save.py). Prints each launch's report, then
one table: ranks, parameters, bytes each save wrote, median seconds of ours / native / raw, peak extra RSS per rank
during the save (the rank whose RSS grew most: bench_save's PeakRSS, max over ranks; ours and native), and per-rank
throughput (bytes written / ranks / seconds). --json: the rows as one JSON list, the last line of stdout.

Engine: ZeRO-3 by default, because it is the engine whose every tensor (weights included) is partitioned over the
ranks, so a save's per-rank work should shrink as 1/N with more ranks, while the native save with a loadable weights
file (`stage3_gather_16bit_weights_on_model_save`) gathers the whole model onto rank 0: the case where scaling can
differ most. FSDP2 (`--engines zero3,fsdp2`) shards the same way but doubles the run time; ZeRO-2 keeps whole
weights on every rank.

The machine's CPU count is printed in the header: more ranks than cores are oversubscribed (4 ranks on 2 cores), so
compare rows with that in mind; a rank count of 4 at 200M needs a few GB of memory per rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_save import ENGINES, SIZES, cpu_cores  # noqa: E402

MiB, MB = 2**20, 1e6


def run_cell(engine: str, ranks: int, size: str, reps: int) -> dict:
    """One bench_save.py launch (save only); prints its report, returns its JSON summary."""
    cmd = [sys.executable, str(HERE / "bench_save.py"), "--engine", engine, "--nproc", str(ranks), "--size", size,
           "--reps", str(reps), "--dtype", "fp32", "--no-resume", "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_save.py failed ({engine}, {ranks} ranks, {size}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-6000:]}")
    lines = proc.stdout.splitlines()
    print("\n".join(lines[:-1]), flush=True)
    summary = json.loads(lines[-1])
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary


def row_of(s: dict) -> dict:
    m, n = s["medians_s"], s["nproc"]
    return {"engine": s["engine"], "ranks": n, "size": s["size"], "params": s["params"], "reps": s["reps"],
            "bytes_ours": s["bytes"]["ours"], "bytes_native": s["bytes"]["native"],
            "ours_s": m["ours"], "native_s": m["native"], "raw_s": m["raw"],
            "ours_over_native": round(m["ours"] / m["native"], 4),
            "peak_extra_rss_per_rank_ours": s["peak_extra_rss_bytes"]["ours"],
            "peak_extra_rss_per_rank_native": s["peak_extra_rss_bytes"]["native"],
            "per_rank_bytes_per_s_ours": round(s["bytes"]["ours"] / n / m["ours"]),
            "per_rank_bytes_per_s_native": round(s["bytes"]["native"] / n / m["native"]),
            "per_rank_bytes_per_s_raw": round(s["bytes"]["ours"] / n / m["raw"]),
            "cpu_cores": s["cpu_cores"], "wall_s": s["wall_s"]}


def print_table(rows: list[dict]) -> None:
    cores = cpu_cores()
    print(f"\nsave scaling, fp32, {cores} CPU cores (rows with more ranks than cores are oversubscribed), "
          f"medians of {rows[0]['reps']} alternating repetitions; per-rank throughput = bytes / ranks / seconds")
    print(f"{'engine':<7}{'ranks':>5}{'params':>8}{'bytes ours':>12}{'native':>9}{'ours s':>8}{'native s':>9}"
          f"{'raw s':>7}{'ours/nat':>9}{'RSS ours':>9}{'native':>8}{'MB/s/rank ours':>15}{'native':>8}{'raw':>7}")
    for r in rows:
        print(f"{r['engine']:<7}{r['ranks']:>5}{r['params'] / 1e6:>7.1f}M{r['bytes_ours'] / 1e9:>10.3f}GB"
              f"{r['bytes_native'] / 1e9:>7.3f}GB{r['ours_s']:>8.2f}{r['native_s']:>9.2f}{r['raw_s']:>7.2f}"
              f"{r['ours_over_native']:>9.2f}{r['peak_extra_rss_per_rank_ours'] / MiB:>6.0f}MiB"
              f"{r['peak_extra_rss_per_rank_native'] / MiB:>5.0f}MiB{r['per_rank_bytes_per_s_ours'] / MB:>15.0f}"
              f"{r['per_rank_bytes_per_s_native'] / MB:>8.0f}{r['per_rank_bytes_per_s_raw'] / MB:>7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="zero3", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--sizes", default="50m,200m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list, the last line")
    args = parser.parse_args()
    engines, sizes = args.engines.split(","), args.sizes.split(",")
    ranks = [int(n) for n in args.ranks.split(",")]
    if bad := [e for e in engines if e not in ENGINES] + [s for s in sizes if s not in SIZES]:
        parser.error(f"unknown engine or size: {', '.join(bad)}")
    if min(ranks) < 1:
        parser.error("--ranks must be positive")
    sys.stdout.reconfigure(line_buffering=True)
    print(f"bench_scaling: {cpu_cores()} CPU cores; engines {engines}, ranks {ranks}, sizes {sizes}, reps {args.reps}")
    rows = [row_of(run_cell(e, n, s, args.reps)) for e in engines for s in sizes for n in ranks]
    print_table(rows)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
