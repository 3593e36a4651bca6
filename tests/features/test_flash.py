"""The memory tier (`flash`) with real processes: DDP x 2 on gloo, the persister as the separate process it is,
torchrun launches killed with SIGKILL, torchrun --max-restarts, two machines simulated by two torchruns.

The memory folder is a fresh folder in /dev/shm (a tmpfs, as users have it); these runs hold a few MB there.
Nothing fills /dev/shm (it is RAM): a full memory folder is an ENOSPC injected into the writes of memory
checkpoints (`support.faults.memory_full_from`). Tolerance when the world size changes: fp32 reduction order, as in
test_resume_equivalence.py (LOSS_RTOL = STATE_ATOL = 1e-5); the same engine and world size must be bit-exact.
"""

import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from support.callbacks import _wait_until
from support.flash import FLASH, SPLIT, flash_spec, kill_launcher_and_workers, persisters
from support.specs import loop_spec, run_spec
from support.states import assert_loop_options, assert_resumed_matches
from support.launches import torchrun, torchrun_machines, torchrun_popen
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout
from hf_unified_ckpt.checkpoint.load.loading import verify_checkpoint
from hf_unified_ckpt.flash.layout import (CHECKPOINTS, DURABLE, FAILED, LEASE_FILE, LOCK_FILE, RUN_FILE, SAVES,
                                          SaveInfo, run_folder, run_id, write_record)
from hf_unified_ckpt.store.node import is_locked, memory_room

LOSS_RTOL = STATE_ATOL = 1e-5


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """A memory folder of this module's own in /dev/shm; nothing may be left in it when the module ends."""
    folder = f"/dev/shm/hf_unified_ckpt-tests-{uuid.uuid4().hex[:8]}"
    os.makedirs(folder)
    yield folder
    subprocess.run(["pkill", "-9", "-f", f"hf_unified_ckpt.flash.persister {folder}"])  # after a failed test only
    shutil.rmtree(folder, ignore_errors=True)


def _split_spec(tmp, memory, tag, **extra):
    return {**flash_spec(tmp, memory, tag), "overrides": {**SPLIT, "unified_checkpoint_memory_dir": memory}, **extra}


def _file_sizes(checkpoint) -> dict[str, int]:
    """Every tensor file of a checkpoint and its size, from its manifest."""
    import json

    files = json.loads((checkpoint / "unified_checkpoint.json").read_text())["files"]
    return {n: e["size"] for n, e in files.items() if n.endswith(".safetensors")}


def _wait(predicate, timeout=60.0, what=""):
    assert _wait_until(predicate, timeout), f"timed out waiting for {what}"


