"""Issue 47: a job restarted after a crash died with SIGBUS. Its resumed optimizer state lay in mappings of the
checkpoint files it loaded; the memory tier later wrote over those files (evicted, then reused as spare files) and
shrank them to a resumed plan that differed from the fresh one. What each fix is held to:

- nothing training keeps after a resume lies in a file mapping, under every engine (`owned_worker.py`: the files
  truncated to zero right after the load, then a step trained);
- a file that may be mapped is never shrunk: a spare file is taken only at the planned size, mapped and positional
  writes refuse a larger file, a file written whole is a new file;
- the optimizer component is planned in parameter-group order, whatever the order of the state dict;
- run folders nobody owns (a job killed before its first memory save) are cleared by the next start of any run.

The restart itself (DDP x 2, killed after a memory save, resumed, the checkpoint it resumed from recycled) is
`test_flash.py::test_torchrun_max_restarts_resumes_from_memory_and_recycles_the_checkpoint_it_resumed_from`; the
persister's copy against eviction is `test_flash.py::test_a_checkpoint_is_never_evicted_while_the_persister_copies_it`.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from support.paths import WORKERS
from support.env import THREADS
from support.models import build_model
from support.mapped_files import tensors_in_files



@pytest.mark.dist  # launches torchrun
def test_nothing_loaded_on_resume_stays_in_a_checkpoint_file(tmp_path):
    """DDP with EMA, ZeRO-3 in bf16 (fp32 master weights), FSDP2; two processes each: after the resume's load every
    file of the checkpoint is truncated to zero bytes, no live tensor lies in a file mapping, and a step trains."""
    cases = ["ddp-ema", "zero3-bf16", "fsdp2"]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKERS / "owned_worker.py"), str(tmp_path), *cases],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    for case in cases:
        for rank in (0, 1):
            assert json.loads((tmp_path / f"{case}.rank{rank}.json").read_text()) == [], (case, rank)


def test_the_mapping_check_sees_a_tensor_read_from_a_safetensors_file(tmp_path):
    """The control of the check above: a tensor `safe_open` returns lies in a mapping of its file; a copy does not."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    save_file({"x": torch.arange(4096, dtype=torch.float32)}, str(path))
    mapped = safe_open(str(path), "pt").get_tensor("x")
    assert [p for _, p in tensors_in_files([mapped])] == [str(path)]
    assert tensors_in_files([mapped.clone()]) == []


def test_loaded_optimizer_state_is_owned_by_the_process(tmp_path):
    """`OptimizerStateDecoder.value`, through which every engine takes the state objects an optimizer keeps, copies
    what the reader returns out of the file."""
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader, write_index, write_shard
    from hf_unified_ckpt.format.optim_state import flatten_optimizer_state, unflatten_optimizer_state

    model, state = _stepped_adamw()
    entries, metadata = flatten_optimizer_state(state, dict(enumerate(n for n, _ in model.named_parameters())))
    record = write_shard(tmp_path / "optimizer.safetensors", entries)
    write_index(tmp_path, "optimizer", {k: record.name for k in entries}, record.size, metadata)
    reader = ComponentReader(tmp_path, "optimizer")
    groups = [[n for n, _ in model.named_parameters()]]
    loaded = unflatten_optimizer_state(reader, groups, state["param_groups"])
    values = [v for per in loaded["state"].values() for v in per.values() if torch.is_tensor(v)]
    assert len(values) == len(entries)
    assert tensors_in_files(values) == []
    assert tensors_in_files([reader.get(next(iter(entries)))]) != []  # what the reader itself returns is mapped


def _stepped_adamw():
    model = build_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 97, (2, 8))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    return model, optimizer.state_dict()


def _plan_sizes(entries: dict) -> dict[str, tuple[int, int]]:
    from hf_unified_ckpt.format.planning import TensorSpec, file_plans, plan_component

    plan = plan_component("optimizer", [TensorSpec.of(n, t) for n, t in entries.items()], 2, 40000)
    return {f.name: (f.size, f.header_rank) for f in file_plans(plan)}


def test_the_optimizer_plan_does_not_depend_on_the_order_of_the_state_dict():
    """The same state in the order a fresh optimizer creates it (parameter by parameter at its first step) and in
    the order a loaded one holds it (the index's sorted keys): the same files, sizes and writers. Before the fix a
    resumed job shrank two of these 5 files."""
    from hf_unified_ckpt.format.optim_state import flatten_optimizer_state

    model, state = _stepped_adamw()
    names = dict(enumerate(n for n, _ in model.named_parameters()))
    fresh, _ = flatten_optimizer_state(state, names)
    by_name = {i: names[i] for i in names}
    loaded_order = sorted(state["state"], key=lambda i: by_name[i])
    loaded = {"state": {i: dict(reversed(list(state["state"][i].items()))) for i in loaded_order},
              "param_groups": state["param_groups"]}
    resumed, _ = flatten_optimizer_state(loaded, names)
    assert list(fresh) != sorted(fresh)  # parameter-group order, not names
    assert list(resumed) == list(fresh)
    plan = _plan_sizes(fresh)
    assert len(plan) == 5 and {rank for _, rank in plan.values()} == {0, 1}
    assert _plan_sizes(resumed) == plan
    assert _plan_sizes(dict(sorted(fresh.items()))) != plan  # what a plan in the loaded state's order was


