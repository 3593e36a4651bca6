import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def torchrun(nproc: int, runs: list[dict], workdir: Path, timeout: int = 900, expect_failure: bool = False):
    """Launch `nproc` real processes (gloo, CPU) running `runs` in one launch; fail with their output.
    With `expect_failure`, return the completed process of a launch that must fail."""
    spec = workdir / f"spec-{nproc}-{len(list(workdir.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TESTS / "dist_worker.py"), str(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_failure:
        assert proc.returncode != 0, "the launch was expected to fail"
        return proc
    if proc.returncode != 0:
        pytest.fail(f"torchrun -n {nproc} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture
def quiet_env(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


_FAULTS: dict[str, bool] = {}


def record_fault(name: str, survived: bool) -> None:
    """Fault-injection tests report here; the run ends with a summary line of faults tried and survived."""
    _FAULTS[name] = survived


def pytest_terminal_summary(terminalreporter):
    if _FAULTS:
        survived = sum(_FAULTS.values())
        terminalreporter.write_line(f"fault injection: {len(_FAULTS)} faults tried, {survived} survived"
                                    + ("" if survived == len(_FAULTS) else
                                       f" (not survived: {sorted(k for k, v in _FAULTS.items() if not v)})"))