def _durable(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("checkpoint-") and detect_layout(
        os.path.join(folder, n)).committed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, memory):
    """One launch of DDP x 2: a plain flash run (the baseline every resume is compared with), the same with
    evaluation, load_best_model_at_end, rotation and save_model, one whose memory folder is full from the
    save of step 4 on, one keeping a single memory checkpoint (its evicted files are overwritten by the next
    save), one whose persister is killed while it trains, and the baseline of the restart test (`_split_spec`)."""
    tmp = tmp_path_factory.mktemp("flash")
    specs = [flash_spec(tmp, memory, "ddp", unified_checkpoint_persist_every=2),
             loop_spec(flash_spec(tmp, memory, "loop", unified_checkpoint_persist_every=2), tmp / "loop-model"),
             {**flash_spec(tmp, memory, "full"), "memory_full_from": 4},
             {**flash_spec(tmp, memory, "reuse", unified_checkpoint_persist_every=2, unified_checkpoint_memory_keep=1),
              "record_reuse": True},
             {**flash_spec(tmp, memory, "revive", unified_checkpoint_persist_every=1), "kill_persister": [3, 5, "checkpoint-4"]},
             _split_spec(tmp, memory, "split")]
    proc = torchrun(2, specs, tmp)
    out = {s["output_dir"].rsplit("/", 1)[1]: torch.load(s["result"], weights_only=False) for s in specs}
    return tmp, out, proc


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_every_mth_save_and_the_last_are_durable_and_memory_is_freed(runs, memory):
    tmp, out, _ = runs
    # saves at 2, 4, 6 in memory; persist_every=2: the 2nd save (step 4), and the last (6) when training ended
    assert _durable(tmp / "ddp") == ["checkpoint-4", "checkpoint-6"]
    for name in ("checkpoint-4", "checkpoint-6"):
        verify_checkpoint(str(tmp / "ddp" / name))
    final = torch.load(tmp / "ddp.pt", weights_only=False)["state"]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp / "ddp" / "checkpoint-6").state_dict()
    assert all(torch.equal(loaded[k], final[k]) for k in loaded)
    # nothing left in memory nor running once train() returned
    assert os.listdir(memory) == []
    assert persisters(run_folder(memory, str(tmp / "ddp"))) == []


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_an_evicted_checkpoints_memory_is_overwritten_by_the_next_save(runs, memory):
    """memory_keep=1: the save of step 4 evicts checkpoint-2, whose tensor files are kept as spare files; the save
    of step 6 writes its files over them (each written by one rank here: DDP), reusing their memory instead of
    taking fresh pages, and copying its snapshot straight into them through mappings kept from save to save. What it wrote is what the baseline wrote: the training is the same bit for bit, and the
    durable copies verify and load the same weights."""
    tmp, out, _ = runs
    reuse = out["reuse"]["reused"]
    # every save's snapshot was copied straight into its memory files (no host buffer, no pwrite); step 6 took
    # step 2's files, through the mappings step 2 made
    assert reuse["written"] == reuse["placed"] > reuse["spare"] == reuse["mapped_before"] > 0
    assert reuse["host_buffer_bytes"] == [0, 0, 0]
    assert_resumed_matches(out["reuse"], out["ddp"], range(1, 7), exact=True, loss_rtol=0, state_atol=0)
    assert _durable(tmp / "reuse") == ["checkpoint-4", "checkpoint-6"]
    from transformers import AutoModelForCausalLM

    for name in ("checkpoint-4", "checkpoint-6"):
        verify_checkpoint(str(tmp / "reuse" / name))
        a = AutoModelForCausalLM.from_pretrained(tmp / "reuse" / name).state_dict()
        b = AutoModelForCausalLM.from_pretrained(tmp / "ddp" / name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert os.listdir(memory) == [] or not os.path.exists(run_folder(memory, str(tmp / "reuse")))


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_a_persister_killed_while_training_runs_is_replaced_at_the_next_save(runs):
    """The persister is killed (SIGKILL, as the out-of-memory killer does) when step 3 begins, every save to be made
    durable: the save of step 4 finds it gone, says so once and starts a new one, which makes checkpoint-4 durable
    while training still runs (without that, every save would wait in memory until train() ends). Training is the
    baseline's, bit for bit; every checkpoint ends up durable and verified."""
    tmp, out, proc = runs
    assert out["revive"]["durable_while_training"] is True
    assert (proc.stdout + proc.stderr).count("is not running (it was killed?); starting a new one") == 1
    assert _durable(tmp / "revive") == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name in _durable(tmp / "revive"):
        verify_checkpoint(str(tmp / "revive" / name))
    assert_resumed_matches(out["revive"], out["ddp"], range(1, 7), exact=True, loss_rtol=0, state_atol=0)


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_best_model_rotation_and_save_model_with_flash(runs):
    """The best checkpoint lived in memory until the end (never evicted), was loaded from there, and was made
    durable; rotation in output_dir keeps it and the last."""
    tmp, out, _ = runs
    result = out["loop"]
    assert result["best"] == str(tmp / "loop" / os.path.basename(result["best"]))
    assert_loop_options(tmp / "loop", result, tmp / "loop-model")


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_a_full_memory_folder_saves_to_durable_storage_instead(runs, memory):
    """ENOSPC while writing the memory checkpoint of step 4: that save goes to output_dir with the same snapshot,
    and so do the later ones; said once; the training is the same as the baseline's (nothing lost), bit for bit."""
    tmp, out, proc = runs
    assert _durable(tmp / "full") == ["checkpoint-4", "checkpoint-6"]
    verify_checkpoint(str(tmp / "full" / "checkpoint-4"))
    assert proc.stderr.count("flash: the memory folder") + proc.stdout.count("flash: the memory folder") == 1
    assert_resumed_matches(out["full"], out["ddp"], range(1, 7), exact=True, loss_rtol=0, state_atol=0)
    from transformers import AutoModelForCausalLM

    # the durable checkpoint-4 written from the snapshot is the same as the one the persister made of the baseline
    a = AutoModelForCausalLM.from_pretrained(tmp / "full" / "checkpoint-4").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp / "ddp" / "checkpoint-4").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_killed_job_resumes_from_memory_on_another_world_size_and_the_persister_makes_it_durable(runs, memory,
                                                                                                tmp_path):
    """kill -9 of torchrun and both workers right after the save of step 4 committed in memory (persist_every is
    large: nothing was durable yet): the persister, alive, makes checkpoint-4 durable; a new job on one process
    resumes from memory (memory wins the tie), trains on to the baseline's result, and ends with nothing left."""
    _, out, _ = runs
    marker = tmp_path / "saved-4"
    spec = {**flash_spec(tmp_path, memory, "killed", unified_checkpoint_persist_every=100),
            "stop_after_save": [4, str(marker), "hold"]}
    proc = torchrun_popen(2, [spec], tmp_path)
    try:
        _wait(lambda: marker.exists() or proc.poll() is not None, 300, "the save of step 4")
        assert marker.exists(), (tmp_path / "spec-2-0.log").read_text()[-5000:]  # the launch failed before it
    finally:
        workers = kill_launcher_and_workers(proc.pid)
    assert len(workers) >= 2
    run = run_folder(memory, str(tmp_path / "killed"))
    assert len(persisters(run)) == 1, "the persister must outlive the trainer"
    _wait(lambda: (tmp_path / "killed" / "checkpoint-4" / "unified_checkpoint.json").exists(), 60,
          "the persister to make checkpoint-4 durable")
    verify_checkpoint(str(tmp_path / "killed" / "checkpoint-4"))
    assert os.path.isdir(os.path.join(run, CHECKPOINTS, "checkpoint-4")), "memory is kept for a restart"
    resumed = run_spec({**flash_spec(tmp_path, memory, "killed", unified_checkpoint_persist_every=100),
                        "resume": True}, 1)
    assert resumed["resumed_from"] == os.path.join(run, CHECKPOINTS, "checkpoint-4")
    assert_resumed_matches(resumed, out["ddp"], [5, 6], exact=False, loss_rtol=LOSS_RTOL, state_atol=STATE_ATOL)
    assert _durable(tmp_path / "killed") == ["checkpoint-4", "checkpoint-6"]
    assert not os.path.exists(run) and persisters(run) == []


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_torchrun_max_restarts_resumes_from_memory_and_recycles_the_checkpoint_it_resumed_from(runs, memory, tmp_path):
    """torchrun --max-restarts=1: both workers die (as under kill -9) right after the save of step 4 committed in
    memory; the restarted workers resume from memory (resume_from_checkpoint='auto') with the same persister, at
    the same world size, with the optimizer split over both ranks (`SPLIT`), and train to step 10: the save of
    step 6 evicts checkpoint-4 (memory_keep=1) and the save of step 8 writes over its files, which the resume loaded
    from. Issue 47: the resumed optimizer state lived in those files, the resumed plan shrank two of them, and a
    rank died with SIGBUS. Now: no crash, bit for bit the uninterrupted run, the same files of the same sizes as
    the uninterrupted run (the plan does not follow the loaded state's order), checkpoint-4 made durable by the
    persister when the first workers died, and nothing left behind."""
    _, out, _ = runs
    spec = _split_spec(tmp_path, memory, "restarted", resume="auto",
                       stop_after_save=[4, str(tmp_path / "saved-4"), "exit"])
    # pytorch#135712: workers sharing torchrun's rendezvous store may read the killed attempt's addresses when they
    # restart (gloo "Connection refused" at init); the README tells users of --max-restarts to set this
    proc = torchrun(2, [spec], tmp_path, launcher_args=("--max-restarts=1",),
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONFAULTHANDLER": "1"})
    result = torch.load(tmp_path / "restarted.pt", weights_only=False)
    run = run_folder(memory, str(tmp_path / "restarted"))
    assert (tmp_path / "saved-4").exists()
    assert result["resumed_from"] == os.path.join(run, CHECKPOINTS, "checkpoint-4")
    assert "Bus error" not in proc.stderr
    assert_resumed_matches(result, out["split"], range(5, 11), exact=True, loss_rtol=0, state_atol=0)
    assert _durable(tmp_path / "restarted") == ["checkpoint-10", "checkpoint-4"]
    sizes = _file_sizes(tmp_path / "restarted" / "checkpoint-10")
    assert sum(n.startswith("optimizer-") for n in sizes) == 5
    assert sizes == _file_sizes(runs[0] / "split" / "checkpoint-10")
    assert not os.path.exists(run) and persisters(run) == []


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_machine_local_durable_folders_on_two_machines_are_refused_before_the_first_step(memory, tmp_path):
    """Two machines whose output_dir lies on each one's own disk: the leader's persister could never commit (the
    other machine's share never arrives), so train() refuses before step 1, on both machines, naming the machine
    that does not see the folder, and leaves nothing in either memory folder."""
    def spec(k):
        return {**flash_spec(tmp_path, f"{memory}/local{k}", f"local-m{k}", output=tmp_path / f"disk{k}" / "run"),
                "expect_error": "needs a durable folder that every machine sees"}

    for k in (0, 1):
        os.makedirs(f"{memory}/local{k}", exist_ok=True)
    torchrun_machines([(1, [spec(0)]), (1, [spec(1)])], tmp_path)
    result = torch.load(tmp_path / "local-m0.pt", weights_only=False)  # rank 0's record (machine 0)
    assert result["global_step"] == 0 and "the machine of rank 1 does not see" in result["error"], result["error"]
    assert os.listdir(f"{memory}/local0") == [] and os.listdir(f"{memory}/local1") == []
    assert os.listdir(tmp_path / "disk0" / "run") == []  # the mark rank 0 left is gone


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_two_machines_each_persist_their_share(memory, tmp_path):
    """Two machines (two torchruns, one process each) with memory folders of their own and one durable folder:
    each machine's memory holds its share; each persister copies its machine's files, the leader writes the
    manifest once both are there."""
    def spec(k, tag, **extra):
        return {**flash_spec(tmp_path, f"{memory}/machine{k}", f"{tag}-m{k}", output=tmp_path / tag,
                        unified_checkpoint_persist_every=1, unified_checkpoint_memory_keep=3), **extra}

    for k in (0, 1):
        os.makedirs(f"{memory}/machine{k}", exist_ok=True)
    torchrun_machines([(1, [spec(0, "two")]), (1, [spec(1, "two")])], tmp_path)
    result = torch.load(tmp_path / "two-m0.pt", weights_only=False)
    assert _durable(tmp_path / "two") == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name in _durable(tmp_path / "two"):
        verify_checkpoint(str(tmp_path / "two" / name))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "checkpoint-6").state_dict()
    assert all(torch.equal(loaded[k], result["state"][k]) for k in loaded)
    for k in (0, 1):
        assert os.listdir(f"{memory}/machine{k}") == []


