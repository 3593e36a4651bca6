"""async_save: training waits only for the in-memory snapshot; the files are written in the background; one save
in flight; the end of training waits for it; its errors surface loudly at the next save or at the end; a failed
background save is never committed. Resume from async checkpoints is exact (same topology) on every engine."""

import errno
import os

import pytest
import torch

from support.specs import run_spec
from support.states import final_state
from support.trainers import train
from support.faults import record_fault
from support.launches import torchrun
from support.faulty_store import fail_with, injected, no_space, on
from hf_unified_ckpt.errors import UnifiedCheckpointError
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout, newest_complete

ASYNC = {"unified_checkpoint_config": "async_save", "unified_checkpoint_max_shard_size": "40KB"}


def test_async_checkpoints_are_complete_and_resume_exactly(tmp_path):
    trainer, base = train(tmp_path / "a", max_steps=6, save_steps=3, **ASYNC)
    assert detect_layout(tmp_path / "a" / "checkpoint-3").complete and detect_layout(tmp_path / "a" / "checkpoint-6").complete
    resumed, losses = train(tmp_path / "b", max_steps=6, resume=str(tmp_path / "a" / "checkpoint-3"), **ASYNC)
    assert [losses[s] for s in (4, 5, 6)] == [base[s] for s in (4, 5, 6)]
    a, b = final_state(trainer), final_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _fail_writes_of(step: int):
    return injected(on("write_at", lambda call: f".checkpoint-{step}." in call.ref, fail_with(no_space)))


@pytest.mark.parametrize("failing_step,surfaces_at", [(6, "end of training"), (3, "the next save")])
def test_background_error_surfaces_and_nothing_is_committed(tmp_path, failing_step, surfaces_at):
    record_fault(f"ENOSPC (async, surfaces at {surfaces_at})", survived=False)
    with _fail_writes_of(failing_step), pytest.raises(UnifiedCheckpointError, match="No space left on device.*") as e:
        train(tmp_path, max_steps=6, save_steps=3, **ASYNC)
    assert f"checkpoint-{failing_step}" in str(e.value) and "nothing was committed" in str(e.value)
    assert not (tmp_path / f"checkpoint-{failing_step}").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging removed
    if failing_step == 6:
        assert newest_complete(tmp_path).global_step == 3  # the previous checkpoint is intact
    record_fault(f"ENOSPC (async, surfaces at {surfaces_at})", survived=True)


@pytest.mark.parametrize("config", ["", "async_save"])
def test_read_only_output_folder_is_a_clear_error(tmp_path, config):
    """As root, chmod cannot make a folder read-only here; the failure is injected where the save's staging folder
    is created (`make_folder`; not the Trainer hook files' `.checkpoint-6.hooks.` folder)."""
    record_fault(f"read-only output folder ({config or 'sync'})", survived=False)

    def staging_of_six(call) -> bool:
        name = os.path.basename(os.path.normpath(call.ref))
        return name.startswith(".checkpoint-6.") and not name.startswith(".checkpoint-6.hooks.")

    read_only = on("make_folder", staging_of_six, fail_with(lambda ref: OSError(errno.EROFS, "Read-only file system",
                                                                                  ref)))
    with injected(read_only), pytest.raises(UnifiedCheckpointError, match="Read-only file system"):
        train(tmp_path, max_steps=6, save_steps=3, unified_checkpoint_config=config)
    assert newest_complete(tmp_path).global_step == 3 and not (tmp_path / "checkpoint-6").exists()
    record_fault(f"read-only output folder ({config or 'sync'})", survived=True)


