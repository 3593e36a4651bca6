"""One job per output_dir (issue 55, item 4): a lease taken by `train()` before its first step, staging folders of
each save's own, and (item 11) a save over a `checkpoint-N` that is a symbolic link.

The lease holders here are real processes (`lease_worker.py`); the second job is a real Trainer.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime

import pytest

from hf_unified_ckpt.checkpoint.folder.lease import Lease, lease_name
from hf_unified_ckpt.errors import OutputDirInUseError
from hf_unified_ckpt.options import LeaseOptions
from hf_unified_ckpt.store.node import Process, start_ticks
from support.paths import WORKERS

WORKER = str(WORKERS / "lease_worker.py")


def _holder(root, tmp_path, seconds=None) -> subprocess.Popen:
    """A process of its own holding the lease of `root` (for `seconds`, or until killed)."""
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, WORKER, "hold", str(root), str(ready),
                             *([str(seconds)] if seconds is not None else [])])
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the lease holder did not start"
        time.sleep(0.02)
    return proc


def _records(root) -> dict[str, dict]:
    return {n: json.loads((root / n).read_text()) for n in sorted(os.listdir(root)) if n.startswith("_hf_unified")}


def _write_lease(root, generation=1, **fields) -> None:
    os.makedirs(root, exist_ok=True)
    record = {"job": "another", **dataclasses.asdict(Process.this()), "renewed": time.time(), **fields}
    (root / lease_name(generation)).write_text(json.dumps(record))


class LeaseOwner:
    """A Trainer callback that notes, at each step, which process the newest lease record of the run names."""

    def __init__(self, root):
        from transformers import TrainerCallback

        self.root, self.seen = root, []
        outer = self

        class Note(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer.seen.append({n: r["pid"] for n, r in _records(outer.root).items()})

        self.callback = Note()


def test_a_second_job_is_refused_before_its_first_step_and_a_dead_ones_lease_is_taken_over(tmp_path):
    """A live process holds the lease: train() raises OutputDirInUseError before its first step, naming that
    process's host, pid and start time and the ways out, and writes nothing. Killed (its lease left behind, its pid
    dead), the next train() takes the lease over, holds it while it trains, and gives it back at the end."""
    from support.trainers import make_trainer

    out = tmp_path / "out"
    holder = _holder(out, tmp_path)
    try:
        before = sorted(os.listdir(out))
        trainer = make_trainer(out, max_steps=2, save_steps=1, unified_checkpoint_lease_wait=0.0)
        with pytest.raises(OutputDirInUseError) as refused:
            trainer.train()
        assert trainer.state.global_step == 0 and sorted(os.listdir(out)) == before, "something was written"
        started = datetime.fromtimestamp(Process.this().started or 0).isoformat(sep=" ", timespec="seconds")
        message = str(refused.value)
        held = _records(out)[lease_name(1)]
        assert f"host {held['host']}, pid {holder.pid}, started " in message, message
        assert datetime.fromtimestamp(held["started"]).isoformat(sep=" ", timespec="seconds") in message
        assert started and "another output_dir" in message and "unified_checkpoint_lease_wait" in message
        assert f"remove {out / lease_name(1)}" in message
    finally:
        holder.kill()
        holder.wait()
    owner = LeaseOwner(out)
    trainer = make_trainer(out, max_steps=2, save_steps=1, unified_checkpoint_lease_wait=0.0)
    trainer.add_callback(owner.callback)
    trainer.train()
    assert owner.seen == [{lease_name(2): os.getpid()}] * 2  # the dead holder's generation 1 removed
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2"]  # given back at the end


def test_a_live_pid_that_started_at_another_time_holds_no_lease(tmp_path):
    """Same machine, same pid, but the process now running under it started later than the one recorded (a reused
    pid): stale. With the recorded start time it is live and the lease is refused."""
    root = tmp_path / "out"
    ticks = start_ticks(os.getpid())
    _write_lease(root, job="reused", start_ticks=ticks + 1)
    assert Lease(str(root), "me", LeaseOptions(wait=0.0)).try_take() is None
    assert list(_records(root)) == [lease_name(2)] and _records(root)[lease_name(2)]["job"] == "me"
    _write_lease(root, generation=3, job="live", start_ticks=ticks)
    assert Lease(str(root), "other", LeaseOptions(wait=0.0)).try_take()["job"] == "live"


def test_a_lease_of_another_machine_is_stale_once_its_heartbeat_is_older_than_the_timeout(tmp_path):
    root = tmp_path / "out"
    _write_lease(root, host="elsewhere", pid=1, renewed=time.time() - 30)
    with pytest.raises(OutputDirInUseError, match="host elsewhere, pid 1"):
        Lease(str(root), "me", LeaseOptions(timeout=60.0, wait=0.0)).acquire()
    lease = Lease(str(root), "me", LeaseOptions(timeout=20.0, wait=0.0))
    lease.acquire()
    assert list(_records(root)) == [lease_name(2)]
    renewed = _records(root)[lease_name(2)]["renewed"]
    time.sleep(0.01)
    assert lease.renew() and _records(root)[lease_name(2)]["renewed"] > renewed
    lease.release()
    assert _records(root) == {}


def test_a_requeued_job_waits_for_its_predecessors_lease(tmp_path):
    """The predecessor gives its lease back 2 s after it took it: a job that waits 60 s gets the lease then; one that
    waits 0.3 s is refused."""
    root = tmp_path / "out"
    holder = _holder(root, tmp_path, seconds=2)
    try:
        with pytest.raises(OutputDirInUseError):
            Lease(str(root), "impatient", LeaseOptions(wait=0.3)).acquire()
        started = time.monotonic()
        lease = Lease(str(root), "requeued", LeaseOptions(wait=60.0))
        lease.acquire()
        assert time.monotonic() - started > 1.0  # it waited for the predecessor's 2 s to end
        assert [r["job"] for r in _records(root).values()] == ["requeued"]
        lease.release()
    finally:
        holder.kill()
        holder.wait()


def test_two_saves_of_one_step_never_share_a_staging_folder(tmp_path):
    """Each save stages into a folder of its own, named after its machine and pid; the clean-up of interrupted saves
    removes this process's and dead processes' folders, never a live process's."""
    from hf_unified_ckpt.checkpoint.folder.commit import remove_stale
    from hf_unified_ckpt.checkpoint.save.saving import open_staging
    from hf_unified_ckpt.store.node import host_name

    run = tmp_path / "run"
    final = str(run / "checkpoint-2")
    first = open_staging(final)
    second = open_staging(final)  # this process's first save of step 2 failed: its folder is cleaned up
    assert first.path != second.path and not os.path.exists(first.path) and os.path.isdir(second.path)
    assert re.fullmatch(rf"\.checkpoint-2\.{host_name()}\.{os.getpid()}\.[0-9a-f]+\.incomplete",
                        os.path.basename(second.path))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        for proc in (live, dead):
            folder = run / f".checkpoint-2.{host_name()}.{proc.pid}.0a1b.incomplete"
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"x")
        removed = remove_stale(run, keep=second.path)
        assert [os.path.basename(p) for p in removed] == [f".checkpoint-2.{host_name()}.{dead.pid}.0a1b.incomplete"]
        assert os.path.isdir(second.path)
        assert (run / f".checkpoint-2.{host_name()}.{live.pid}.0a1b.incomplete" / "model.safetensors").exists()
    finally:
        live.kill()
        live.wait()


