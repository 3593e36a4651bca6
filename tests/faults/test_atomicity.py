"""Atomic: a save killed at any point leaves no folder that resume picks; resume picks the previous complete
checkpoint and continues exactly. Also: an injected write failure (full disk) raises and commits nothing."""

import subprocess
import sys

import pytest
import torch

from support.states import final_state
from support.trainers import train
from hf_unified_ckpt.errors import UnifiedCheckpointError
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout, newest_complete
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader
from support.faults import record_fault
from support.paths import WORKERS
from support.faulty_store import fail_with, injected, no_space, nth, on
from support.workers.kill_worker import ASYNC_POINTS, COMPRESSED_POINTS, EMA_POINTS, KILLED, POINTS



@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer, losses = train(tmp_path_factory.mktemp("base"), max_steps=9, save_steps=3,
                            unified_checkpoint_max_shard_size="40KB")
    return losses, final_state(trainer)


@pytest.fixture(scope="module")
def resumed_from_o1(tmp_path_factory):
    """What a compressed run killed after its step-3 save must continue as: an O1 run resumed from its step 3."""
    base = tmp_path_factory.mktemp("o1")
    train(base / "first", max_steps=9, save_steps=3, ckpt_quant_stage="O1", unified_checkpoint_max_shard_size="40KB")
    trainer, losses = train(base / "then", max_steps=9, save_steps=3, resume=str(base / "first" / "checkpoint-3"),
                            ckpt_quant_stage="O1", unified_checkpoint_max_shard_size="40KB")
    return losses, final_state(trainer)


@pytest.fixture(scope="module")
def uninterrupted_ema(tmp_path_factory):
    """The EMA an interrupted run with the word 'ema' must end with: an uninterrupted one's, at step 9."""
    run = tmp_path_factory.mktemp("ema")
    train(run, max_steps=9, save_steps=3, unified_checkpoint_config="ema", unified_checkpoint_max_shard_size="40KB")
    with ComponentReader(run / "checkpoint-9", "ema") as reader:
        return {n: reader.get(n) for n in reader.keys()}


ALL_POINTS = list(POINTS) + list(ASYNC_POINTS) + list(COMPRESSED_POINTS) + list(EMA_POINTS)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Every kill point's run, one after another, each in a process of its own forked from one worker that imported
    the training stack once (`kill_worker.py`); the caller's thread settings: train() pins them."""
    root = tmp_path_factory.mktemp("killed")
    proc = subprocess.run([sys.executable, str(WORKERS / "kill_worker.py"), str(root), *ALL_POINTS],
                          capture_output=True, text=True, timeout=900)
    return root, proc


@pytest.mark.parametrize("point", ALL_POINTS)
def test_killed_save_is_never_picked_and_resume_is_exact(point, killed, request, caplog):
    """kill (os._exit: no clean-up runs, as with SIGKILL) at `point` of the step-6 save, sync or async, plain or
    with O1-compressed moments (whose resume must then continue exactly as any resume from that checkpoint)."""
    record_fault(point, survived=False)
    root, proc = killed
    run = root / point
    status = root / f"{point}.status"
    assert status.exists() and int(status.read_text()) == KILLED, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected_step = 6 if point == "during-rotation" else 3
    newest = newest_complete(run)
    assert newest is not None and newest.global_step == expected_step
    if point != "during-rotation":
        six = run / "checkpoint-6"
        assert not six.exists() or not detect_layout(six).complete
    quant = "O1" if point in COMPRESSED_POINTS else "O0"
    words = "ema" if point in EMA_POINTS else ""
    trainer, losses = train(run, max_steps=9, save_steps=3, resume=True, unified_checkpoint_max_shard_size="40KB",
                            ckpt_quant_stage=quant, unified_checkpoint_config=words)
    if words:  # the EMA continued from the complete checkpoint exactly as if nothing had happened
        expected = request.getfixturevalue("uninterrupted_ema")
        with ComponentReader(run / "checkpoint-9", "ema") as reader:
            assert reader.keys() == list(expected) and all(torch.equal(reader.get(n), expected[n]) for n in expected)
    base_losses, base_state = request.getfixturevalue("resumed_from_o1" if quant == "O1" else "uninterrupted")
    assert all(losses[s] == base_losses[s] for s in range(expected_step + 1, 10))
    state = final_state(trainer)
    assert all(torch.equal(state[k], base_state[k]) for k in base_state)
    assert detect_layout(run / "checkpoint-9").complete
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # leftovers were cleaned at the next save
    if point == "during-rotation":
        assert not (run / "checkpoint-3").exists()  # never a half-deleted checkpoint-3
    record_fault(point, survived=True)


def test_runs_compute_alike_whatever_threads_the_caller_set(tmp_path, monkeypatch):
    """The comparisons above are bit-exact only if every run computes with the same thread count (one ulp apart
    otherwise): a caller with 2 threads (a fresh 2-core machine) and one with 1 get identical runs."""
    states = []
    for threads in (2, 1):
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)
        trainer, _ = train(tmp_path / f"threads-{threads}", max_steps=3, save_steps=3)
        states.append(final_state(trainer))
    assert [k for k in states[0] if not torch.equal(states[0][k], states[1][k])] == []


def test_full_disk_during_save_raises_and_commits_nothing(tmp_path):
    record_fault("ENOSPC (sync)", survived=False)
    full = on("write_at", nth(3, lambda call: ".checkpoint-6." in call.ref), fail_with(no_space))  # after two files
    with injected(full), pytest.raises(UnifiedCheckpointError, match="nothing was committed") as e:
        train(tmp_path, max_steps=6, save_steps=3, unified_checkpoint_max_shard_size="40KB")
    assert "No space left on device" in str(e.value) and "checkpoint-6" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]  # no staging folder left either
    assert newest_complete(tmp_path).global_step == 3
    record_fault("ENOSPC (sync)", survived=True)
