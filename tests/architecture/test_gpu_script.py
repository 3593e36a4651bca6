"""The GPU script of issue 34 (`bench/gpu/run_all.sh`), rehearsed on the CPU so that it cannot rot before a GPU
machine runs it: the one-command part ("all") as `--dry-run` end to end (tiny model, every step; marker `slow`, kept
out of `make test` for its 70-90 s: run `make test-slow` before a GPU is used), the other parts' steps as commands, and the step runner's promises (a failed or cut-off step is recorded, the next goes on, the JSON is
rewritten after every step) with real processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import run_all  # noqa: E402

def _part(part: str, out: Path) -> dict:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run_all.sh"), part, "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / f"gpu_part{part}.json").read_text())


@pytest.mark.slow  # 70-90 s: `make test-slow` (or this test alone) before a GPU machine runs the script
@pytest.mark.dist  # resume_check launches torchrun
def test_the_one_command_part_dry_run_checks_copies_resumes_and_measures_every_figure(tmp_path):
    report = _part("all", tmp_path)
    assert report["device"] == "cpu" and list(report["steps"]) == [
        "device_check", "resume_check", "bench_1b_blocked", "bench_1b_throughput", "bench_1b_resume", "bench_1b_save"]
    check = report["steps"]["device_check"]["result"]
    assert check["float32_copy_equal"] and check["bfloat16_copy_equal"] and not check["float32_buffer_pinned"]
    resumes = report["steps"]["resume_check"]["result"]
    assert all(resumes["launches"].values()) and set(resumes["cells"]) == {"single", "zero2", "fsdp2", "cross"}
    for cell in ("single", "zero2", "fsdp2"):
        same = resumes["cells"][cell]["same_device_ws1"]
        assert same["bit_exact"] and same["steps_compared"] == [4, 5, 6], (cell, same)
    assert all(c["ok"] for c in resumes["cells"]["cross"].values() if isinstance(c, dict))
    for step, record in report["steps"].items():
        if step.startswith("bench_"):
            figures = record["result"]["measurements"][step.rsplit("_", 1)[1]]
            assert "error" not in figures and "partial" not in figures and figures["seconds"] > 0, figures
    save = report["steps"]["bench_1b_save"]["result"]["measurements"]["save"]
    assert save["ours_s"] > 0 and save["native_then_fsync_s"] >= save["native_s"]
    throughput = report["steps"]["bench_1b_throughput"]["result"]["measurements"]["throughput"]
    assert {"async_ratio", "flash_ratio", "async_ratio_to_last_step", "flash_ratio_to_last_step"} <= set(throughput)


def test_a_missing_result_file_fails_its_cell_not_the_check(tmp_path):
    import resume_check

    judged = resume_check._compare(tmp_path / "resumed.pt", tmp_path / "base.pt", exact=True)
    assert judged == {"ok": False, "missing": ["resumed.pt", "base.pt"]}


def test_parts_1_2_and_all_list_their_steps(tmp_path):
    every = run_all.steps("all", "cuda", False, tmp_path)
    assert [name for name, *_ in every] == ["device_check", "resume_check", "bench_1b_blocked", "bench_1b_throughput",
                                           "bench_1b_resume", "bench_1b_save", "bench_100m_save"]
    assert "--cells" not in every[1][1]  # every cell on the GPU
    one = run_all.steps("1", "cuda", False, tmp_path)
    assert [name for name, *_ in one] == ["device_check", "resume_check", "demo"]
    two = run_all.steps("2", "cuda", False, tmp_path)
    assert [name for name, *_ in two] == ["bench_100m_save", "bench_1b_save", "bench_1b_blocked",
                                         "bench_1b_throughput", "bench_1b_resume"]
    assert sum(limit for _, _, limit, _ in two) <= 600  # one device command


def test_part_3_runs_the_other_measurements_on_the_100m_model(tmp_path):
    names = [cmd[cmd.index("--only") + 1] for _, cmd, _, _ in run_all.steps("3", "cuda", False, tmp_path)]
    sizes = {cmd[cmd.index("--size") + 1] for _, cmd, _, _ in run_all.steps("3", "cuda", False, tmp_path)}
    assert names == ["blocked", "throughput"] and sizes == {"100m"}


def test_a_failed_or_cut_off_step_is_recorded_and_the_next_goes_on(tmp_path, monkeypatch):
    py = sys.executable
    plan = [("fails", [py, "-c", "import sys; print('broken'); sys.exit(3)"], 60, {}),
            ("hangs", [py, "-c", "import time; time.sleep(60)"], 1, {}),
            ("works", [py, "-c", f"open({str(tmp_path / 'works.json')!r}, 'w').write('{{\"x\": 1}}')"], 60, {})]
    monkeypatch.setattr(run_all, "steps", lambda part, device, dry, out: plan)
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--part", "1", "--device", "cpu", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as ended:
        run_all.main()
    report = json.loads((tmp_path / "gpu_part1.json").read_text())["steps"]
    assert ended.value.code == 1
    assert report["fails"]["rc"] == 3 and "broken" in report["fails"]["output_tail"]
    assert report["hangs"]["rc"] == "cut off after 1 s" and report["hangs"]["seconds"] < 30
    assert report["works"]["rc"] == 0 and report["works"]["result"] == {"x": 1}


def test_part_49_measures_the_speed_figures_in_priority_order_within_one_command(tmp_path):
    """Issue 49's one command: the 1B save against a raw direct write of the same bytes, the blocked time of async
    and flash saves (first vs later), throughput (200 steps, async every 100, flash every 25), restart from memory
    vs disk, the durability lag, then the 100M save (growth); each step with its own limit."""
    plan = run_all.steps("49", "cuda", False, tmp_path)
    assert [name for name, *_ in plan] == ["bench_1b_save", "bench_1b_blocked", "bench_1b_throughput",
                                          "bench_1b_restart", "bench_1b_lag", "bench_100m_save"]
    throughput = plan[2][1]
    for flag, value in (("--steps", "200"), ("--async-every", "100"), ("--flash-every", "25")):
        assert throughput[throughput.index(flag) + 1] == value
    assert all(cmd[cmd.index("--versus") + 1] == "raw" for name, cmd, *_ in plan if name.endswith("_save"))
    derived = run_all.derived_49({
        "bench_1b_save": {"result": {"measurements": {"save": {"ours_s": 10.0, "s_per_gb": 1.0}}}},
        "bench_100m_save": {"result": {"measurements": {"save": {"s_per_gb": 0.5}}}},
        "bench_1b_lag": {"result": {"measurements": {"lag": {"async_lag_s": 15.0, "flash_lag_s": 30.0}}}}})
    assert derived == {"async_lag_over_sync_save": 1.5, "flash_lag_over_sync_save": 3.0, "s_per_gb_1b_over_100m": 2.0}


@pytest.mark.slow  # ~85 s: `make test-slow` before a GPU machine runs it
def test_part_49_dry_run_measures_every_figure(tmp_path):
    report = _part("49", tmp_path)
    figures = {step: record["result"]["measurements"] for step, record in report["steps"].items()}
    save = figures["bench_1b_save"]["save"]
    assert save["raw_direct"] and save["ratio_to_raw"] > 0 and save["bytes"] > 0
    blocked = figures["bench_1b_blocked"]["blocked"]
    assert {"async_first_over_later", "flash_first_over_later"} <= set(blocked)
    throughput = figures["bench_1b_throughput"]["throughput"]
    assert throughput["async_end_wait_over_raw"] > 0 and throughput["last_save_bytes"] > 0
    restart = figures["bench_1b_restart"]["restart"]
    assert restart["memory_to_first_step_s"] > 0 and restart["disk_to_first_step_s"] > 0
    assert {"async_lag_s", "flash_lag_s"} <= set(figures["bench_1b_lag"]["lag"])
    assert set(report["derived"]) == {"async_lag_over_sync_save", "flash_lag_over_sync_save", "s_per_gb_1b_over_100m"}