def test_a_spare_file_is_taken_only_at_the_planned_size(tmp_path):
    """Spare files of another size are removed (a fresh file is taken), never resized; one of the planned size
    (in a later set) is taken; the file a process still maps keeps its bytes."""
    import mmap

    from hf_unified_ckpt.checkpoint.write.memory_tier import take_spare

    spare, target = tmp_path / "spare", tmp_path / "saving" / "optimizer-00001-of-00002.safetensors"
    target.parent.mkdir()
    for step, size in ((2, 300), (4, 200)):
        (spare / f"checkpoint-{step}").mkdir(parents=True)
        (spare / f"checkpoint-{step}" / target.name).write_bytes(bytes([step]) * size)
    with open(spare / "checkpoint-2" / target.name, "rb") as f:
        held = mmap.mmap(f.fileno(), 300, access=mmap.ACCESS_READ)  # a reader of the larger one
    assert take_spare(str(spare), str(target), 200)
    assert target.read_bytes() == bytes([4]) * 200
    assert held[:] == bytes([2]) * 300  # removed, not shrunk: its reader still sees all of it
    held.close()
    assert not take_spare(str(spare), str(target.with_name("other.safetensors")), 200)


def test_no_writer_shrinks_a_file(tmp_path):
    """Mapped writes and positional writes refuse a file larger than planned; a file written whole is a new file
    (whoever maps the old one keeps its bytes)."""
    import mmap

    from hf_unified_ckpt.store import WritableMaps
    from hf_unified_ckpt.store.local_io import write_at, write_whole

    path = tmp_path / "f.safetensors"
    path.write_bytes(b"x" * 8192)
    maps = WritableMaps()
    with pytest.raises(ValueError, match="never shrunk"):
        maps.view(str(path), 4096)
    with pytest.raises(ValueError, match="never shrunk"):
        write_at(str(path), [(0, memoryview(b"y"))], 4096)
    assert path.stat().st_size == 8192
    assert len(maps.view(str(path), 8192)) == 8192 and len(maps.view(str(tmp_path / "new"), 100)) == 100
    maps.close()
    with open(path, "rb") as f:
        held = mmap.mmap(f.fileno(), 8192, access=mmap.ACCESS_READ)
    write_whole(str(path), [(0, memoryview(b"z" * 10))], 10)
    assert path.read_bytes() == b"z" * 10 and held[:] == b"x" * 8192
    held.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_run_folders_nobody_owns_are_found_and_cleared(tmp_path):
    """A lease left by a job killed before its first memory save (no process of it lives, no persister): orphaned
    once it is older than the grace, and cleared; a lease of a live process, a folder changed within the grace, and
    a folder whose persister holds its lock are owned; a folder holding a committed checkpoint is told apart (a
    persister is started for it, not a removal)."""
    from hf_unified_ckpt.flash.layout import LEASE_FILE, LOCK_FILE, RUN_FILE, TIER_FOLDER, write_record
    from hf_unified_ckpt.flash.orphans import GRACE, clear, holds_checkpoints, orphaned_runs
    from hf_unified_ckpt.store.node import Lock

    tier = tmp_path / TIER_FOLDER
    old = time.time() - 2 * GRACE
    for name, pid in (("killed", _dead_pid()), ("alive", os.getpid()), ("fresh", _dead_pid()),
                      ("served", _dead_pid()), ("with-checkpoint", _dead_pid())):
        (tier / name / "members").mkdir(parents=True)
        write_record(str(tier / name / LEASE_FILE), {"job": name, "pids": [pid], "ended": False})
    (tier / "with-checkpoint" / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (tier / "with-checkpoint" / "checkpoints" / "checkpoint-2" / "unified_checkpoint.json").write_text("{}")
    write_record(str(tier / "with-checkpoint" / RUN_FILE), {"durable_root": str(tmp_path / "out")})
    lock = Lock(str(tier / "served" / LOCK_FILE))
    assert lock.acquire()
    for name in ("killed", "alive", "served", "with-checkpoint"):
        for root, dirs, files in os.walk(tier / name):
            for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.utime(entry, (old, old))
    try:
        orphans = orphaned_runs(str(tmp_path))
    finally:
        lock.release()
    assert [os.path.basename(r) for r in orphans] == ["killed", "with-checkpoint"]
    assert not holds_checkpoints(orphans[0])
    clear(orphans[0])
    assert not (tier / "killed").exists()


def test_a_new_run_clears_a_lease_left_before_the_first_memory_save(tmp_path):
    """The start of any run (`FlashTier.open`, one process) clears another run's folder that a killed job left
    with only its lease, and keeps its own."""
    from hf_unified_ckpt.flash.layout import LEASE_FILE, TIER_FOLDER, run_folder, write_record
    from hf_unified_ckpt.options import parse_flash
    from hf_unified_ckpt.flash.tier import FlashTier

    memory = tmp_path / "memory"
    stale = memory / TIER_FOLDER / "other-run-0123456789ab"
    stale.mkdir(parents=True)
    write_record(str(stale / LEASE_FILE), {"job": "x", "pids": [_dead_pid()], "ended": False})
    old = time.time() - 3600
    os.utime(stale / LEASE_FILE, (old, old))
    os.utime(stale, (old, old))
    tier = FlashTier(parse_flash(memory_dir=str(memory)), str(tmp_path / "out"))
    tier.open()
    try:
        assert not stale.exists()
        assert os.path.isfile(os.path.join(run_folder(str(memory), str(tmp_path / "out")), LEASE_FILE))
    finally:
        tier.close()
