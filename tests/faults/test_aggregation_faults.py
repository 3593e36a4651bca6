"""Faults during an aggregated save (issue 58): a rank killed mid-save, out of space on an aggregator, a slow
aggregator, a sender whose encoding fails, an aggregator that fails mid-file where bytes are announced to it (bf16
residual master weights' ties) — 3 real ranks (gloo, CPU), aggregation forced on (the word `aggregate`, 8 KiB ranges
and 4 KiB cells: every rank aggregates cells of both files; `unified_checkpoint_aggregators=1` where a pure sender is
wanted), each fault injected on one rank in the step-6 save (`support.faults.aggregation_fault`), after checkpoint-3
committed.

Three launches: one whose faults are exceptions (in place, out of space, a failed encoding, a slow aggregator, a
failed aggregator of announced bytes; the default group's timeout set to 120 s, as `init_process_group(timeout=...)`
sets it: the Trainer passes `ddp_timeout` there on GPUs, not on CPU), and one per kill (os._exit, as kill -9). In a
kill's launch the survivors record their error and when they raised; they ignore the launcher's SIGTERM, so a
survivor that hung would be SIGKILLed `fork_launch.GRACE` (5 s) later without a record.
"""

import re

import pytest

from support.specs import FORCED_AGGREGATION, spec_of
from support.faults import record_fault
from support.launches import torchrun
from support.fork_launch import GRACE
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout, newest_complete
from hf_unified_ckpt.checkpoint.load.loading import verify_checkpoint

KINDS = {"z3": {"zero": 3}, "f2": {"fsdp": 2},
         # bf16 residual master weights, ties planted at step 6: pieces only their rank can place, announced
         "z3r": {"zero": 3, "plant_ties": 6, "overrides": {"bf16": True}}}
TIMEOUT_S = 120  # the default group's timeout in the exceptions' launch, and so the `aggregate` group's
KILLS = {  # tag: (engine, fault, extra options)
    "killed-aggregator": ("z3", ["kill_aggregator", 1, 6], {}),
    "killed-sender": ("f2", ["kill_sender", 2, 6], {"unified_checkpoint_aggregators": 1}),
}


def _spec(tmp, kind, tag, words, fault=None, **extra):
    options = {"unified_checkpoint_config": words, **extra, **(FORCED_AGGREGATION if "aggregate" in words else {})}
    return {**spec_of(KINDS, tmp, kind, tag, **options),
            **({"aggregation_fault": fault, "default_timeout": TIMEOUT_S} if fault else {})}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aggregation_faults")
    torchrun(3, [_spec(tmp, "f2", "in_place", "in_place"),
                 _spec(tmp, "z3", "enospc", "aggregate", ["enospc", 2, 6]),
                 _spec(tmp, "f2", "encode", "async_save aggregate", ["encode", 1, 6]),
                 _spec(tmp, "f2", "slow", "aggregate", ["slow", 1, 6]),
                 _spec(tmp, "z3r", "unannounced", "residual_master_weight aggregate", ["fail_aggregator", 0, 6])],
             tmp)
    killed = {tag: torchrun(3, [_spec(tmp, kind, tag, "aggregate", fault, **extra)], tmp, expect_failure=True)
              for tag, (kind, fault, extra) in KILLS.items()}
    return tmp, killed


def _seen(tmp, tag):
    import torch

    return [torch.load(p, weights_only=False) if (p := tmp / f"{tag}.pt.fault.rank{r}").exists() else None
            for r in range(3)]


def _nothing_committed(run):
    """No checkpoint-6 and no staging folder of it; checkpoint-3 complete, verified and the newest."""
    assert sorted(p.name for p in run.iterdir() if "checkpoint-6" in p.name) == []
    assert newest_complete(run).global_step == 3
    verify_checkpoint(str(run / "checkpoint-3"))


def _failed_everywhere(seen, *expected, since=None):
    """Every rank's `train()` raised the save's typed error, with all of `expected` in it; with `since` (when the
    fault fired), well within the `aggregate` group's timeout of it: no rank waited for a transfer that never came."""
    for rank, record in enumerate(seen):
        error = record["error"] or ""
        assert error.startswith("UnifiedCheckpointError: saving ") and "nothing was committed" in error, (rank, error)
        assert all(e in error for e in expected), (rank, expected, error)
        assert since is None or 0 < record["failed_at"] - since < TIMEOUT_S / 4, (rank, record["failed_at"] - since)


@pytest.mark.dist
@pytest.mark.parametrize("tag", list(KILLS))
def test_a_rank_killed_mid_aggregated_save_commits_nothing_and_the_survivors_fail_at_once_naming_it(launched, tag):
    """An aggregator (after its first cell was written) or a pure sender (before it sent anything) dies as under
    kill -9: every survivor raises `UnifiedCheckpointError` on its own, within a fraction of a second (measured
    0.05-0.75 s; a survivor that hung until a timeout would be SIGKILLed without a record), the transfers it names
    failed with the dead rank only (no live rank blamed), and nothing of step 6 is committed."""
    tmp, killed = launched
    record_fault(f"{tag} mid aggregated save (3 ranks)", survived=False)
    dead = KILLS[tag][1][1]
    seen = _seen(tmp, tag)
    assert killed[tag].returncode != 0 and seen[dead] and "died" in seen[dead], killed[tag].stderr[-3000:]
    survivors = [record for rank, record in enumerate(seen) if rank != dead]
    assert all(survivors), killed[tag].stderr[-3000:]  # each failed on its own, before the launcher's SIGKILL
    _failed_everywhere(survivors)
    assert all(0 < s["failed_at"] - seen[dead]["died"] < GRACE for s in survivors)
    named = {int(r) for s in survivors for r in re.findall(r"(?:from|to) rank (\d+) failed", s["error"])}
    assert named == {dead}, [s["error"][-600:] for s in survivors]
    _nothing_committed(tmp / tag)
    record_fault(f"{tag} mid aggregated save (3 ranks)", survived=True)


