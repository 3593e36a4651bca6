"""Everything issue 34's part 2 measures on a GPU, in three parts of at most 10 minutes each (`run_all.sh` runs one).

    python bench/gpu/run_all.py --part 1|2|3|all [--device cuda|cpu] [--dry-run] [--out DIR]

Part 1, correctness (~5 min): the device path of background copies (`device_check.py`), resume equivalence at world
size 1 for one process, DeepSpeed ZeRO-2/3 bf16 and FSDP2, and across devices (`resume_check.py`), the demo.
Part 2, the figures (at most 10 min: the steps' limits add up to 600 s): the 100M save, then on the 1B model save
vs native, time blocked by async and flash saves vs a synchronous one, throughput with saves vs none, resume vs
native (`bench_gpu.py`).
Part 3, if device time is left (~5 min): blocked time and throughput on the 100M model.
Part "all", for a session lent 15 minutes of device time in all (one command): the device check, resume equivalence
(every cell, in four launches), the 1B blocked time (2 saves per mode), throughput (200 steps, an async save every
100, a flash save every 25), resume, save, then the 100M save, in that order, with a 570 s deadline that cuts the
tail; the CPU demo is left to the test suite.

Each step runs in a process of its own with its own time limit; a failed or cut-off step is recorded and the next
goes on. `gpu_part<N>.json` in `--out` ($OUT where the device tool sets it) is rewritten after every step, so a
command cut off at its limit still leaves what it measured. `--dry-run` runs every step on the CPU with a tiny model
and small sizes (the test suite does, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def steps(part: str, device: str, dry: bool, out: Path) -> list[tuple[str, list[str], int, dict]]:
    """(name, command, time limit in seconds, extra environment) of each step of `part`; each command writes
    `out/<name>.json`."""
    py = sys.executable
    bench = [py, str(HERE / "bench_gpu.py"), "--device", device]
    small = ["--size", "tiny", "--steps", "10", "--saves", "1", "--batch", "2", "--seq", "32"] if dry else []
    json_of = lambda name: ["--json", str(out / f"{name}.json")]  # noqa: E731
    def checks(device_limit: int, resume_limit: int, dry_cells: str) -> list:
        """The device copy check and the resume-equivalence cells (in a dry run: `dry_cells` only)."""
        return [("device_check", [py, str(HERE / "device_check.py"), "--device", device, "--mb", "8" if dry else "1024",
                                  *json_of("device_check")], device_limit, {}),
                ("resume_check", [py, str(HERE / "resume_check.py"), "--device", device,
                                  *(["--cells", dry_cells] if dry else []), *json_of("resume_check")],
                 resume_limit, {})]

    if part == "1":
        demo = ([py, "-c", "print('dry run: the demo runs in tests/features/test_cli_and_demo.py')"] if dry
                else [py, str(ROOT / "examples" / "demo.py")])
        return [*checks(120, 360, "single"),
                # the README's demo is the CPU one (2 processes, gloo): DeepSpeed is told so on a GPU machine
                ("demo", demo, 240, {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})]
    if part == "2":  # the 100M save first (seconds): with the 1B one, how the save time grows
        limits = {"save": 120, "blocked": 150, "throughput": 180, "resume": 90}
        return [("bench_100m_save", [*bench, "--size", "100m", *small, "--only", "save", *json_of("bench_100m_save")],
                 60, {})] + [(f"bench_1b_{m}", [*bench, "--size", "1b", *small, "--only", m, *json_of(f"bench_1b_{m}")],
                              limit, {}) for m, limit in limits.items()]
    if part == "all":  # one command for a 15-minute device budget, most telling first; the deadline cuts the tail
        def one(size: str, m: str, limit: int, *extra: str):
            sized = small if dry else [*extra] or ["--saves", "2", "--steps", "40"]
            return (f"bench_{size}_{m}", [*bench, "--size", size, *sized, "--only", m, *json_of(f"bench_{size}_{m}")],
                    limit, {})

        # the dry run leaves out what repeats the same code at the same tiny size (ZeRO-3's cell, the 100M save)
        # the figures not yet measured on a GPU first (flash's, on the H100 of 2026-11-26 cut off at 130 and 170 s);
        # the saves (measured on an H200 and an H100) last
        return [*checks(60, 150, "single,zero2,fsdp2,cross"), one("1b", "blocked", 160),
                # a save every 100 steps (~18 s of training on an H200) outlasts its write; every 20 cannot (2026-11-26)
                one("1b", "throughput", 200, "--steps", "200", "--async-every", "100", "--flash-every", "25"),
                one("1b", "resume", 80), one("1b", "save", 100), *([] if dry else [one("100m", "save", 45)])]
    if part == "49":  # issue 49: the speed figures, one command; each step deletes its files before the next
        tiny = ["--steps", "12", "--async-every", "6", "--flash-every", "3", "--lag-at", "2", "--lag-steps", "4"]
        def one(size: str, m: str, limit: int, *extra: str):
            return (f"bench_{size}_{m}", [*bench, "--size", size, *(small if dry else []), *extra,
                                          *(tiny if dry and m in ("throughput", "lag") else []),
                                          "--only", m, *json_of(f"bench_{size}_{m}")], limit, {})

        return [one("1b", "save", 80, "--versus", "raw"),
                one("1b", "blocked", 120, "--blocked-modes", "async,flash", "--saves", "2"),
                one("1b", "throughput", 200, *([] if dry else ["--steps", "200"]), "--async-every", "6" if dry else
                    "100", "--flash-every", "3" if dry else "25"),
                one("1b", "restart", 90), one("1b", "lag", 80, *([] if dry else ["--lag-steps", "60"])),
                one("100m", "save", 45, "--versus", "raw")]
    if part == "3":
        return [(f"bench_100m_{m}", [*bench, "--size", "100m", *small, "--only", m, *json_of(f"bench_100m_{m}")], 200,
                 {}) for m in ("blocked", "throughput")]
    raise ValueError(f"no part {part!r}: parts are 1, 2, 3, all and 49")


def derived_49(steps: dict) -> dict:
    """The issue-49 ratios that take two steps' figures: the durability lag / a synchronous save, and the seconds per
    GB of the 1B save / of the 100M one (how the save grows)."""
    def figures(step: str, name: str) -> dict:
        return steps.get(step, {}).get("result", {}).get("measurements", {}).get(name, {})

    save, small, lag = figures("bench_1b_save", "save"), figures("bench_100m_save", "save"), figures("bench_1b_lag", "lag")
    out = {}
    for mode in ("async", "flash"):
        if f"{mode}_lag_s" in lag and "ours_s" in save:
            out[f"{mode}_lag_over_sync_save"] = lag[f"{mode}_lag_s"] / save["ours_s"]
    if "s_per_gb" in save and "s_per_gb" in small:
        out["s_per_gb_1b_over_100m"] = save["s_per_gb"] / small["s_per_gb"]
    return out


def run_step(name: str, cmd: list[str], limit: int, env: dict, out: Path) -> dict:
    started = time.perf_counter()
    environment = {**os.environ, "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p), **env}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own group: a cut-off step's launches go too
    try:
        output, _ = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc = f"cut off after {limit} s"
    record = {"command": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - started, 1)}
    result = out / f"{name}.json"
    if result.exists():
        record["result"] = json.loads(result.read_text())
    if rc != 0:
        record["output_tail"] = output[-3000:]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=("1", "2", "3", "all", "49"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--deadline", type=int, default=570,
                        help="seconds for the whole part: a step gets at most what is left (the device's command "
                             "limit is 600 s)")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu"))
    a = parser.parse_args()
    device = "cpu" if a.dry_run else a.device
    a.out.mkdir(parents=True, exist_ok=True)
    summary = a.out / f"gpu_part{a.part}.json"
    report: dict = {"part": a.part, "device": device, "dry_run": a.dry_run, "python": platform.python_version(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": {}}
    try:
        import torch

        report["torch"] = torch.__version__
        report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        import transformers

        report["transformers"] = transformers.__version__
    except Exception as e:  # recorded; the steps say what fails
        report["import_error"] = f"{type(e).__name__}: {e}"
    deadline = time.perf_counter() + a.deadline
    for name, cmd, limit, env in steps(a.part, device, a.dry_run, a.out):
        left = int(deadline - time.perf_counter())
        if left < 10:
            report["steps"][name] = {"rc": f"not run: the {a.deadline} s deadline was reached", "seconds": 0}
            continue
        print(f"== {name}", flush=True)
        report["steps"][name] = run_step(name, cmd, min(limit, left), env, a.out)
        summary.write_text(json.dumps(report, indent=1))
        step = report["steps"][name]
        print(f"   rc {step['rc']} in {step['seconds']} s", flush=True)
    if a.part == "49":
        report["derived"] = derived_49(report["steps"])
        summary.write_text(json.dumps(report, indent=1))
        print("derived", json.dumps(report["derived"]), flush=True)
    failed = [n for n, s in report["steps"].items() if s["rc"] != 0]
    print(f"part {a.part}: {len(report['steps']) - len(failed)} of {len(report['steps'])} steps ok"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; {summary}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