def test_the_persister_writes_through_the_bucket_store(s3_bucket, memory, tmp_path):
    """With unified_checkpoint_storage (a real S3 server), the persister process makes the memory checkpoints
    durable in the bucket, through the same store: complete and verified there."""
    from hf_unified_ckpt.store import join

    run_spec(flash_spec(tmp_path, memory, "s3", unified_checkpoint_storage=s3_bucket, unified_checkpoint_persist_every=1,
                   max_steps=4), 1)
    for step in (2, 4):
        verify_checkpoint(join(s3_bucket, f"checkpoint-{step}"))
    assert not os.path.exists(run_folder(memory, s3_bucket)) and not os.path.exists(tmp_path / "s3" / "checkpoint-2")


# ---- the persister on its own ----------------------------------------------------------------------------------
@pytest.fixture
def staged_run(runs, memory, tmp_path):
    """A run's memory folder as a trainer leaves it after a kill: one committed memory checkpoint (a copy of the
    baseline's durable checkpoint-6) whose SaveInfo asks for it to be made durable, and a lease of a dead
    process (lease timeout 1 s)."""
    tmp, _, _ = runs
    durable_root = str(tmp_path / "durable")
    run = run_folder(memory, durable_root)
    shutil.copytree(tmp / "ddp" / "checkpoint-6", os.path.join(run, CHECKPOINTS, "checkpoint-6"))
    for folder in (SAVES, DURABLE, FAILED):
        os.makedirs(os.path.join(run, folder), exist_ok=True)
    write_record(os.path.join(run, RUN_FILE), {"durable_root": durable_root, "lease_timeout": 1.0})
    write_record(os.path.join(run, LEASE_FILE), {"job": "x", "pids": [_dead_pid()], "ended": False})
    info = SaveInfo(6, True, os.path.join(durable_root, "checkpoint-6"))
    write_record(os.path.join(run, SAVES, "checkpoint-6.json"), info.to_bytes())
    return run, durable_root


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _stagings(root, step: int) -> list[str]:
    """The staging folders of checkpoint-`step` under `root` (each save's own: `.checkpoint-N.<tag>.incomplete`)."""
    return [os.path.join(root, n) for n in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, n))
            and n.startswith(f".checkpoint-{step}.") and n.endswith(".incomplete")] if os.path.isdir(root) else []


