import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def torchrun(nproc: int, runs: list[dict], workdir: Path, timeout: int = 900) -> None:
    """Launch `nproc` real processes (gloo, CPU) running `runs` in one launch; fail with their output."""
    spec = workdir / f"spec-{nproc}-{len(list(workdir.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TESTS / "dist_worker.py"), str(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun -n {nproc} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}")


@pytest.fixture
def quiet_env(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