def test_snapshot_buffers_are_made_ahead_reused_and_released_at_the_end(tmp_path, monkeypatch):
    """The host buffers of the first save are made after the first optimizer step, in the background (the first
    save finds every one it copies into ready), reused by the next saves (one buffer per tensor, the same three
    times), and freed when train() ends."""
    from hf_unified_ckpt.checkpoint.save.async_save import AsyncSaver
    from hf_unified_ckpt.checkpoint.save.snapshot import HostBuffers

    ready_at_start, used = [], {}
    real_start, real_copy = AsyncSaver.start, HostBuffers.copy

    def start(self, *args, **kwargs):
        buffers = self._snapshots.buffers
        buffers._join()
        ready_at_start.append({key: id(b) for key, (b, _) in buffers._buffers.items()})
        return real_start(self, *args, **kwargs)

    def copy(self, key, tensor, *args, **kwargs):
        out = real_copy(self, key, tensor, *args, **kwargs)
        used.setdefault(key, set()).add(id(out))
        return out

    monkeypatch.setattr(AsyncSaver, "start", start)
    monkeypatch.setattr(HostBuffers, "copy", copy)
    trainer, _ = train(tmp_path, max_steps=6, save_steps=2, **ASYNC)
    saver = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "saver")).saver
    assert len(ready_at_start) == 3 and used
    assert all(ids == {ready_at_start[0][key]} for key, ids in used.items())  # made ahead, then reused
    assert saver.host_buffer_bytes() == 0 and not saver.in_flight and not saver.warmed_up  # released at the end


@pytest.mark.dist
def test_async_resume_is_exact_on_every_engine(tmp_path):
    """The saving runs' snapshots sleep 1 s before copying: the next optimizer step must wait for the copy on
    every engine (DeepSpeed steps inside backward, through its own optimizer's step), or the resume drifts. With
    the writer processes of `unified_checkpoint_async_executor="process"` (world size 2), the same, and the same
    tensor files as the threads write. On every engine the first save copies into host buffers made ahead."""
    engines = {"ddp": {}, "z2": {"zero": 2}, "z3": {"zero": 3}, "f2": {"fsdp": 2}, "z2-process": {"zero": 2}}
    runs = []
    for name, spec in engines.items():
        overrides = {**ASYNC, "unified_checkpoint_async_executor": "process"} if "process" in name else ASYNC
        runs.append({**spec, "overrides": overrides, "output_dir": str(tmp_path / name),
                     "result": str(tmp_path / f"{name}.pt"), "slow_snapshot": 1.0, "record_buffers": True})
        runs.append({**spec, "overrides": overrides, "output_dir": str(tmp_path / f"{name}-r"),
                     "resume": str(tmp_path / name / "checkpoint-3"), "result": str(tmp_path / f"{name}-r.pt")})
    torchrun(2, runs, tmp_path)
    for step in (3, 6):  # the writer processes (a process group of their own) write what the threads write
        thread, process = (tmp_path / name / f"checkpoint-{step}" for name in ("z2", "z2-process"))
        tensors = sorted(p.name for p in thread.iterdir() if ".safetensors" in p.name)
        assert tensors == sorted(p.name for p in process.iterdir() if ".safetensors" in p.name) and len(tensors) > 4
        assert all((thread / n).read_bytes() == (process / n).read_bytes() for n in tensors), step
    for name in engines:
        base = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"{name}-r.pt", weights_only=False)
        assert [resumed["losses"][s] for s in (4, 5, 6)] == [base["losses"][s] for s in (4, 5, 6)], name
        assert all(torch.equal(resumed["state"][k], v) for k, v in base["state"].items()), name
        assert detect_layout(tmp_path / name / "checkpoint-6").complete
        # rank 0's snapshot buffers (pieces of every sharded tensor under ZeRO-3 and FSDP2): all made before the
        # first save, then reused by the second
        made, used = base["buffers"]["ready_at_start"], base["buffers"]["used"]
        assert len(made) == 2 and used and all(ids == {made[0][key]} for key, ids in used.items()), name
    single = run_spec({"output_dir": str(tmp_path / "z3-single"), "resume": str(tmp_path / "z3" / "checkpoint-3")}, 1)
    base = torch.load(tmp_path / "z3.pt", weights_only=False)
    assert all(abs(single["losses"][s] - base["losses"][s]) <= 1e-5 * abs(base["losses"][s]) for s in (4, 5, 6))