def test_a_save_over_a_symlinked_checkpoint_replaces_the_link_and_never_removes_through_it(tmp_path):
    """Item 11: checkpoint-2 is a symbolic link to a folder elsewhere. Saving step 2 again commits a real
    checkpoint-2 and returns (no `OSError: Cannot call rmtree on a symbolic link`); the link's target is left as it
    was. Rotation removes a symlinked checkpoint as a link, never its target."""
    from support.trainers import make_trainer
    from hf_unified_ckpt.checkpoint.load.loading import verify_checkpoint
    from hf_unified_ckpt.checkpoint.folder.retention import rotate_checkpoints

    out, elsewhere = tmp_path / "out", tmp_path / "archive" / "checkpoint-2"
    elsewhere.mkdir(parents=True)
    (elsewhere / "keep.txt").write_text("archived")
    out.mkdir()
    (out / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    make_trainer(out, max_steps=4, save_steps=2).train()
    assert not (out / "checkpoint-2").is_symlink() and verify_checkpoint(out / "checkpoint-2")["global_step"] == 2
    assert sorted(os.listdir(elsewhere)) == ["keep.txt"] and (elsewhere / "keep.txt").read_text() == "archived"
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    (out / "checkpoint-2").rename(tmp_path / "real-2")
    (out / "checkpoint-2").symlink_to(tmp_path / "real-2", target_is_directory=True)
    assert rotate_checkpoints(out, limit=1) == [str(out / "checkpoint-2")]
    assert sorted(os.listdir(out)) == ["checkpoint-4"] and verify_checkpoint(tmp_path / "real-2")


@pytest.mark.slow
def test_two_jobs_started_together_one_runs_the_other_is_refused_never_a_torn_commit(tmp_path):
    """20 races: two real processes build their Trainers on one output_dir, wait for one signal, then call train()
    together (4 steps, a save at each, save_total_limit=2). Every time one runs to the end and the other is refused
    with OutputDirInUseError naming the first's pid; every committed folder verifies; no hidden folder and no lease
    is left. (Each process imports the training stack once and races 20 times, on a fresh output_dir each time.)"""
    from hf_unified_ckpt.checkpoint.load.loading import verify_checkpoint

    races = 20
    jobs = [subprocess.Popen([sys.executable, WORKER, "train", str(tmp_path),
                              str(races)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        for race in range(races):
            deadline = time.monotonic() + 300
            while not all((tmp_path / f"ready-{race}-{p.pid}").exists() for p in jobs):
                assert all(p.poll() is None for p in jobs) and time.monotonic() < deadline, race
                time.sleep(0.01)
            (tmp_path / f"go-{race}").touch()
        said = [p.communicate(timeout=600) for p in jobs]
    finally:
        for p in jobs:
            p.kill()
    assert all(p.returncode == 0 for p in jobs), [e[-3000:] for _, e in said]
    lines = [{int(line.split()[1]): line for line in out.splitlines() if line.startswith("RACE ")} for out, _ in said]
    for race in range(races):
        verdicts = [lines[i][race].split(maxsplit=2)[2] for i in range(2)]
        ran = [jobs[i].pid for i in range(2) if verdicts[i] == "RAN"]
        assert len(ran) == 1 and sum(v.startswith("REFUSED") for v in verdicts) == 1, (race, verdicts)
        assert f"pid {ran[0]}, started " in next(v for v in verdicts if v.startswith("REFUSED")), verdicts
        out = tmp_path / f"race-{race}"
        assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-4"], (race, os.listdir(out))
        for name in os.listdir(out):
            assert verify_checkpoint(out / name)["global_step"] == int(name.split("-")[1])


def test_a_store_that_ignores_conditional_writes_is_said_once_to_leave_output_dir_unprotected(caplog):
    """A store whose exclusive put overwrites (an S3 server without conditional writes) is found when the lease is
    taken, and said once; the lease still keeps a job that comes later out."""
    from hf_unified_ckpt.store import FsspecStore, register_store

    class NoConditionalWrites(FsspecStore):
        def put(self, ref, data, exclusive=False):
            super().put(ref, data)

    register_store("memory", NoConditionalWrites)
    try:
        with caplog.at_level("WARNING"):
            for n in range(2):
                held = Lease(f"memory://unprotected-{n}/run", "first", LeaseOptions(wait=0.0))
                held.acquire()
        said = [r for r in caplog.records if "ignores conditional writes" in r.getMessage()]
        assert len(said) == 1 and "memory://unprotected-0/run" in said[0].getMessage()
        with pytest.raises(OutputDirInUseError):
            Lease("memory://unprotected-1/run", "second", LeaseOptions(wait=0.0)).acquire()
        held.release()
    finally:
        register_store("memory", FsspecStore)
