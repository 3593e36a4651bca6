"""Preemption: a real signal (os.kill, or SIGTERM to torchrun, or kill -9 of a peer) sent to real DDP×2 (and
ZeRO-3×2) processes in each phase of a run. Each ends with every process gone, a complete checkpoint of the step
where the ranks agreed (none before the first step), and a resume — `resume_from_checkpoint="auto"` — equal to the
uninterrupted run bit for bit (same world size, same reduction order).

Launches (module fixtures, in order): `caught` runs the phases in one launch, `train()` raising TrainingPreempted
into the worker, which records it; `launcher_sigterm` signals torchrun from outside while DataLoader workers run;
`peer_crash` kills one worker with SIGKILL; `resumed` resumes those two and ends by a signal during a resume's load,
uncaught; `zero3` is the ZeRO-3 case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from support.preemption import MAX_STEPS, SAVE_STEPS, exit_codes, finish, launch, run
from support.states import assert_resumed_matches
from hf_unified_ckpt import detect_layout
from hf_unified_ckpt.checkpoint.folder.layout import UNIFIED

pytestmark = pytest.mark.dist

GRACE = 30.0  # torchrun's SIGTERM-to-SIGKILL wait, the default preemption_grace_period


def result(tmp: Path, tag: str) -> dict:
    return torch.load(tmp / f"{tag}.pt", weights_only=False)


def complete(folder) -> bool:
    layout = detect_layout(str(folder))
    return layout.kind == UNIFIED and layout.complete


def checkpoints(folder) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in Path(folder).glob("checkpoint-*") if p.is_dir())


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and int(path.read_text() or 0) >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step}:\n{proc.communicate()[0][-8000:]}")
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout} s")


def pids_of(workdir: Path, name: str) -> list[int]:
    return [int((workdir / f"pid-{name}-{r}").read_text()) for r in range(2)]


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


PHASES = {  # tag: (run fields, expected step (None: any from the first save), saved)
    "before_first_step": ({"phase": "before_first_step"}, 0, False),
    # one rank only, before step 4's optimizer step: the other learns it from the vote, at the end of that step
    "mid_step": ({"phase": "mid_step", "at": 4, "signal_ranks": [1]}, 4, True),
    # every rank, twice (SLURM + torchrun): the save of step 3 it interrupted is the one kept
    "sync_save": ({"phase": "sync_save", "signals": ["SIGTERM", "SIGTERM"]}, 3, True),
    "async_save": ({"phase": "async_save", "signal_ranks": [0],
                    "overrides": {"unified_checkpoint_config": "async_save"}}, None, True),
    # SIGUSR1 (SLURM's --signal) then SIGTERM, on rank 0 during the evaluation of step 4
    # the memory tier: the preemption save goes to durable storage, not to memory
    "flash": ({"phase": "mid_step", "at": 4, "signal_ranks": [1], "overrides": {"unified_checkpoint_config": "flash"}},
              4, True),
    "eval": ({"phase": "eval", "signals": ["SIGUSR1", "SIGTERM"], "signal_ranks": [0], "eval": True,
              "overrides": {"eval_strategy": "steps", "eval_steps": 4, "preemption_signals": "SIGTERM,SIGUSR1"}},
             4, True),
}


@pytest.fixture(scope="module")
def caught(tmp_path_factory):
    """Every phase in one launch, each preempted run then resumed with "auto"; the uninterrupted run first, and a
    run resumed from its last checkpoint (nothing left to train) signalled at its end."""
    tmp = tmp_path_factory.mktemp("preempt-caught")
    runs = [run(tmp, "reference")]
    for tag, (fields, _, _) in PHASES.items():
        runs.append(run(tmp, tag, **fields))
    runs.append(run(tmp, "reference", phase="after_training", resume="auto", result=str(tmp / "after_training.pt")))
    runs.append(run(tmp, "sparse_votes", phase="mid_step", at=33, signal_ranks=[1], vote_every=5,
                    overrides={"max_steps": 40, "save_steps": 100}))
    for tag, (fields, _, _) in PHASES.items():
        keep = {k: v for k, v in fields.items() if k in ("eval", "overrides")}
        runs.append(run(tmp, tag, resume="auto", result=str(tmp / f"{tag}-resumed.pt"), **keep))
    finish(launch("caught", runs, tmp))
    return tmp


@pytest.mark.parametrize("tag", list(PHASES))
def test_each_phase_saves_the_agreed_step_and_resumes_exactly(caught, tag):
    fields, step, saved = PHASES[tag]
    got = result(caught, tag)["preempted"]
    assert got, f"{tag}: train() returned instead of raising TrainingPreempted"
    signals = fields.get("signals", ["SIGTERM"])
    agreed = max(getattr(signal, s) for s in signals) if len(fields.get("signal_ranks", [0, 1])) > 1 else \
        getattr(signal, signals[0])
    assert got["code"] == 128 + agreed, got
    assert got["saved"] is saved, got
    if step is not None:
        assert got["step"] == step, got
    assert got["step"] >= (SAVE_STEPS if step is None else 0)
    folder, after = caught / tag, result(caught, tag)["checkpoints"]  # the folders the preempted run left
    if saved:
        assert got["checkpoint"] == str(folder / f"checkpoint-{got['step']}")
        assert complete(got["checkpoint"]), os.listdir(got["checkpoint"])
        assert max(after) == got["step"]  # nothing trained (or saved) after the agreed step
    else:
        assert after == [] and got["checkpoint"] is None and got["step"] == 0
    resumed, reference = result(caught, f"{tag}-resumed"), result(caught, "reference")
    assert resumed["global_step"] == MAX_STEPS
    assert_resumed_matches(resumed, reference, range(got["step"] + 1, MAX_STEPS + 1), exact=True, loss_rtol=0,
                           state_atol=0)
    for name, value in reference["optim"].items():
        assert torch.equal(resumed["optim"][name], value), name


def test_nothing_left_to_train_still_ends_the_run(caught):
    """Resumed from the final checkpoint and signalled at the end of `train()`: it raises, with the checkpoint of the
    step it stopped at. (transformers 5.23 itself trains one more step when it resumes a finished run: the step
    is the one its state reached, saved by the Trainer's final save.)"""
    ran = result(caught, "after_training")
    got = ran["preempted"]
    assert got["code"] == 128 + signal.SIGTERM and got["saved"] is True, got
    assert got["step"] == ran["global_step"] >= MAX_STEPS, got
    assert got["checkpoint"] == str(caught / "reference" / f"checkpoint-{got['step']}") and complete(got["checkpoint"])


def test_votes_every_few_steps_still_honour_the_signal_across_epoch_ends(caught):
    """Where votes would cost too much per step, the ranks vote every few (here 5, fixed): a signal in step 33 (the
    third epoch: each epoch's end adds a step boundary, not an optimizer step) is honoured at step 35."""
    got = result(caught, "sparse_votes")["preempted"]
    assert got["step"] == 35 and got["saved"] and complete(got["checkpoint"]), got


@pytest.mark.parametrize("tag", [*PHASES, "after_training", "reference", "sparse_votes"])
def test_nothing_of_the_plugin_outlives_train(caught, tag):
    """Deterministic check of the clean exit: after `train()` returns or raises, the plugin's gloo groups are
    destroyed (one kept past the interpreter's finalization is what aborted processes at exit), its threads have
    ended and the signal handlers are the ones found before."""
    left = result(caught, tag)["left"]
    assert left == {"plugin_groups": 0, "new_groups": 0, "threads": [], "handlers_restored": True}, left


def test_a_preempted_flash_run_leaves_nothing_in_memory(caught):
    """The memory tier's run ends with the preemption (its save went to durable storage): the persister freed the
    memory of both the preempted run and its resume, and exited."""
    from hf_unified_ckpt.flash.layout import run_folder

    run = run_folder("/dev/shm", str(caught / "flash"))
    assert not os.path.exists(run)
    out = subprocess.run(["pgrep", "-f", f"hf_unified_ckpt.flash.persister {run}"], capture_output=True, text=True)
    assert out.stdout.split() == []


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    """SIGTERM to the torchrun launcher mid-training (it forwards it to the workers' process groups, DataLoader
    workers included), then kill -9 of one worker of another run; both runs' checkpoints are then resumed, and a
    third resume is signalled during its load, uncaught: the processes end with 143 by themselves."""
    tmp = tmp_path_factory.mktemp("preempt-external")
    slow = {"max_steps": 16, "save_steps": 5, "dataloader_num_workers": 1}
    timings = {}
    proc = launch("launcher", [run(tmp, "launcher", exit=True, progress=str(tmp / "launcher.step"), slow_steps=0.3,
                                   vote_every=0, overrides=slow)], tmp)
    wait_for_step(tmp / "launcher.step", 3, proc)
    workers = pids_of(tmp, "launcher")
    loaders = [k for w in workers for k in children(w)]
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    timings["launcher_out"] = finish(proc, ok=False)
    timings["launcher_exit_s"] = time.monotonic() - sent
    timings["launcher_rc"] = proc.returncode
    timings["launcher_left"] = [p for p in workers + loaders if alive(p)]
    timings["loaders"] = loaders
    timings["launcher_checkpoints"] = checkpoints(tmp / "launcher")

    proc = launch("crash", [run(tmp, "crash", exit=True, progress=str(tmp / "crash.step"), slow_steps=0.3,
                                vote_every=0, overrides={**slow, "save_steps": 2})], tmp)
    wait_for_step(tmp / "crash.step", 5, proc)
    workers = pids_of(tmp, "crash")
    os.kill(workers[1], signal.SIGKILL)
    killed = time.monotonic()
    timings["crash_out"] = finish(proc, ok=False)
    timings["crash_exit_s"] = time.monotonic() - killed
    timings["crash_left"] = [p for p in workers if alive(p)]

    runs = [run(tmp, "reference", overrides=slow),
            run(tmp, "launcher", resume="auto", result=str(tmp / "launcher-resumed.pt"), overrides=slow),
            run(tmp, "crash", resume="auto", result=str(tmp / "crash-resumed.pt"), overrides=slow),
            run(tmp, "load", resume=str(tmp / "reference" / "checkpoint-5"), phase="resume_load", exit=True,
                overrides=slow)]
    proc = launch("resumed", runs, tmp)
    timings["resumed_out"] = finish(proc, ok=False)
    timings["resumed_rc"] = proc.returncode
    return tmp, timings


def preempted_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "Training preempted by" in line]


