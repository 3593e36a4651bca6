"""Checkpoints spread over machines whose folders are local to each machine (reference design, section 2.3.2).

Machines are simulated on this one: one `torchrun` per machine (static rendezvous on 127.0.0.1), each machine
with its own output folder that no other machine sees. What is checked:
- a save writes each machine's share of the tensor files into its own folder, with the manifest and the small
  files in every folder; rotation runs in every folder; async saves do the same;
- resume with the same machines is bit-exact; with another number of machines, machine sizes and engine it
  matches within the tolerance of a changed world size, ranks reading the tensors they lack from other machines
  (a machine with an empty folder included);
- a union that misses files is refused with an error naming them; resume_from_checkpoint=True then falls back
  to the newest checkpoint the machines hold completely — also when one machine was killed before its commit
  while the other committed.
Tolerance where the world size or engine changes: losses rel. 1e-5, weights abs. 1e-5 (measured ~1e-7).
"""

import shutil
from pathlib import Path

import pytest
import torch

from support.states import assert_resumed_matches
from support.trainers import train
from support.faults import record_fault
from support.launches import torchrun_machines
from hf_unified_ckpt.errors import CorruptCheckpointError
from hf_unified_ckpt.checkpoint.folder.manifest import read_manifest

pytestmark = pytest.mark.dist  # every test launches torchrun per machine (the module's `two_machines`)

SHARDS = {"unified_checkpoint_max_shard_size": "40KB"}


