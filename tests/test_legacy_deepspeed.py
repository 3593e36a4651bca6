"""Real DeepSpeed (ZeRO-2, one process, CPU): a legacy `global_step*` folder is recognised, and what this
version cannot load yet is refused loudly instead of the plain Trainer's silent partial resume."""

import json
import os
import subprocess
import sys

import pytest

from _runs import train
from hf_unified_ckpt.cli import main as cli
from hf_unified_ckpt.errors import UnsupportedCheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))


def _ds(out, mode):
    return subprocess.run([sys.executable, os.path.join(HERE, "ds_worker.py"), str(out), mode], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def legacy_ds(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    proc = _ds(out, "legacy")
    assert proc.returncode == 0 and "DS-RUN-DONE" in proc.stdout, proc.stderr[-4000:]
    return out


def test_legacy_deepspeed_folder_is_detected(legacy_ds, capsys):
    assert (legacy_ds / "checkpoint-2" / "global_step2").is_dir()
    assert cli(["info", "--json", str(legacy_ds / "checkpoint-2")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["complete"], info["global_step"]) == ("deepspeed", True, 2)
    assert cli(["verify", str(legacy_ds / "checkpoint-2")]) == 1


@pytest.mark.parametrize("how", ["path", "resume=True"])
def test_legacy_deepspeed_folder_without_deepspeed_is_refused_loudly(legacy_ds, tmp_path, how):
    resume = str(legacy_ds / "checkpoint-2") if how == "path" else True
    out = tmp_path if how == "path" else legacy_ds
    with pytest.raises(UnsupportedCheckpointError, match="legacy deepspeed checkpoint.*silently"):
        train(out, max_steps=4, resume=resume)