def test_sigterm_to_torchrun_saves_and_every_process_exits_within_the_grace(external):
    tmp, t = external
    assert t["launcher_rc"] != 0, "a preempted job must not look complete to its scheduler"
    assert t["launcher_exit_s"] < GRACE, t["launcher_exit_s"]
    assert t["loaders"], "the run had no DataLoader worker processes to signal"
    assert t["launcher_left"] == [], f"processes left running: {t['launcher_left']}"
    lines = preempted_lines(t["launcher_out"])
    assert len(lines) == 1, t["launcher_out"][-6000:]  # said once, by rank 0
    assert exit_codes(tmp, "launcher") == [143, 143]
    assert "terminate called" not in t["launcher_out"] and "DataLoader worker" not in t["launcher_out"]
    step = int(lines[0].split(" at step ")[1].split(" ")[0])
    assert 3 <= step < 16 and complete(tmp / "launcher" / f"checkpoint-{step}")
    assert max(t["launcher_checkpoints"]) == step
    resumed, reference = result(tmp, "launcher-resumed"), result(tmp, "reference")
    assert_resumed_matches(resumed, reference, range(step + 1, 17), exact=True, loss_rtol=0, state_atol=0)


def test_a_peer_killed_leaves_the_others_exiting_and_the_newest_complete_checkpoint_resumes(external):
    tmp, t = external
    assert t["crash_exit_s"] < GRACE, t["crash_exit_s"]
    assert t["crash_left"] == [], t["crash_left"]
    newest = max(s for s in checkpoints(tmp / "crash") if complete(tmp / "crash" / f"checkpoint-{s}"))
    assert newest >= 4
    resumed, reference = result(tmp, "crash-resumed"), result(tmp, "reference")
    assert_resumed_matches(resumed, reference, range(newest + 1, 17), exact=True, loss_rtol=0, state_atol=0)


