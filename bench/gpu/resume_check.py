"""Resume equivalence on a device (issue 34, part 2.1): the test suite's runs, on the GPU at world size 1, and across
devices (a checkpoint written on the GPU resumed by CPU processes at world size 2, and back).

    python bench/gpu/resume_check.py --device cuda|cpu --json FILE [--cells single,zero2,zero3,fsdp2,cross]

Each cell is an uninterrupted run of 6 steps (a unified save every 3) against a run resumed from its step 3, both
launched with torchrun through `tests/dist_worker.py` (the suite's worker, `tests/_runs.run_spec`), so the runs are
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


def _launch(work: Path, runs: list[dict], nproc: int, name: str) -> tuple[bool, str]:
    spec = work / f"spec-{name}.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TESTS / "dist_worker.py"), str(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _compare(resumed: Path, baseline: Path, exact: bool) -> dict:
    import torch

    a, b = torch.load(resumed, weights_only=False), torch.load(baseline, weights_only=False)
    steps = [s for s in b["losses"] if s > 3]
    loss = max(abs(a["losses"][s] - b["losses"][s]) / max(abs(b["losses"][s]), 1e-12) for s in steps)
    weight = max(float((a["state"][k].double() - v.double()).abs().max()) for k, v in b["state"].items())
    same = loss == 0 and weight == 0
    return {"steps_compared": steps, "max_loss_rel_diff": loss, "max_weight_abs_diff": weight, "bit_exact": same,
            "tolerance": "bit-exact" if exact else f"{CROSS_TOL} rel loss, {CROSS_TOL} abs weight",
            "ok": same if exact else (loss <= CROSS_TOL and weight <= CROSS_TOL)}


def run_cell(cell: str, device: str, work: Path) -> dict:
    """One cell (see the module docstring): its comparisons, or why it failed."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if cell != "cross":
        runs = [_spec(work, cell, device, "base"), _spec(work, cell, device, "resumed", str(work / "base/checkpoint-3"))]
        ok, tail = _launch(work, runs, 1, cell)
        out = {"launch_ok": ok} if ok else {"launch_ok": False, "output_tail": tail}
        if ok:
            out["same_device_ws1"] = _compare(work / "resumed.pt", work / "base.pt", exact=True)
    else:  # the device at world size 1 <-> CPU processes at world size 2 (DDP, gloo), both ways
        out = {}
        steps = [("dev", [_spec(work, "single", device, "dev")], 1),
                 ("cpu", [_spec(work, "single", "cpu", "cpu")], 2),
                 ("dev-to-cpu", [_spec(work, "single", "cpu", "dev-to-cpu", str(work / "dev/checkpoint-3"))], 2),
                 ("cpu-to-dev", [_spec(work, "single", device, "cpu-to-dev", str(work / "cpu/checkpoint-3"))], 1)]
        for name, runs, nproc in steps:
            ok, tail = _launch(work, runs, nproc, name)
            out[f"{name}_launch_ok"] = ok
            if not ok:
                out[f"{name}_output_tail"] = tail
                break
        else:
            # other world size (and device): another reduction order, so a stated tolerance, not bit-exactness
            out["device_ws1_to_cpu_ws2"] = _compare(work / "dev-to-cpu.pt", work / "dev.pt", exact=False)
            out["cpu_ws2_to_device_ws1"] = _compare(work / "cpu-to-dev.pt", work / "cpu.pt", exact=False)
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["ok"] = all(v.get("ok", True) for v in out.values() if isinstance(v, dict)) and all(
        v for k, v in out.items() if k.endswith("launch_ok"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_uc_gpu_resume"))
    parser.add_argument("--json", type=Path, required=True)
    a = parser.parse_args()
    results = {"device": a.device, "cells": {}}
    for cell in a.cells.split(","):
        results["cells"][cell] = run_cell(cell, a.device, a.work / cell)
        a.json.write_text(json.dumps(results, indent=1))  # after every cell: a cut-off run keeps what it measured
        print(f"{cell}: {'ok' if results['cells'][cell]['ok'] else 'FAILED'}", flush=True)
    sys.exit(0 if all(c["ok"] for c in results["cells"].values()) else 1)


if __name__ == "__main__":
    main()
