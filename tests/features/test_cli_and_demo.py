"""`hf-unified-ckpt info/verify` on every kind of folder, the console script, and the `make demo` script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT
from support.trainers import train
from hf_unified_ckpt.tools.cli import main as cli



def _info(path, capsys):
    capsys.readouterr()  # drop what training printed
    assert cli(["info", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_on_each_kind(tmp_path, capsys):
    train(tmp_path / "u", max_steps=3, save_steps=3)
    train(tmp_path / "legacy", max_steps=3, save_steps=3, attach=False)
    info = _info(tmp_path / "u" / "checkpoint-3", capsys)
    assert (info["kind"], info["complete"], info["global_step"]) == ("unified", True, 3)
    assert info["components"]["model"]["tensors"] == 21 and info["components"]["optimizer"]["tensors"] == 63
    assert info["saved_by"]["engine"] == "single" and info["saved_by"]["world_size"] == 1
    assert info["total_bytes"] > info["components"]["model"]["bytes"] + info["components"]["optimizer"]["bytes"]
    legacy = _info(tmp_path / "legacy" / "checkpoint-3", capsys)
    assert (legacy["kind"], legacy["complete"], legacy["global_step"]) == ("hf-trainer", True, 3)
    (tmp_path / "u" / "checkpoint-3" / "unified_checkpoint.json").unlink()
    incomplete = _info(tmp_path / "u" / "checkpoint-3", capsys)
    assert (incomplete["kind"], incomplete["complete"]) == ("unified-incomplete", False)
    assert "interrupted" in incomplete["reason"]
    (tmp_path / "empty").mkdir()
    assert _info(tmp_path / "empty", capsys)["kind"] == "unknown"
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "u" / "checkpoint-3")]) == 1
    assert "not a complete unified checkpoint" in capsys.readouterr().err
    # a legacy folder is named as one, with what to do; a path that does not exist is an error, not "unknown"
    assert cli(["verify", str(tmp_path / "legacy" / "checkpoint-3")]) == 1
    assert "(kind hf-trainer): a complete legacy hf-trainer checkpoint" in capsys.readouterr().err
    assert cli(["info", str(tmp_path / "nothing")]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nothing'}: no such folder")
    # a flag without the one it refines: one line saying what to do, status 1, no traceback
    assert cli(["export", str(tmp_path / "u" / "checkpoint-3"), str(tmp_path / "x"), "--base-model", "b"]) == 1
    assert capsys.readouterr().err.startswith("error: --base-model is only used with --merge-lora")
    assert not (tmp_path / "x").exists()


def test_console_script_and_module_entry_points(tmp_path):
    train(tmp_path, max_steps=3, save_steps=3)
    exe = Path(sys.executable).with_name("hf-unified-ckpt")
    assert exe.exists(), "console script not installed (pip install -e .)"
    out = subprocess.run([str(exe), "info", "--json", str(tmp_path / "checkpoint-3")], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out)["kind"] == "unified"
    proc = subprocess.run([sys.executable, "-m", "hf_unified_ckpt", "verify", str(tmp_path / "checkpoint-3")],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("OK")


@pytest.mark.dist
def test_make_demo_script(tmp_path):
    """What `make demo` runs: ZeRO-2 x 2 train, resume on 1 process, loss curve continues, from_pretrained works."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss curve after resume continues exactly" in proc.stdout
    assert "generated:" in proc.stdout
    for ckpt in ("zero2_2proc/checkpoint-10", "resumed_1proc/checkpoint-30"):
        out = subprocess.run([sys.executable, "-m", "hf_unified_ckpt", "info", "--json", str(tmp_path / "demo" / ckpt)],
                             capture_output=True, text=True, check=True).stdout
        info = json.loads(out)
        assert info["kind"] == "unified" and info["complete"] is True
    assert json.loads(subprocess.run([sys.executable, "-m", "hf_unified_ckpt", "info", "--json",
                                      str(tmp_path / "demo" / "zero2_2proc" / "checkpoint-10")], capture_output=True,
                                     text=True).stdout)["saved_by"]["world_size"] == 2
    _assert_loss_chart(tmp_path / "demo" / "loss_curves.png", proc.stdout)


def _assert_loss_chart(png: Path, stdout: str) -> None:
    """The demo drew its two loss curves into a real PNG and said where (progress line and final summary)."""
    from matplotlib.image import imread  # a dev dependency; the demo itself needs it

    assert png.is_file() and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(png).shape[:2]
    assert height > 100 and width > 100
    assert stdout.count(str(png)) >= 2, stdout[-2000:]