def test_a_signal_during_the_resume_load_ends_the_run_before_its_first_step(external):
    tmp, t = external
    out = t["resumed_out"]
    lines = preempted_lines(out)
    assert len(lines) == 1 and "at step 5 (before the first step)" in lines[0], out[-6000:]
    assert exit_codes(tmp, "resumed") == [143, 143]
    assert "exitcode  : 143" in out and "exitcode  : -6" not in out, out[-4000:]  # torchrun's summary
    assert "terminate called" not in out
    assert checkpoints(tmp / "load") == []


def test_zero3_preempted_mid_step_resumes_exactly(tmp_path):
    runs = [run(tmp_path, "reference", zero=3), run(tmp_path, "mid", zero=3, phase="mid_step", at=4,
                                                     signal_ranks=[0]),
            run(tmp_path, "mid", zero=3, resume="auto", result=str(tmp_path / "mid-resumed.pt"))]
    finish(launch("zero3", runs, tmp_path))
    got = result(tmp_path, "mid")["preempted"]
    assert got["step"] == 4 and got["saved"] and complete(got["checkpoint"]), got
    resumed, reference = result(tmp_path, "mid-resumed"), result(tmp_path, "reference")
    assert_resumed_matches(resumed, reference, range(5, MAX_STEPS + 1), exact=True, loss_rtol=0, state_atol=0)
    for name, value in reference["optim"].items():
        assert torch.equal(resumed["optim"][name], value), name


def test_a_preemption_checkpoint_of_two_ranks_resumes_on_one_process(caught, tmp_path):
    """The checkpoint saved on preemption is an ordinary unified one: resumed at another world size (DDP × 2 → one
    process, the global batch kept), it follows the uninterrupted run within fp32 reduction-order differences."""
    from support.states import final_state
    from support.trainers import losses_of, make_trainer

    step = result(caught, "mid_step")["preempted"]["step"]
    trainer = make_trainer(tmp_path / "one", max_steps=MAX_STEPS, save_steps=SAVE_STEPS)
    trainer.train(resume_from_checkpoint=str(caught / "mid_step" / f"checkpoint-{step}"))
    resumed = {"losses": losses_of(trainer), "state": final_state(trainer)}
    assert_resumed_matches(resumed, result(caught, "reference"), range(step + 1, MAX_STEPS + 1), exact=False,
                           loss_rtol=1e-5, state_atol=1e-5)
