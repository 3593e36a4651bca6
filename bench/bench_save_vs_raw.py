"""One process's synchronous save against a raw direct write of the same bytes, every save counted (issue 59, part 2).

    python bench/bench_save_vs_raw.py [--size 300m] [--runs 5] [--saves 3] [--work DIR] [--json FILE]

`--runs` fresh processes, one after the other; each trains bench/gpu/bench_gpu.py's Llama (fp32 weights, AdamW, the
plain Trainer on the CPU with the plugin attached; `--size 300m`: ~3.9 GB a checkpoint) for one step, then saves
`--saves` times, each save beside a raw write of the same number of random bytes (bench/raw_disk.py: `O_DIRECT`,
16 MiB blocks, fsync), the order turning every time (save then raw, raw then save, ...; the first run starts with
the save, whose byte count the raw write needs, the next with the raw write of the bytes the first run saved). The save
is the Trainer's `_save_checkpoint` (durable when it returns); save 1 is the process's first. The checkpoint of
the save before is deleted, untimed, before the next (`save_total_limit=None`): no save pays for another's rotation.
Before each timing the kernel writes back what is dirty and the page cache's state is read from /proc/meminfo
(Cached, Dirty, Writeback, MiB): every save and raw write starts with nothing dirty.

Prints each save's and raw write's time and their ratio (raw / save = our throughput / the raw throughput; target
>= 0.85 for every save, the first included), then per save number the median over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "gpu"))
from raw_disk import raw_write  # noqa: E402

TARGET = 0.85


def meminfo() -> dict:
    """The page cache's state, MiB: Cached, Dirty, Writeback."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        if key in ("Cached", "Dirty", "Writeback"):
            fields[key] = int(value.split()[0]) // 1024
    return fields


def settle() -> dict:
    """Wait (at most 30 s) until the kernel holds next to nothing dirty; return the page cache's state."""
    os.sync()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = meminfo()
        if state["Dirty"] + state["Writeback"] < 64:
            break
        time.sleep(0.2)
    return meminfo()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one_run(size: str, saves: int, work: Path, nbytes: int | None, raw_first: bool) -> list[dict]:
    """One process's `saves` saves, each beside a raw write (see the module docstring)."""
    import bench_gpu
    import torch

    torch.manual_seed(0)
    out = work / "run"
    trainer = bench_gpu.build(size, "cpu", out, steps=1, every=None, mode="unified", batch=1, seq=32)
    trainer.train()  # one step: AdamW's state exists
    trainer.args.save_total_limit = None
    rows, previous = [], None
    for k in range(saves):
        trainer.state.global_step = k + 1
        folder = out / f"checkpoint-{k + 1}"
        order = ("raw", "save") if (raw_first and nbytes) else ("save", "raw")
        raw_first = not raw_first
        row = {"save": k + 1, "order": "/".join(order)}
        for kind in order:
            row[f"{kind}_cache_mib"] = settle()
            started = time.perf_counter()
            if kind == "save":
                trainer._save_checkpoint(trainer.model, trial=None)
                row["save_s"] = time.perf_counter() - started
                nbytes = row["bytes"] = folder_bytes(folder)
            else:
                result = raw_write(work, nbytes)
                row["raw_s"], row["raw_direct"] = result["seconds"], result["direct"]
        row["ratio"] = row["raw_s"] / row["save_s"]
        rows.append(row)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        previous = folder
    shutil.rmtree(out, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="300m")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes")
    parser.add_argument("--saves", type=int, default=3, help="saves per process")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_uc_save_vs_raw"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one-run", default=None, help=argparse.SUPPRESS)  # "NBYTES,RAW_FIRST": a run's process
    a = parser.parse_args()
    if a.one_run is not None:
        nbytes, raw_first = (int(x) for x in a.one_run.split(","))
        print("ROWS " + json.dumps(one_run(a.size, a.saves, a.work, nbytes or None, bool(raw_first))), flush=True)
        return
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    runs, nbytes = [], 0
    try:
        for run in range(a.runs):
            done = subprocess.run([sys.executable, __file__, "--size", a.size, "--saves", str(a.saves), "--work",
                                   str(a.work), "--one-run", f"{nbytes},{run % 2}"],
                                  check=True, capture_output=True, text=True)
            rows = json.loads(next(line[5:] for line in done.stdout.splitlines() if line.startswith("ROWS ")))
            nbytes = rows[0]["bytes"]
            runs.append(rows)
            for row in rows:
                print(f"run {run} save {row['save']} ({row['order']}): save {row['save_s']:.2f} s, raw "
                      f"{row['raw_s']:.2f} s, {row['bytes'] / 1e9:.2f} GB: ratio {row['ratio']:.3f}; page cache before "
                      f"the save {row['save_cache_mib']} MiB", flush=True)
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    per_save = []
    for k in range(a.saves):
        ratios = [rows[k]["ratio"] for rows in runs]
        per_save.append({"save": k + 1, "ratio_median": statistics.median(ratios), "ratios": ratios,
                         "save_median_s": statistics.median(rows[k]["save_s"] for rows in runs),
                         "raw_median_s": statistics.median(rows[k]["raw_s"] for rows in runs)})
        print(f"save {k + 1}{' (the first)' if k == 0 else ''}: median over {a.runs} runs: save "
              f"{per_save[-1]['save_median_s']:.2f} s, raw {per_save[-1]['raw_median_s']:.2f} s, ratio "
              f"{per_save[-1]['ratio_median']:.3f} (each run: {', '.join(f'{r:.3f}' for r in ratios)})")
    met = all(p["ratio_median"] >= TARGET for p in per_save)
    print(f"every save >= {TARGET} of the raw direct write (medians): {'met' if met else 'MISSED'}; "
          f"{os.cpu_count()} CPUs, {nbytes / 1e9:.2f} GB a checkpoint")
    if a.json:
        a.json.write_text(json.dumps({"size": a.size, "runs": runs, "per_save": per_save, "target": TARGET,
                                      "every_save_met": met, "bytes": nbytes, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