def _shards(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.safetensors")}


def _manifest_shards(folder: Path) -> set[str]:
    return {f for c in read_manifest(folder)["components"].values() for f in c["files"]}


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """ZeRO-2 on 2 machines x 1 process, each with a local folder: an uninterrupted 6-step run; the same run
    saving every 2 steps (async, with an EMA, keep 2: checkpoint-2 is rotated away); a resume from checkpoint-4."""
    work = tmp_path_factory.mktemp("two_machines")
    out = [work / f"machine{k}" / "out" for k in range(2)]

    def runs(k):
        return [
            {"output_dir": str(work / f"machine{k}" / "base"), "zero": 2, "overrides": {"save_strategy": "no"},
             "result": str(work / "baseline.pt")},
            {"output_dir": str(out[k]), "zero": 2, "overrides": {"save_steps": 2, "save_total_limit": 2,
                                                                  "unified_checkpoint_config": "async_save ema",
                                                                  **SHARDS},
             "record_aggregation": True, "result": str(work / "saving.pt")},
            {"output_dir": str(out[k]), "zero": 2, "resume": str(out[k] / "checkpoint-4"),  # EMA read across machines
             "overrides": {"save_strategy": "no", "unified_checkpoint_config": "ema"},
             "result": str(work / "resumed.pt")},
        ]

    torchrun_machines([(1, runs(0)), (1, runs(1))], work)
    return work, out, torch.load(work / "baseline.pt", weights_only=False)


def test_each_machine_writes_its_share_and_every_folder_is_committed(two_machines):
    _, out, _ = two_machines
    for step in (4, 6):
        folders = [o / f"checkpoint-{step}" for o in out]
        shares = [_shards(f) for f in folders]
        expected = _manifest_shards(folders[0])
        assert read_manifest(folders[1]) == read_manifest(folders[0])
        assert "ema" in read_manifest(folders[0])["components"]
        assert all(shares) and not shares[0] & shares[1] and shares[0] | shares[1] == expected, shares
        for f in folders:
            assert {"trainer_state.json", "scheduler.pt", "config.json", "rng_state_0.pth"} <= {p.name for p in f.iterdir()}
            assert not list(f.glob(".writer-*"))
    assert (out[1] / "checkpoint-6" / "rng_state_1.pth").is_file()
    assert not (out[0] / "checkpoint-6" / "rng_state_1.pth").exists()  # each rank's RNG stays on its machine


def test_each_file_is_written_by_one_rank_from_the_pieces_the_others_send_it(two_machines):
    """Machine-local folders: a file's one writer receives the other ranks' pieces of it point-to-point (issue 58),
    no sharded tensor is assembled through the engine's collectives, and nobody receives bytes it does not write."""
    work, out, _ = two_machines
    saves = [torch.load(work / f"saving.pt.aggregation.rank{r}", weights_only=False) for r in range(2)]
    assert [len(rank) for rank in saves] == [3, 3]  # the saves at steps 2, 4 and 6
    for rank in saves:
        for save in rank:
            assert save["files"] and save["assembled"] == 0
            assert 0 < save["received"] <= sum(b - a for _, a, b in save["cells"])
            assert {name for name, _, _ in save["cells"]} <= set(save["files"])
    mine = [{name for s in rank for name, _, _ in s["cells"]} for rank in saves]
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    assert mine[0] <= _shards(out[0] / "checkpoint-6") and mine[1] <= _shards(out[1] / "checkpoint-6")


def test_rotation_runs_in_every_machine_folder(two_machines):
    _, out, _ = two_machines
    for o in out:
        assert sorted(p.name for p in o.iterdir()) == ["checkpoint-4", "checkpoint-6"]


def test_resume_on_the_same_machines_is_exact(two_machines):
    work, _, baseline = two_machines
    resumed = torch.load(work / "resumed.pt", weights_only=False)
    assert_resumed_matches(resumed, baseline, steps=(5, 6), exact=True, loss_rtol=0, state_atol=0)


def _machine_copies(two_machines, tmp_path, names) -> list[Path]:
    _, out, _ = two_machines
    copies = []
    for k, source in enumerate(names):
        target = tmp_path / f"machine{k}" / "out"
        if source is None:
            target.mkdir(parents=True)
        else:
            shutil.copytree(out[source], target)
        copies.append(target)
    return copies


def test_resume_on_more_ranks_and_another_engine_reads_from_other_machines(two_machines, tmp_path):
    """2 machines x 1 (ZeRO-2) -> 2 machines x 2 + 1 processes (FSDP2, world 3); two ranks share a folder."""
    _, _, baseline = two_machines
    out = _machine_copies(two_machines, tmp_path, [0, 1])
    for o in out:
        shutil.rmtree(o / "checkpoint-6")
    runs = [[{"output_dir": str(o), "fsdp": 2, "resume": True, "overrides": {**SHARDS},
              "result": str(tmp_path / "resumed.pt")}] for o in out]
    torchrun_machines([(2, runs[0]), (1, runs[1])], tmp_path)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert_resumed_matches(resumed, baseline, steps=(5, 6), exact=False, loss_rtol=1e-5, state_atol=1e-5)
    folders = [o / "checkpoint-6" for o in out]
    assert read_manifest(folders[0])["saved_by"]["world_size"] == 3
    assert _shards(folders[0]) | _shards(folders[1]) == _manifest_shards(folders[0])
    assert _shards(folders[0]) and _shards(folders[1])


def test_one_machine_alone_lacks_files_and_says_which(two_machines, tmp_path):
    _, out, _ = two_machines
    lacking = sorted(_manifest_shards(out[1] / "checkpoint-6") - _shards(out[0] / "checkpoint-6"))
    with pytest.raises(CorruptCheckpointError) as e:
        train(tmp_path / "run", max_steps=6, resume=str(out[0] / "checkpoint-6"))
    msg = str(e.value)  # one process sees one folder: verify's words, and where such files usually are
    assert f"{lacking[0]}: missing (expected" in msg and "the other machines hold the missing files" in msg, msg


def test_files_gathered_on_one_machine_resume_there(two_machines, tmp_path):
    """2 machines -> 1: the machines' folders copied into one; a single process (no DeepSpeed) resumes."""
    _, out, baseline = two_machines
    merged = tmp_path / "merged" / "checkpoint-4"
    for o in out:
        shutil.copytree(o / "checkpoint-4", merged, dirs_exist_ok=True)
    _, losses = train(tmp_path / "merged", max_steps=6, save_strategy="no", resume=str(merged))
    for step in (5, 6):
        assert abs(losses[step] - baseline["losses"][step]) <= 1e-5 * abs(baseline["losses"][step])


def test_one_machine_to_two_with_an_empty_folder_and_fallback_to_the_newest_complete(two_machines, tmp_path):
    """1 machine holding everything -> 2 machines, the second with an empty folder. checkpoint-6 lost a file on
    the first machine, so resume_from_checkpoint=True falls back to checkpoint-4 (exact: same engine and world
    size); naming checkpoint-6 explicitly fails on every rank with the missing file named."""
    _, out, baseline = two_machines
    merged = _machine_copies(two_machines, tmp_path, [0, None])
    for o in out:
        for step in (4, 6):
            shutil.copytree(o / f"checkpoint-{step}", merged[0] / f"checkpoint-{step}", dirs_exist_ok=True)
    lost = sorted(_shards(merged[0] / "checkpoint-6"))[0]
    (merged[0] / "checkpoint-6" / lost).unlink()
    runs = [[{"output_dir": str(o), "zero": 2, "resume": True, "overrides": {"save_strategy": "no"},
              "result": str(tmp_path / "fallback.pt")},
             {"output_dir": str(o), "zero": 2, "resume": str(o / "checkpoint-6"), "overrides": {"save_strategy": "no"}}]
            for o in merged]
    done = torchrun_machines([(1, runs[0]), (1, runs[1])], tmp_path, expect_failure=True)
    resumed = torch.load(tmp_path / "fallback.pt", weights_only=False)
    assert_resumed_matches(resumed, baseline, steps=(5, 6), exact=True, loss_rtol=0, state_atol=0)
    assert (merged[1] / "checkpoint-4" / "trainer_state.json").is_file()  # small files copied to machine 1
    assert not _shards(merged[1] / "checkpoint-4")  # tensors were read remotely, not copied
    assert "Skipping" in done[0].stderr and "checkpoint-6" in done[0].stderr  # warned once, by rank 0
    for proc in done:  # the explicit checkpoint-6 is refused on every machine, naming the lost file
        assert "missing from every machine's folder" in proc.stderr and lost in proc.stderr, proc.stderr[-3000:]


def test_machine_killed_before_its_commit_while_the_other_committed(two_machines, tmp_path):
    """At the save of step 6, machine 0 commits its folder and is killed; machine 1 is killed just before its
    rename. checkpoint-6 is committed on one machine only, so the union lacks machine 1's files: resume=True on
    both machines skips it and resumes exactly from checkpoint-3."""
    _, _, baseline = two_machines
    out = [tmp_path / f"machine{k}" / "out" for k in range(2)]
    first = [{"output_dir": str(o), "zero": 2, "overrides": {"save_steps": 3, **SHARDS},
              "die_at_commit": ["after" if k == 0 else "before", 2]} for k, o in enumerate(out)]
    torchrun_machines([(1, [first[0]]), (1, [first[1]])], tmp_path, expect_failure=True)
    partial = (out[0] / "checkpoint-6").is_dir() and not (out[1] / "checkpoint-6").exists()
    runs = [[{"output_dir": str(o), "zero": 2, "resume": True, "overrides": {"save_strategy": "no"},
              "result": str(tmp_path / "resumed.pt")}] for o in out]
    done = torchrun_machines([(1, runs[0]), (1, runs[1])], tmp_path)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    exact = [resumed["losses"][s] for s in (4, 5, 6)] == [baseline["losses"][s] for s in (4, 5, 6)]
    record_fault("machine killed before its commit, the other committed", partial and exact)
    assert partial, "the kill did not leave checkpoint-6 committed on machine 0 only"
    assert "Skipping" in done[0].stderr and "checkpoint-6" in done[0].stderr
    assert_resumed_matches(resumed, baseline, steps=(4, 5, 6), exact=True, loss_rtol=0, state_atol=0)
