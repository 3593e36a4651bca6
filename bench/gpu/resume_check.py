"""Resume equivalence on a device (issue 34, part 2.1): the test suite's runs, on the GPU at world size 1, and across
devices (a checkpoint written on the GPU resumed by CPU processes at world size 2, and back).

    python bench/gpu/resume_check.py --device cuda|cpu --json FILE [--cells single,zero2,zero3,fsdp2,cross]

Each cell is an uninterrupted run of 6 steps (a unified save every 3) against a run resumed from its step 3, both
launched with torchrun through `tests/support/workers/dist_worker.py` (the suite's worker, `support.specs.run_spec`), so the runs are
the suite's own: the tiny Llama, AdamW, a linear schedule. On `--device cuda` the runs train on the GPU
(`use_cpu=False`, DeepSpeed in bf16, FSDP2 as accelerate applies it there); on `--device cpu` the same cells run on
the CPU (FSDP2 through the suite's CPU shim), which is the dry run the test suite keeps alive. A cell records the
largest loss and weight differences and whether they are zero; it passes when they are within its stated tolerance
(zero at the same device and world size; across devices 1e-4 relative on losses, 1e-4 absolute on weights, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
CELLS = ("single", "zero2", "zero3", "fsdp2", "cross")
CROSS_TOL = 1e-4


def _kind(engine: str, device: str) -> dict:
    on_gpu = device == "cuda"
    spec: dict = {"overrides": {"use_cpu": not on_gpu}}
    if engine in ("zero2", "zero3"):
        spec["zero"] = int(engine[-1])
        if on_gpu:
            spec["overrides"]["bf16"] = True
    if engine == "fsdp2":
        spec.update(fsdp=2, fsdp_shim=not on_gpu)
    return spec


def _spec(work: Path, engine: str, device: str, tag: str, resume: str | None = None) -> dict:
    spec = _kind(engine, device)
    spec.update(output_dir=str(work / tag), result=str(work / f"{tag}.pt"))
    spec["overrides"].update(max_steps=6, save_steps=3)
    if resume:
        spec["resume"] = resume
    return spec


def _launch(work: Path, runs: list[dict], nproc: int, name: str, device: str) -> subprocess.Popen:
    """Start one torchrun launch of `runs` (the suite's worker), its output in work/<name>.log."""
    spec = work / f"spec-{name}.json"
    # on a GPU: deterministic kernels (embedding backward and friends use atomics otherwise), so that a resume at the
    # same device and world size can be compared bit for bit
    spec.write_text(json.dumps({"runs": runs, "deterministic": device == "cuda"}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TESTS / "support" / "workers" / "dist_worker.py"), str(spec)]
    with open(work / f"{name}.log", "w") as log:  # the launch keeps its own copy of the handle
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(work: Path, launches: dict[str, subprocess.Popen]) -> dict:
    """Wait for the launches; {name: True, or the end of its log}."""
    out = {}
    for name, proc in launches.items():
        ok = proc.wait(timeout=900) == 0
        out[name] = True if ok else (work / f"{name}.log").read_text()[-3000:]
    return out


def _compare(resumed: Path, baseline: Path, exact: bool) -> dict:
    import torch

    if not (resumed.exists() and baseline.exists()):  # its launch failed before or during these runs
        return {"ok": False, "missing": [str(p.name) for p in (resumed, baseline) if not p.exists()]}
    a, b = (torch.load(p, weights_only=False, map_location="cpu") for p in (resumed, baseline))
    steps = [s for s in b["losses"] if s > 3]
    loss = max(abs(a["losses"][s] - b["losses"][s]) / max(abs(b["losses"][s]), 1e-12) for s in steps)
    weight = max(float((a["state"][k].double() - v.double()).abs().max()) for k, v in b["state"].items())
    same = loss == 0 and weight == 0
    return {"steps_compared": steps, "max_loss_rel_diff": loss, "max_weight_abs_diff": weight, "bit_exact": same,
            "tolerance": "bit-exact" if exact else f"{CROSS_TOL} rel loss, {CROSS_TOL} abs weight",
            "ok": same if exact else (loss <= CROSS_TOL and weight <= CROSS_TOL)}


def _pair(work: Path, cell: str, device: str) -> list[dict]:
    """The uninterrupted run of `cell` and the run resumed from its step 3."""
    return [_spec(work, cell, device, f"{cell}-base"),
            _spec(work, cell, device, f"{cell}-resumed", str(work / f"{cell}-base/checkpoint-3"))]


def run_cells(cells: list[str], device: str, work: Path) -> dict:
    """Every cell (see the module docstring) in at most four launches: the device runs at world size 1 without and
    with DeepSpeed side by side (a crash in one leaves the other's results), then the CPU processes at world size 2,
    then the device run resumed from them. A cell is judged from the result files its runs left."""
    shutil.rmtree(work, ignore_errors=True)  # no result file of an earlier run may stand in for a missing one
    work.mkdir(parents=True)
    started = time.perf_counter()
    plain = [c for c in cells if c in ("single", "fsdp2")] or (["single"] if "cross" in cells else [])
    deep = [c for c in cells if c in ("zero2", "zero3")]
    first = {"device_plain": [r for c in plain for r in _pair(work, c, device)],
             "device_deepspeed": [r for c in deep for r in _pair(work, c, device)]}
    launches = _wait(work, {n: _launch(work, runs, 1, n, device) for n, runs in first.items() if runs})
    if "cross" in cells:  # the device at world size 1 <-> CPU processes at world size 2 (DDP, gloo), both ways
        cpu = [_spec(work, "single", "cpu", "cpu"),
               _spec(work, "single", "cpu", "dev-to-cpu", str(work / "single-base/checkpoint-3"))]
        launches.update(_wait(work, {"cpu_ws2": _launch(work, cpu, 2, "cpu_ws2", device)}))
        back = [_spec(work, "single", device, "cpu-to-dev", str(work / "cpu/checkpoint-3"))]
        launches.update(_wait(work, {"cpu_to_device": _launch(work, back, 1, "cpu_to_device", device)}))
    out: dict = {"launches": {n: v is True for n, v in launches.items()},
                 "launch_failures": {n: v for n, v in launches.items() if v is not True}, "cells": {}}
    for cell in cells:
        if cell == "cross":  # another world size (and device): another reduction order, so a stated tolerance
            out["cells"][cell] = {
                "device_ws1_to_cpu_ws2": _compare(work / "dev-to-cpu.pt", work / "single-base.pt", exact=False),
                "cpu_ws2_to_device_ws1": _compare(work / "cpu-to-dev.pt", work / "cpu.pt", exact=False)}
        else:
            out["cells"][cell] = {"same_device_ws1": _compare(work / f"{cell}-resumed.pt", work / f"{cell}-base.pt",
                                                              exact=True)}
        out["cells"][cell]["ok"] = all(v["ok"] for v in out["cells"][cell].values())
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_uc_gpu_resume"))
    parser.add_argument("--json", type=Path, required=True)
    a = parser.parse_args()
    results = {"device": a.device, **run_cells(a.cells.split(","), a.device, a.work)}
    a.json.write_text(json.dumps(results, indent=1))
    for cell, record in results["cells"].items():
        print(f"{cell}: {'ok' if record['ok'] else 'FAILED'}", flush=True)
    sys.exit(0 if all(c["ok"] for c in results["cells"].values()) else 1)

if __name__ == "__main__":
    main()