def _persister(run, slow: float = 0.0) -> subprocess.Popen:
    """A real persister process; with `slow`, each file's copy starts `slow` seconds late (a window to kill it
    mid-copy)."""
    code = ("import sys, time\nimport hf_unified_ckpt.flash.copy as c\noriginal = c._copy_file\n"
            f"c._copy_file = lambda *a: (time.sleep({slow}), original(*a))[1]\n"
            "from hf_unified_ckpt.flash.persister import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, run], start_new_session=True)


def test_persister_killed_mid_copy_leaves_no_torn_checkpoint_and_the_next_completes_it(staged_run):
    run, durable_root = staged_run
    first = _persister(run, slow=0.3)
    _wait(lambda: any(n.endswith(".safetensors") for s in _stagings(durable_root, 6) for n in os.listdir(s)), 60,
          "the first copied file")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not os.path.exists(os.path.join(durable_root, "checkpoint-6")), "a torn durable checkpoint"
    assert not is_locked(os.path.join(run, LOCK_FILE)), "the kernel releases a dead persister's lock"
    second = _persister(run)
    assert second.wait(timeout=60) == 0
    verify_checkpoint(os.path.join(durable_root, "checkpoint-6"))
    assert _stagings(durable_root, 6) == []
    assert not os.path.exists(run), "the trainer stayed gone for the lease: the memory is freed"


def test_a_checkpoint_is_never_evicted_while_the_persister_copies_it(runs, memory, tmp_path):
    """Issue 47, part 3: the trainer died with its newest memory checkpoint (6) not due to be made durable; the
    persister copies it (slowly here) while a restarted job commits checkpoint-8 and evicts beyond memory_keep=1,
    reading a record that does not ask for 6 to be made durable (as it was before the persister said so): the
    eviction leaves 6 to a later save while the copy holds its lock; the copy completes and verifies, and the next
    eviction takes 6."""
    from hf_unified_ckpt.options import parse_flash
    from hf_unified_ckpt.flash.tier import FlashTier

    tmp, _, _ = runs
    durable_root = str(tmp_path / "durable")
    run = run_folder(memory, durable_root)
    for step in (6, 8):
        shutil.copytree(tmp / "ddp" / "checkpoint-6", os.path.join(run, CHECKPOINTS, f"checkpoint-{step}"))
    for folder in (SAVES, DURABLE, FAILED):
        os.makedirs(os.path.join(run, folder), exist_ok=True)
    write_record(os.path.join(run, RUN_FILE), {"durable_root": durable_root, "lease_timeout": 60.0})
    write_record(os.path.join(run, LEASE_FILE), {"job": "x", "pids": [_dead_pid()], "ended": False})
    stale = SaveInfo(6, False, os.path.join(durable_root, "checkpoint-6")).to_bytes()
    os.remove(os.path.join(run, CHECKPOINTS, "checkpoint-8", "unified_checkpoint.json"))  # not there yet
    persister = _persister(run, slow=1.0)
    try:
        _wait(lambda: _stagings(durable_root, 6), 60, "the copy of 6")
        shutil.copy(tmp / "ddp" / "checkpoint-6" / "unified_checkpoint.json",
                    os.path.join(run, CHECKPOINTS, "checkpoint-8"))  # the restarted job's save of step 8 commits
        write_record(os.path.join(run, SAVES, "checkpoint-6.json"), stale)
        tier = FlashTier(parse_flash(memory_dir=memory, keep=1), durable_root)
        assert tier.evict(None) == []
        assert detect_layout(os.path.join(run, CHECKPOINTS, "checkpoint-6")).committed
        _wait(lambda: os.path.exists(os.path.join(run, DURABLE, "checkpoint-6")), 120, "checkpoint-6 made durable")
        assert os.listdir(os.path.join(run, FAILED)) == []
        verify_checkpoint(os.path.join(durable_root, "checkpoint-6"))
        assert tier.evict(None) == [6]
    finally:
        persister.kill()
        persister.wait()
        shutil.rmtree(run, ignore_errors=True)


def test_a_damaged_memory_copy_is_never_made_durable_and_its_memory_is_kept(staged_run):
    run, durable_root = staged_run
    ckpt = os.path.join(run, CHECKPOINTS, "checkpoint-6")
    victim = sorted(n for n in os.listdir(ckpt) if n.startswith("optimizer") and n.endswith(".safetensors"))[0]
    with open(os.path.join(ckpt, victim), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _persister(run).wait(timeout=60) == 0
    assert not os.path.exists(os.path.join(durable_root, "checkpoint-6"))
    failed = open(os.path.join(run, FAILED, "checkpoint-6")).read()
    assert victim in failed and "CRC-32" in failed
    assert os.path.isdir(ckpt), "the only copy stays in memory"
    shutil.rmtree(run)


def test_a_second_persister_of_a_run_exits_at_once(staged_run):
    run, _ = staged_run
    first = _persister(run, slow=5)
    _wait(lambda: is_locked(os.path.join(run, LOCK_FILE)), 30, "the first persister's lock")
    second = _persister(run)
    assert second.wait(timeout=30) == 0
    assert first.poll() is None
    first.send_signal(signal.SIGKILL)
    first.wait()
    shutil.rmtree(run)


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_memory_keeps_the_newest_k_and_never_evicts_one_not_durable_yet_nor_the_best(runs, memory, tmp_path):
    from hf_unified_ckpt.options import FlashOptions
    from hf_unified_ckpt.flash.tier import FlashTier

    tmp, _, _ = runs
    tier = FlashTier(FlashOptions(True, memory, keep=2), str(tmp_path / "durable"))
    for step in (2, 4, 6, 8):
        shutil.copytree(tmp / "ddp" / "checkpoint-6", os.path.join(tier.root, f"checkpoint-{step}"))
    for folder in (SAVES, DURABLE):
        os.makedirs(os.path.join(tier.run, folder))
    for step, persist in ((2, True), (4, True), (6, False), (8, False)):
        info = SaveInfo(step, persist, str(tmp_path / "durable" / f"checkpoint-{step}"))
        write_record(os.path.join(tier.run, SAVES, f"checkpoint-{step}.json"), info.to_bytes())
    write_record(os.path.join(tier.run, DURABLE, "checkpoint-2"), b"durable")
    assert tier.evict(best=os.path.join(tier.root, "checkpoint-2")) == []  # 2: the best; 4: not durable yet
    assert tier.evict(best=None) == [2]
    write_record(os.path.join(tier.run, DURABLE, "checkpoint-4"), b"durable")
    assert tier.evict(best=None) == [4]
    assert sorted(os.listdir(tier.root)) == ["checkpoint-6", "checkpoint-8"]
    shutil.rmtree(tier.run)


# ---- before the first step -------------------------------------------------------------------------------------
def test_memory_too_small_for_a_snapshot_falls_back_to_durable_saves_said_with_the_numbers(memory, tmp_path,
                                                                                            caplog):
    from hf_unified_ckpt.options import FlashOptions
    from hf_unified_ckpt.flash.tier import FlashTier

    room = memory_room(memory)
    assert room["MemAvailable"] > 0 and room["free in folder"] > 0
    tier = FlashTier(FlashOptions(True, memory), str(tmp_path / "durable"))
    tier.open()
    with caplog.at_level("WARNING"):
        assert not tier.start(10**15)  # a PB checkpoint
    assert "MemAvailable" in caplog.text and "Saves go to durable storage" in caplog.text
    assert not os.path.exists(tier.run), "nothing is left in memory by a tier that never started"
    tier = FlashTier(FlashOptions(True, memory), str(tmp_path / "durable"))
    tier.open()
    assert tier.start(10**6) and tier.active
    tier.close(ended=True)
    _wait(lambda: not os.path.exists(tier.run), 30, "the persister to free the memory")


def test_two_runs_never_share_memory(tmp_path):
    a, b = run_id(str(tmp_path / "a" / "out")), run_id(str(tmp_path / "b" / "out"))
    assert a != b and a.startswith("out-") and b.startswith("out-")
    assert run_id("s3://bucket/run1") != run_id("s3://bucket/run2")


@pytest.mark.parametrize("field, value, message", [
    ("unified_checkpoint_memory_dir", "s3://b/x", "node-local folder"),
    ("unified_checkpoint_persist_every", 0, "whole number >= 1"),
    ("unified_checkpoint_memory_keep", 1.5, "whole number >= 1"),
    ("unified_checkpoint_memory_lease", 0, "seconds > 0"),
])
def test_bad_memory_tier_fields_are_refused_when_the_arguments_are_built(field, value, message, tmp_path):
    from hf_unified_ckpt import UnifiedCheckpointArguments

    with pytest.raises(ValueError, match=message):
        UnifiedCheckpointArguments(output_dir=str(tmp_path), use_cpu=True, unified_checkpoint=True,
                                   unified_checkpoint_config="flash", **{field: value})


def test_evicted_checkpoints_files_are_kept_as_two_spare_sets_and_taken_oldest_first(tmp_path):
    """Eviction keeps each evicted checkpoint's tensor files as a set of spare files, the newest two sets (a
    checkpoint still being persisted is evicted together with the one after it: three sets were in use, and the
    next saves must find both, not take fresh memory); each file of a save takes the oldest set's file of its name,
    the same inode (memory in use), and a set emptied or beyond two is removed."""
    from types import SimpleNamespace

    from hf_unified_ckpt.checkpoint.folder.commit import COMMIT_FILE
    from hf_unified_ckpt.checkpoint.write.memory_tier import reuse_spare
    from hf_unified_ckpt.flash.tier import FlashTier

    tier = SimpleNamespace(spare=str(tmp_path / "spare"))
    inodes = {}
    for step in (2, 4, 6, 8):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for name in ("model.safetensors", "optimizer.safetensors", COMMIT_FILE, "trainer_state.json"):
            (folder / name).write_bytes(f"{name} of {step}".encode())
        inodes[step] = (folder / "model.safetensors").stat().st_ino
    evict = lambda step: FlashTier._keep_as_spare(tier, str(tmp_path / f"checkpoint-{step}"))  # noqa: E731
    evict(2)
    evict(4)
    assert sorted(os.listdir(tier.spare)) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(os.listdir(tmp_path / "spare" / "checkpoint-2")) == ["model.safetensors", "optimizer.safetensors"]
    assert not (tmp_path / "checkpoint-2").exists()
    evict(6)  # beyond two sets: the oldest goes
    assert sorted(os.listdir(tier.spare)) == ["checkpoint-4", "checkpoint-6"]
    saving = tmp_path / "saving"
    saving.mkdir()
    for expected in (4, 6):
        target = saving / f"model-{expected}.safetensors"
        assert reuse_spare(tier.spare, str(saving / "model.safetensors"))
        os.replace(saving / "model.safetensors", target)
        assert target.read_bytes() == f"model.safetensors of {expected}".encode()
        assert target.stat().st_ino == inodes[expected]
    assert not reuse_spare(tier.spare, str(saving / "model.safetensors"))  # none left: fresh memory
    evict(8)  # the sets left with only their optimizer file stay; none beyond two
    assert sorted(os.listdir(tier.spare)) == ["checkpoint-6", "checkpoint-8"]
    (tmp_path / "spare" / "checkpoint-6" / "optimizer.safetensors").unlink()
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "model.safetensors").write_bytes(b"x")
    evict(10)  # an emptied set is removed first
    assert sorted(os.listdir(tier.spare)) == ["checkpoint-10", "checkpoint-8"]


@pytest.mark.parametrize("kind, extra", [("gpt2", {"bf16": True}), ("lora", {})], ids=["tied-gpt2-bf16", "lora"])
def test_snapshots_of_tied_bf16_and_lora_models_go_straight_into_memory_files(tmp_path, memory, kind, extra):
    """One process, memory_keep=1: every file of every save of a tied-embedding GPT-2 under bf16, and of a LoRA
    model, is copied straight into its memory file (no host buffer), the last save over step 2's files; the durable
    checkpoint verifies, and memory is freed at the end."""
    from support.records import record_reuse
    from support.trainers import train

    with record_reuse() as reuse:
        train(tmp_path / "out", model_kind=kind, **{**FLASH, "unified_checkpoint_memory_dir": memory,
                                                    "unified_checkpoint_memory_keep": 1}, **extra)
    assert reuse["written"] == reuse["placed"] > reuse["spare"] == reuse["mapped_before"] > 0, reuse
    assert reuse["host_buffer_bytes"] == [0, 0, 0]
    verify_checkpoint(str(tmp_path / "out" / "checkpoint-6"))
    assert not os.path.exists(run_folder(memory, str(tmp_path / "out")))


def test_a_snapshot_copied_into_memory_files_is_saved_elsewhere_when_memory_runs_out_later(tmp_path, memory,
                                                                                          monkeypatch, caplog):
    """One process, memory_keep=1: the save of step 6 copies its snapshot straight into the spare files step 2
    left, then memory runs out for one of its small files (ENOSPC): the save goes to output_dir, its tensor files
    written from the memory files' mappings (their folder already discarded). checkpoint-6 there verifies and holds
    the trained weights, bit for bit."""
    from support.records import record_reuse
    from support.trainers import train
    from support.faulty_store import fail_with, injected, no_space, on

    def memory_state_of_six(call) -> bool:
        return memory in call.ref and "checkpoint-6" in call.ref and call.ref.endswith("trainer_state.json")

    with (injected(on("put", memory_state_of_six, fail_with(no_space))), record_reuse() as reuse,
          caplog.at_level("WARNING", logger="hf_unified_ckpt")):
        trainer, _ = train(tmp_path / "out", **{**FLASH, "unified_checkpoint_memory_dir": memory,
                                                "unified_checkpoint_memory_keep": 1,
                                                "unified_checkpoint_persist_every": 100})
    assert reuse["placed"] > 0, reuse
    said = [r.getMessage() for r in caplog.records if "flash: the memory folder" in r.getMessage()]
    assert len(said) == 1 and "checkpoint-6 was saved to" in said[0], said
    assert _durable(tmp_path / "out") == ["checkpoint-6"]
    verify_checkpoint(str(tmp_path / "out" / "checkpoint-6"))
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-6").state_dict()
    final = trainer.model.state_dict()
    assert all(torch.equal(saved[k], final[k]) for k in saved)
    assert not os.path.exists(run_folder(memory, str(tmp_path / "out")))


@pytest.mark.dist  # launches torchrun (itself or through the module's `runs`)
def test_nothing_is_left_in_the_memory_folder(runs, memory):
    """Runs last in this module: every run that ended normally, or was resumed and ended, freed its memory."""
    left = [os.path.join(d, n) for d, _, names in os.walk(memory) for n in names]
    assert left == [], left