@pytest.mark.dist
def test_out_of_space_on_an_aggregator_fails_the_save_on_every_rank_and_commits_nothing(launched):
    """ENOSPC in rank 2's cell writes of one file (`LocalStore.write_at`): it still receives its other cells (its
    senders wait for them), and the save fails on every rank, within seconds, with the typed error naming ENOSPC,
    that rank and the file; `train()` raises, as a synchronous save in place does (test_atomicity's full disk)."""
    tmp, _ = launched
    record_fault("ENOSPC on an aggregator (ZeRO-3 x 3)", survived=False)
    seen = _seen(tmp, "enospc")
    _failed_everywhere(seen, "rank 2: OSError: [Errno 28] No space left on device", seen[2]["file"],
                       since=seen[2]["fired"])
    _nothing_committed(tmp / "enospc")
    record_fault("ENOSPC on an aggregator (ZeRO-3 x 3)", survived=True)


@pytest.mark.dist
def test_a_sender_whose_encoding_fails_fails_the_save_on_every_rank(launched):
    """Encoding rank 1's pieces of one file raises (FSDP2, async save): rank 1 still sends the planned bytes (zeros:
    no aggregator waits for it) and receives the cells it aggregates, then fails; the background save's error
    surfaces on every rank at the end of training, within seconds; nothing committed."""
    tmp, _ = launched
    record_fault("encoding fails on a sender (FSDP2 x 3, async)", survived=False)
    seen = _seen(tmp, "encode")
    _failed_everywhere(seen, f"rank 1: RuntimeError: injected: encoding {seen[1]['file']} failed on rank 1",
                       since=seen[1]["fired"])
    _nothing_committed(tmp / "encode")
    record_fault("encoding fails on a sender (FSDP2 x 3, async)", survived=True)


@pytest.mark.dist
def test_an_aggregator_that_fails_mid_file_drains_the_announced_bytes_and_their_senders_fail_at_once(launched):
    """Rank 0's first cell of the master weights (bf16 residual, ties planted at step 6: pieces only their own rank
    can place, announced to the cell's aggregator) fails before anything of it is received: rank 0 still receives and
    drops the bytes announced into its cells (and the others), so the ranks announcing them do not wait for it until
    the `aggregate` group's timeout (120 s here); the save fails on every rank with rank 0's error within seconds,
    and nothing is committed."""
    tmp, _ = launched
    record_fault("an aggregator fails mid-file, announced bytes due (ZeRO-3 bf16 residual x 3)", survived=False)
    seen = _seen(tmp, "unannounced")
    assert seen[0]["file"] == "master_weights.safetensors"  # armed where rank 0's cells hold announced bytes
    _failed_everywhere(seen, "rank 0: RuntimeError: injected: aggregating master_weights.safetensors failed on rank 0",
                       since=seen[0]["fired"])
    _nothing_committed(tmp / "unannounced")
    record_fault("an aggregator fails mid-file, announced bytes due (ZeRO-3 bf16 residual x 3)", survived=True)


@pytest.mark.dist
def test_a_slow_aggregator_delays_the_commit_and_its_files_are_byte_identical_to_in_place(launched):
    """Rank 1 sleeps 0.1 s in each of its cell writes of the step-6 save: the commit comes after its last write, and
    both checkpoints' files are the in-place run's, byte for byte."""
    tmp, _ = launched
    seen = _seen(tmp, "slow")
    assert seen[1]["slow_writes"] >= 2 and seen[0]["committed"] > seen[1]["slow_until"] > 0
    for step in (3, 6):
        slow, in_place = tmp / "slow" / f"checkpoint-{step}", tmp / "in_place" / f"checkpoint-{step}"
        files = sorted(p.name for p in in_place.glob("*.safetensors"))
        assert files and sorted(p.name for p in slow.glob("*.safetensors")) == files
        assert [n for n in files if (slow / n).read_bytes() != (in_place / n).read_bytes()] == []
        assert detect_layout(slow).complete
    verify_checkpoint(str(tmp / "slow" / "checkpoint-6"))


@pytest.mark.dist
def test_the_aggregate_group_times_out_with_the_jobs_collective_timeout(launched):
    """The `aggregate` gloo group takes the default group's timeout (120 s here), not torch's 30 minutes for a new
    group: a peer that hangs fails the transfers when the job's other collectives would fail."""
    tmp, _ = launched
    for tag in ("enospc", "encode", "slow", "unannounced"):
        assert [s["timeouts"] for s in _seen(tmp, tag)] == [[TIMEOUT_S, TIMEOUT_S]] * 3
