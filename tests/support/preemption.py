"""Jobs launched with `workers/preempt_worker.py` (docs/crash-safety.md): a spec of named runs (`run`) launched under
torchrun (`launch`), waited for (`finish`), and the statuses its workers ended with (`exit_codes`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .env import THREADS
from .paths import WORKERS

MAX_STEPS, SAVE_STEPS = 8, 3


def launch(name: str, runs: list[dict], workdir: Path, nproc: int = 2) -> subprocess.Popen:
    spec = workdir / f"{name}.json"
    spec.write_text(json.dumps({"name": name, "runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKERS / "preempt_worker.py"), str(spec)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, ok: bool = True, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    if ok and proc.returncode != 0:
        pytest.fail(f"launch failed ({proc.returncode}):\n{out[-12000:]}")
    return out


def run(tmp: Path, tag: str, **fields) -> dict:
    return {"output_dir": str(tmp / tag), "result": str(tmp / f"{tag}.pt"),
            "overrides": {"max_steps": MAX_STEPS, "save_steps": SAVE_STEPS, **fields.pop("overrides", {})}, **fields}


def exit_codes(workdir: Path, name: str) -> list[int | None]:
    """The statuses the workers' `TrainingPreempted` ended them with (they record it on the way out)."""
    files = [workdir / f"exit-{name}-{r}" for r in range(2)]
    return [int(f.read_text()) if f.is_file() else None for f in files]
