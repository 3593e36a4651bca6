"""The storage seam (`hf_unified_ckpt.store`): the same save, verify, load, layout and rotation code runs on a local
folder (`LocalStore`: in-place shared files, staged + renamed) and on `memory://` (`FsspecStore`: whole files, written
in place, committed by the manifest written last, removed manifest first), with byte-identical results; faults on
either store never leave a folder that is taken for complete; a `PersistJob` is plain data that another process
runs to the same bytes; references are strings that `pathlib` would mangle."""

from __future__ import annotations

import dataclasses
import errno
import json
import multiprocessing
import os
import pickle
import threading
import uuid
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_unified_ckpt.checkpoint.save.saving as save_module
import hf_unified_ckpt.store.local as local_store_module
from support.env import THREADS, pin_threads
from support.faults import record_fault
from support.faulty_store import injected, recording
from hf_unified_ckpt.checkpoint.write.aggregating import AggregatingWriter
from hf_unified_ckpt.checkpoint.save.async_save import AsyncSaver
from hf_unified_ckpt.engines.replicated import ReplicatedEngine
from hf_unified_ckpt.store.node import host_name
from hf_unified_ckpt.errors import CorruptCheckpointError, UnifiedCheckpointError
from hf_unified_ckpt.checkpoint.folder.layout import UNIFIED, UNIFIED_INCOMPLETE, detect_layout, newest_complete
from hf_unified_ckpt.checkpoint.load.loading import load_checkpoint, verify_checkpoint
from hf_unified_ckpt.options import UnifiedCheckpointOptions
from hf_unified_ckpt.checkpoint.save.snapshot import Snapshots
from hf_unified_ckpt.checkpoint.folder.retention import rotate_checkpoints
from hf_unified_ckpt.checkpoint.save.saving import (SaveRequest, Staging, conclude, open_staging, raise_if_failed,
                                  save_checkpoint)
from hf_unified_ckpt.checkpoint.folder.commit import WRITER_MARK, list_checkpoints
from hf_unified_ckpt.checkpoint.folder.manifest import MANIFEST_NAME
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader
from hf_unified_ckpt.checkpoint.write.memory_tier import MemoryTierWriter
from hf_unified_ckpt.checkpoint.write.multipart import MultipartWriter
from hf_unified_ckpt.checkpoint.write.writer import PlacesSnapshots, SharedFileWriter, WholeFileWriter
from hf_unified_ckpt.format.parts import VERIFY_BLOCK
from hf_unified_ckpt.store import (FsspecStore, LocalStore, S3Store, canonical, join, local_paths_of, multipart_of,
                                   name_of, parent_of, positional_writes_of, register_store, scheme_of, sibling,
                                   store_for)

#: Several files per component: the model's 5 tensors (65, 13, 39, 3 and 77 floats) and their optimizer state.
OPTIONS = UnifiedCheckpointOptions(enabled=True, max_shard_size=200)
NAMES = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]


@pytest.fixture(autouse=True, scope="module")
def _pinned_threads():
    pin_threads()


# ---- a tiny model with uneven parameter sizes -------------------------------------------------------------------

def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 13), nn.Linear(13, 3), nn.Embedding(11, 7))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model, opt, k: int) -> None:
    """One optimizer step on fixed pseudo-random gradients (`k` seeds them)."""
    g = torch.Generator().manual_seed(1000 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Copies of the weights and of every optimizer state tensor, by name."""
    out = {f"model/{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = dict(zip([id(p) for p in model.parameters()], [n for n, _ in model.named_parameters()]))
    for p, st in opt.state.items():
        for key, value in st.items():
            out[f"optim/{names[id(p)]}/{key}"] = value.detach().clone()
    return out


def _assert_equal_states(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert differ == []


def _save(model, opt, final: str, step: int) -> str:
    """A synchronous save of the current state (a fresh engine: nothing cached from an earlier save)."""
    small = {"trainer_state.json": json.dumps({"global_step": step}).encode()}
    return save_checkpoint(ReplicatedEngine(model, opt), SaveRequest(final, step, OPTIONS, show_progress=False), small)


def _load(final: str) -> dict[str, torch.Tensor]:
    """Verify `final` and load it into a fresh, differently initialised model and optimizer; their state."""
    model, opt = _model_and_optimizer(seed=99)
    manifest = verify_checkpoint(final)
    groups = load_checkpoint(final, ReplicatedEngine(model, opt), manifest, OPTIONS)
    assert groups == [NAMES]
    return _state(model, opt)


def _files(folder: str) -> dict[str, bytes]:
    """Every file directly in `folder`, name -> bytes, read through its store."""
    store = store_for(folder)
    return {n: store.read(join(folder, n)) for n, size in sorted(store.list(folder).items()) if size is not None}


def _complete_steps(run: str) -> list[int]:
    return [step for step, path in list_checkpoints(run) if detect_layout(path).complete]


def _memory_root() -> str:
    return f"memory://t-{uuid.uuid4().hex}"


@pytest.fixture(params=["memory", "s3"])
def remote_run(request):
    """A run on each store without local paths: memory:// and a fresh prefix on the real S3 server."""
    if request.param == "s3":
        yield join(request.getfixturevalue("s3_bucket"), "run")
        return
    yield from memory_run.__wrapped__()


@pytest.fixture
def memory_run():
    root = _memory_root()
    yield join(root, "run")
    store_for(root).remove(root)
    assert not store_for(root).is_folder(root)


@pytest.fixture(params=["local", "memory", "s3"])
def run_ref(request, tmp_path):
    """A run folder on each store: a local path, a `memory://` URL (removed afterwards) or a prefix in a fresh bucket
    of the real S3 server."""
    if request.param == "local":
        yield str(tmp_path / "run")
        return
    if request.param == "s3":
        yield join(request.getfixturevalue("s3_bucket"), "run")
        return
    root = _memory_root()
    yield join(root, "run")
    store_for(root).remove(root)


def _kind(run: str) -> str:
    return scheme_of(run) or "local"


def _in_place(run: str) -> bool:
    """Whether the store writes a save in place, committed by its manifest (no rename): memory://, s3://."""
    return _kind(run) != "local"


# ---- 1. the round trip through memory:// ------------------------------------------------------------------------

def test_remote_round_trip_is_byte_identical_to_local(remote_run, tmp_path):
    run = remote_run
    store = store_for(run)
    assert positional_writes_of(store) is None and local_paths_of(store) is None
    assert not store.capabilities.atomic_rename and store.stage(join(run, "checkpoint-1")) == join(run, "checkpoint-1")
    model, opt = _model_and_optimizer()
    states = {}
    for step in (1, 2, 3):
        _train_step(model, opt, step)
        final = join(run, f"checkpoint-{step}")
        assert _save(model, opt, final, step) == final
        states[step] = _state(model, opt)
    local = _save(model, opt, str(tmp_path / "run" / "checkpoint-3"), 3)  # the same state, into a local folder

    assert store.list(run) == {"checkpoint-1": None, "checkpoint-2": None, "checkpoint-3": None}
    three = join(run, "checkpoint-3")
    files = _files(three)
    shards = [n for n in files if n.endswith(".safetensors")]
    assert sum(n.startswith("model-") for n in shards) >= 3 and sum(n.startswith("optimizer-") for n in shards) >= 3
    assert not [n for n in files if n.startswith(".")]  # no writer marks left: the folder holds the checkpoint only

    # the same bytes as the local save, file for file: the memory save streamed whole files (WholeFileWriter), the
    # s3 one uploaded parts (MultipartWriter), the local one wrote in place (SharedFileWriter); none writes paths or
    # times into a file. The manifests are the same too, but for what s3 adds: its parts and block CRCs
    local_files = _files(local)
    assert {n: b for n, b in files.items() if n != MANIFEST_NAME} == \
        {n: b for n, b in local_files.items() if n != MANIFEST_NAME}
    manifest = json.loads(files[MANIFEST_NAME])
    uploaded = _kind(run) == "s3"
    assert manifest["saved_by"].pop("upload", None) is not None if uploaded else "upload" not in manifest["saved_by"]
    for name, entry in manifest["files"].items():  # tensor files are uploaded in parts, small files put whole
        assert ("parts" in entry and "blocks" in entry) is (uploaded and name.endswith(".safetensors")), name
        entry.pop("parts", None), entry.pop("blocks", None)
    assert manifest == json.loads(local_files[MANIFEST_NAME])
    assert sorted(manifest["files"]) == sorted(n for n in files if n != MANIFEST_NAME)
    assert all(manifest["files"][n]["size"] == len(files[n]) for n in manifest["files"])

    for step in (1, 2, 3):
        final = join(run, f"checkpoint-{step}")
        assert verify_checkpoint(final)["global_step"] == step
        layout = detect_layout(final)
        assert (layout.kind, layout.complete, layout.global_step, layout.path) == (UNIFIED, True, step, final)
    newest = newest_complete(run)
    assert (newest.path, newest.global_step) == (three, 3)

    _assert_equal_states(_load(three), states[3])
    _assert_equal_states(_load(join(run, "checkpoint-1")), states[1])

    # lazy reads: whole tensors, and a row slice that reads exactly its rows' bytes (one ranged read)
    calls = []
    weights = {n[len("model/"):]: t for n, t in states[3].items() if n.startswith("model/")}
    with injected(recording(calls, "read"), ref=run), ComponentReader(three, "model") as reader:
        assert sorted(reader.keys()) == sorted(NAMES)
        assert all(torch.equal(reader.get(n), weights[n]) for n in NAMES)
        embedding = reader.get_slice("2.weight")
        assert embedding.get_shape() == [11, 7] and embedding.get_dtype() == "F32"
        calls.clear()
        assert torch.equal(embedding[3:8], weights["2.weight"][3:8])
        reads = [(c.ref, c.arg(1, "offset", 0), c.arg(2, "length")) for c in calls]
        if uploaded:  # read by whole blocks, each checked against its CRC (here the file is one block, kept)
            assert all(offset % VERIFY_BLOCK == 0 for _, offset, _ in reads) and len(reads) <= 1
        else:
            assert [length for _, _, length in reads] == [5 * 7 * 4]
        assert torch.equal(embedding[3:8, 2:5], weights["2.weight"][3:8, 2:5])
        assert torch.equal(embedding[-2:], weights["2.weight"][-2:])
        assert embedding[8:3].shape == (0, 7)
        assert torch.equal(embedding[1:9:3], weights["2.weight"][1:9:3])
        assert torch.equal(reader.get_slice("0.bias")[4:11], weights["0.bias"][4:11])

    assert rotate_checkpoints(run, limit=1) == [join(run, "checkpoint-1"), join(run, "checkpoint-2")]
    assert store.list(run) == {"checkpoint-3": None}
    assert rotate_checkpoints(run, limit=1) == []
    assert newest_complete(run).global_step == 3 and verify_checkpoint(three)["global_step"] == 3


def test_memory_writes_whole_files_and_local_writes_in_place(memory_run, tmp_path):
    """Which writer a save uses follows the store's capabilities (not the scheme), and on a folder every rank sees
    the options: files in pieces through aggregators where they would have many writers (in place otherwise), or
    always in place (`in_place`)."""
    model, opt = _model_and_optimizer()
    engine = ReplicatedEngine(model, opt)
    in_place = dataclasses.replace(OPTIONS, aggregation=dataclasses.replace(OPTIONS.aggregation, mode="never"))
    for final, options, writer in ((join(memory_run, "checkpoint-1"), OPTIONS, WholeFileWriter),
                                   (str(tmp_path / "checkpoint-1"), in_place, SharedFileWriter),
                                   (str(tmp_path / "checkpoint-1"), OPTIONS, AggregatingWriter)):
        staging = open_staging(final)
        try:
            assert staging.in_place == (writer is not WholeFileWriter)
            chosen = save_module.choose_writer(staging, SaveRequest(final, 1, options))
            assert type(chosen) is writer
            assert writer is not AggregatingWriter or type(chosen.in_place) is SharedFileWriter  # the rest's writer
        finally:
            save_module.discard(staging.path)
        assert not store_for(final).is_folder(staging.path)


def test_only_the_memory_tiers_writer_places_snapshots(tmp_path):
    """A save into the memory tier (`SaveRequest.spare`) writes in place through its own strategy, the one that
    places snapshots straight into the files (`PlacesSnapshots`, which `snapshot.Snapshots` asks for); no other
    strategy passes for one, the multipart uploads' included (composed, not a kind of in-place writer)."""
    final = str(tmp_path / "checkpoint-1")
    staging = open_staging(final)
    try:
        chosen = save_module.choose_writer(staging, SaveRequest(final, 1, OPTIONS, spare=str(tmp_path / "spare")))
        assert type(chosen) is MemoryTierWriter and isinstance(chosen, PlacesSnapshots)
        assert type(chosen.in_place) is SharedFileWriter
    finally:
        save_module.discard(staging.path)
    others = (SharedFileWriter(0), WholeFileWriter(), MultipartWriter(0), AggregatingWriter(0, OPTIONS.aggregation))
    assert not any(isinstance(writer, PlacesSnapshots) for writer in others)


# ---- 2. faults through the same code, on both stores ------------------------------------------------------------

def _first_checkpoint(run: str):
    """checkpoint-1, saved and complete; the model and optimizer after a second step; step 1's state."""
    model, opt = _model_and_optimizer()
    _train_step(model, opt, 1)
    _save(model, opt, join(run, "checkpoint-1"), 1)
    state = _state(model, opt)
    _train_step(model, opt, 2)
    return model, opt, state


def test_full_disk_mid_save_commits_nothing(run_ref, monkeypatch):
    name = f"ENOSPC mid-save ({_kind(run_ref)})"
    record_fault(name, survived=False)
    run = run_ref
    model, opt, state1 = _first_checkpoint(run)
    store, two = store_for(run), join(run, "checkpoint-2")
    tensor_files = []

    def failing(real):
        def write(ref, *args, **kwargs):
            if ref.endswith(".safetensors"):
                if ref not in tensor_files:
                    tensor_files.append(ref)
                if len(tensor_files) == 2:
                    raise OSError(errno.ENOSPC, "No space left on device", ref)
            return real(ref, *args, **kwargs)
        return write

    with monkeypatch.context() as m:  # whichever the store's writer uses: whole files (memory), in place (local),
        m.setattr(store, "write_whole", failing(store.write_whole))  # parts of uploads (s3)
        if positional_writes_of(store) is not None:
            m.setattr(store, "write_at", failing(store.write_at))
        if multipart_of(store) is not None:
            m.setattr(store, "write_part", failing(store.write_part))
        with pytest.raises(UnifiedCheckpointError, match="nothing was committed") as e:
            _save(model, opt, two, 2)
    assert "No space left on device" in str(e.value) and "checkpoint-2" in str(e.value)
    assert len(tensor_files) >= 2
    assert multipart_of(store) is None or store.abort_uploads(run) == []  # the failed save aborted its uploads
    assert store.list(run) == {"checkpoint-1": None}  # no checkpoint-2 and no staging folder either
    assert not detect_layout(two).complete and not store.is_folder(two)
    assert newest_complete(run).global_step == 1 and _complete_steps(run) == [1]
    _assert_equal_states(_load(join(run, "checkpoint-1")), state1)
    # the next save of the step succeeds
    _save(model, opt, two, 2)
    assert store.list(run) == {"checkpoint-1": None, "checkpoint-2": None}
    assert verify_checkpoint(two)["global_step"] == 2 and newest_complete(run).global_step == 2
    record_fault(name, survived=True)


class Killed(BaseException):
    """What a kill looks like to the save: nothing catches it, nothing cleans up after it (as with SIGKILL)."""


@pytest.mark.parametrize("how", ["killed", "error"])
def test_save_cut_before_the_manifest_is_never_picked(run_ref, how, monkeypatch):
    name = f"save cut before the manifest, {how} ({_kind(run_ref)})"
    record_fault(name, survived=False)
    run = run_ref
    model, opt, state1 = _first_checkpoint(run)
    store, two = store_for(run), join(run, "checkpoint-2")

    def no_manifest(*args, **kwargs):
        raise Killed() if how == "killed" else OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(save_module, "write_manifest", no_manifest)
        with pytest.raises(Killed if how == "killed" else UnifiedCheckpointError):
            _save(model, opt, two, 2)
    layout = detect_layout(two)
    assert not layout.complete and not layout.committed
    if how == "error":  # cleaned up: nothing of the save is left
        assert store.list(run) == {"checkpoint-1": None}
    elif _in_place(run):  # written in place: checkpoint-2 holds every tensor file, but no manifest
        assert layout.kind == UNIFIED_INCOMPLETE and "unified_checkpoint.json is missing" in layout.reason
        left = store.list(two)
        assert MANIFEST_NAME not in left and sum(n.endswith(".safetensors") for n in left) >= 6
        with pytest.raises(FileNotFoundError):
            verify_checkpoint(two)
    else:  # staged aside: no checkpoint-2 at all, only the hidden staging folder
        left = sorted(store.list(run))
        assert len(left) == 2 and left[1] == "checkpoint-1", left
        assert left[0].startswith(f".checkpoint-2.{host_name()}.{os.getpid()}.") and left[0].endswith(".incomplete")
    assert newest_complete(run).global_step == 1 and _complete_steps(run) == [1]
    assert rotate_checkpoints(run, limit=1) == []  # an uncommitted folder is neither counted nor deleted
    _assert_equal_states(_load(join(run, "checkpoint-1")), state1)
    # the next save of the same step replaces what was left and commits
    _save(model, opt, two, 2)
    assert store.list(run) == {"checkpoint-1": None, "checkpoint-2": None}
    assert sorted(store.list(two)) == sorted(json.loads(store.read(join(two, MANIFEST_NAME)))["files"]) + [MANIFEST_NAME]
    assert verify_checkpoint(two)["global_step"] == 2 and newest_complete(run).global_step == 2
    record_fault(name, survived=True)


DAMAGE = {
    "truncated": (lambda data: data[:-100], "truncated"),
    "cut inside its header": (lambda data: data[:20], "truncated"),
    "bit flip": (lambda data: data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "does not match"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_is_named_by_verify(run_ref, damage):
    name = f"{damage} shard ({_kind(run_ref)})"
    record_fault(name, survived=False)
    run = run_ref
    _first_checkpoint(run)
    one, store = join(run, "checkpoint-1"), store_for(run)
    victim = sorted(n for n in store.list(one) if n.startswith("optimizer-") and n.endswith(".safetensors"))[1]
    change, words = DAMAGE[damage]
    store.put(join(one, victim), change(store.read(join(one, victim))))
    with pytest.raises(CorruptCheckpointError) as e:
        verify_checkpoint(one)
    assert victim in str(e.value) and words in str(e.value) and "Nothing was loaded" in str(e.value)
    assert str(e.value).count(".safetensors:") == 1  # only the damaged file is named
    # a wrong size is structural: the folder is no longer complete; a flipped bit only verify's checksums find
    assert detect_layout(one).complete is (damage == "bit flip")
    record_fault(name, survived=True)


def _interrupt_retire(run: str, m) -> None:
    """Make the next checkpoint removal stop half-way, as a kill would: memory:// after its manifest was deleted
    (the second `FsspecStore.remove` of `retire`), a local folder after it was renamed aside (its deletion)."""
    if _in_place(run):
        cls = type(store_for(run))
        real, calls = cls.remove, []

        def remove(self, ref):
            calls.append(ref)
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error (injected)", ref)
            return real(self, ref)

        m.setattr(cls, "remove", remove)
    else:
        def rmtree(path, *args, **kwargs):
            raise OSError(errno.EIO, "Input/output error (injected)", path)

        m.setattr(local_store_module.shutil, "rmtree", rmtree)


def test_rotation_cut_half_way_leaves_nothing_that_is_picked(run_ref, monkeypatch):
    name = f"rotation cut half-way ({_kind(run_ref)})"
    record_fault(name, survived=False)
    run = run_ref
    model, opt, _ = _first_checkpoint(run)
    two = join(run, "checkpoint-2")
    _save(model, opt, two, 2)
    state2 = _state(model, opt)
    store, one = store_for(run), join(run, "checkpoint-1")
    with monkeypatch.context() as m:
        _interrupt_retire(run, m)
        with pytest.raises(OSError, match="injected"):
            rotate_checkpoints(run, limit=1)
    if _in_place(run):  # checkpoint-1 is still there, its manifest gone
        assert store.is_folder(one) and MANIFEST_NAME not in store.list(one)
        assert detect_layout(one).kind == UNIFIED_INCOMPLETE
    else:  # renamed aside before anything was deleted
        aside, rest = sorted(store.list(run))
        assert rest == "checkpoint-2" and aside.startswith(".checkpoint-1.") and aside.endswith(".deleting"), aside
    assert not detect_layout(one).complete
    assert newest_complete(run).global_step == 2 and _complete_steps(run) == [2]
    assert rotate_checkpoints(run, limit=1) == []  # what is left is not a committed checkpoint: not rotated again
    _assert_equal_states(_load(two), state2)
    store.remove(two)  # even with no other checkpoint left, the half-removed one is never picked
    assert newest_complete(run) is None
    record_fault(name, survived=True)


def test_failed_whole_file_write_leaves_no_file(remote_run):
    """`FsspecStore.write_whole`: a write that fails (the ranges' producer raises, or they do not fill the file)
    leaves no file under its name."""
    store = store_for(remote_run)
    ref = join(remote_run, "x.safetensors")

    def ranges():
        yield 0, memoryview(b"abcd")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        store.write_whole(ref, ranges(), 8)
    assert store.size(ref) is None
    with pytest.raises(ValueError, match="the ranges end at 4"):
        store.write_whole(ref, [(0, memoryview(b"abcd"))], 8)
    assert store.size(ref) is None
    assert store.write_whole(ref, [(0, memoryview(b"abcd")), (4, memoryview(b"efgh"))], 8)[1][:2] == (4, 4)
    assert store.read(ref) == b"abcdefgh" and store.read(ref, 2, 3) == b"cde"


@pytest.mark.parametrize("size", [0, 5, 8, 13])
def test_read_chunks_streams_a_file_in_order_on_every_store(run_ref, size):
    """`Store.read_chunks` (what the persister streams a memory file with): consecutive ranges of `chunk` bytes,
    the last shorter, one empty range for an empty file; a local file's ranges are views of one mapping, which is
    released once the caller drops them (the file can then be removed)."""
    store = store_for(run_ref)
    ref = join(run_ref, f"f{size}.bin")
    data = bytes(range(size))
    store.make_folder(run_ref)
    store.put(ref, data)
    got = [(offset, bytes(view)) for offset, view in store.read_chunks(ref, 4)]
    want = [(o, data[o:o + 4]) for o in range(0, size, 4)] or [(0, b"")]
    assert got == want
    store.remove(ref)
    assert store.size(ref) is None
    with pytest.raises(FileNotFoundError):
        list(store.read_chunks(ref, 4))


# ---- 3. the persist job is data ---------------------------------------------------------------------------------

def _pin_child_threads() -> None:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


def _run_pickled_job(blob: bytes):
    """In a spawned process: unpickle a `PersistJob` and run it."""
    torch.set_num_threads(THREADS)
    job = pickle.loads(blob)
    return job.run(), os.getpid(), torch.get_num_threads()


def _build_job(model, opt, final: str, step: int):
    """What `AsyncSaver.start` builds (world size 1): the training-thread half of the save (`saving.begin`: the
    staging folder, the plan, the strategy, the assembled files) and the job, filled with host copies by
    `snapshot.Snapshots.take`."""
    engine = ReplicatedEngine(model, opt)
    small = {"trainer_state.json": json.dumps({"global_step": step}).encode()}
    started = save_module.begin(engine, SaveRequest(final, step, OPTIONS, show_progress=False), small)
    assert Snapshots().take(engine, started.job, started.files) == (True, started.job)
    return started.job, started


def test_persist_job_runs_alike_in_a_spawned_process_and_on_a_thread(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    _train_step(model, opt, 1)
    state = _state(model, opt)
    a, started_a = _build_job(model, opt, str(tmp_path / "a" / "checkpoint-5"), 5)
    b, started_b = _build_job(model, opt, str(tmp_path / "b" / "checkpoint-5"), 5)
    plan_a, staging_a, staging_b = started_a.plan, started_a.staging, started_b.staging
    assert a.files and len(a.files) == len(plan_a.files) and a.folder == staging_a.path != b.folder
    blob = pickle.dumps(a)
    _train_step(model, opt, 2)  # the live state moves on: the job holds its own copies

    monkeypatch.setenv("OMP_NUM_THREADS", str(THREADS))  # what the spawned interpreter starts with
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_pin_child_threads) as pool:
        records_a, pid, threads = pool.submit(_run_pickled_job, blob).result(timeout=120)
    assert pid != os.getpid() and threads == THREADS

    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("records", b.run()))
    thread.start()
    thread.join(timeout=120)
    records_b = result["records"]

    def key(r):
        return type(r).__name__, r.name, getattr(r, "offset", 0)

    assert sorted(records_a, key=key) == sorted(records_b, key=key)
    assert {r.name for r in records_a} == {f.name for f in plan_a.files} | {"trainer_state.json"}
    files_a, files_b = _files(staging_a.path), _files(staging_b.path)
    marks = {n for n in files_a if n.startswith(WRITER_MARK)}
    assert marks == {n for n in files_b if n.startswith(WRITER_MARK)} == {f"{WRITER_MARK}0"}  # open_staging's
    assert {n: d for n, d in files_a.items() if n not in marks} == {n: d for n, d in files_b.items() if n not in marks}

    # both conclude into complete checkpoints, identical to each other and to a synchronous save of that state
    for started, records in ((started_a, records_a), (started_b, records_b)):
        raise_if_failed(conclude(started, (True, records)), started.staging)
    model_c, opt_c = _model_and_optimizer()
    _train_step(model_c, opt_c, 1)
    sync = _save(model_c, opt_c, str(tmp_path / "c" / "checkpoint-5"), 5)
    assert _files(staging_a.final) == _files(staging_b.final) == _files(sync)
    _assert_equal_states(_load(staging_a.final), state)


def test_async_save_on_remote_stores(remote_run):
    """`AsyncSaver` runs its job to memory:// and s3:// too: the snapshot is taken before the optimizer moves on."""
    model, opt = _model_and_optimizer()
    _train_step(model, opt, 1)
    saver, final = AsyncSaver(), join(remote_run, "checkpoint-1")
    assert saver.start(ReplicatedEngine(model, opt), SaveRequest(final, 1, OPTIONS, show_progress=False),
                       {"trainer_state.json": b"{}"}) == final
    state = _state(model, opt)
    saver.wait_for_snapshot()
    _train_step(model, opt, 2)
    saver.wait()
    assert newest_complete(remote_run).global_step == 1
    _assert_equal_states(_load(final), state)


# ---- 4. references ----------------------------------------------------------------------------------------------

def test_local_references(tmp_path):
    assert join("/a/b", "c") == "/a/b/c" and join(Path("/a/b"), "c", "d") == "/a/b/c/d"
    assert join("/a/b", "c/d.json") == "/a/b/c/d.json"
    assert name_of("/a/b/checkpoint-3") == "checkpoint-3" and name_of("/a/b/checkpoint-3/") == "checkpoint-3"
    assert name_of(Path("/a/b")) == "b"
    assert parent_of("/a/b/checkpoint-3") == "/a/b" and parent_of("/a/b/checkpoint-3/") == "/a/b"
    assert parent_of("checkpoint-3") == "" and sibling("/a/b/c", "d") == "/a/b/d"
    assert scheme_of("/a/b") == "" and canonical(str(tmp_path / "x" / ".." / "y")) == str((tmp_path / "y").resolve())
    assert type(store_for("/a/b")) is LocalStore and store_for("/a/b") is store_for(tmp_path)
    assert type(store_for("file:///a/b")) is LocalStore
    assert store_for("file://" + str(tmp_path)).is_folder("file://" + str(tmp_path))


def test_url_references_are_not_mangled():
    assert join("memory://a/b", "c") == "memory://a/b/c" == join("memory://a/b/", "c")
    assert join("memory://a", "b", "c.json") == "memory://a/b/c.json"
    assert name_of("memory://a/b") == "b" == name_of("memory://a/b/")
    assert parent_of("memory://a/b") == "memory://a" == parent_of("memory://a/b/")
    assert parent_of("memory://a") == "memory://"
    assert sibling("memory://run/checkpoint-1", "checkpoint-2") == "memory://run/checkpoint-2"
    assert canonical("memory://a/b/") == "memory://a/b" and scheme_of("MEMORY://a") == "memory"
    # pathlib turns a URL into a path of a folder named "s3:" (and loses the scheme's //): the helpers do not
    assert str(Path("s3://b/x")) == "s3:/b/x" and str(Path("s3://b") / "x") == "s3:/b/x"
    assert str(Path("s3://b/x").parent) == "s3:/b"
    assert join("s3://b", "x") == "s3://b/x" and parent_of("s3://b/x") == "s3://b" and name_of("s3://b/x") == "x"
    assert parent_of("s3://b") == "s3://" and scheme_of("s3://b/x") == "s3"


def test_unknown_scheme_is_refused_by_name():
    with pytest.raises(ValueError) as e:
        store_for("hdfs://x")
    message = str(e.value)
    assert "'hdfs://x'" in message and "scheme 'hdfs'" in message and "register a store for hdfs://" in message
    assert "memory://" in message and "s3://" in message and "local paths" in message
    for url in ("gs://bucket/run", "az://container/run", "abfs://c/run"):  # named: not supported yet, use s3://
        with pytest.raises(ValueError, match=r"not supported yet: only s3:// object storage is") as e:
            store_for(url)
        assert f"{scheme_of(url)}://" in str(e.value)
    memory = store_for("memory://x")
    assert type(memory) is FsspecStore and memory is store_for("memory://y/z")


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_store_primitives_agree(kind, tmp_path, request):
    """What the algorithms above rely on, the same on every store (S3 has no empty folders: a prefix exists while
    an object lies under it)."""
    root = {"local": lambda: str(tmp_path), "memory": _memory_root,
            "s3": lambda: request.getfixturevalue("s3_bucket")}[kind]()
    store, folders = store_for(root), kind != "s3"
    try:
        folder = join(root, "f")
        assert store.list(folder) == {} and store.size(join(folder, "x")) is None and not store.is_folder(folder)
        with pytest.raises(FileNotFoundError):
            store.read(join(folder, "x"))
        store.make_folder(join(folder, "sub"))
        store.put(join(folder, "x"), b"0123456789")
        store.put(join(folder, "x"), b"abcdefghij")  # the last put wins
        assert store.list(folder) == {**({"sub": None} if folders else {}), "x": 10} and store.is_folder(folder)
        assert store.size(join(folder, "x")) == 10 and store.size(join(folder, "sub")) is None
        assert store.read(join(folder, "x"), 3, 4) == b"defg" and store.read(join(folder, "x"), 7) == b"hij"
        assert store.read(join(folder, "x"), 3, 0) == b""
        assert store.crc32(join(folder, "x"), 2, 5) == zlib.crc32(b"cdefg")
        store.put(join(folder, "m"), b"first", exclusive=True)  # the manifest's commit: only if absent
        with pytest.raises(FileExistsError):
            store.put(join(folder, "m"), b"second", exclusive=True)
        assert store.read(join(folder, "m")) == b"first"
        store.remove(join(folder, "m"))
        store.move(join(folder, "x"), join(folder, "y"))
        assert store.list(folder) == {**({"sub": None} if folders else {}), "y": 10}
        assert store.crc32(join(folder, "y"), 0, 11) is None  # beyond its end
        store.remove(join(folder, "missing"))  # nothing to remove: no error
        store.retire(folder, "y")
        assert not store.is_folder(folder) and store.list(root) == {}
    finally:
        if kind == "memory":
            store.remove(root)


def test_ranged_reads_check_block_crcs_and_keep_the_last_block(memory_run):
    """`RangedFile` with a block table: each read is widened to whole blocks, every block fetched is checked, the
    last block read serves the next read that starts in it, and a damaged block is refused by name."""
    import zlib

    from hf_unified_ckpt.checkpoint.folder.ranged import RangedFile

    store = store_for(memory_run)
    header = json.dumps({"t": {"dtype": "U8", "shape": [200], "data_offsets": [0, 200]}}).encode()
    header += b" " * (-len(header) % 8)
    data = len(header).to_bytes(8, "little") + header + bytes(range(200))
    ref = join(memory_run, "x.safetensors")
    store.put(ref, data)
    block = 16
    table = {"size": block, "crc32": [f"{zlib.crc32(data[i:i + block]):08x}" for i in range(0, len(data), block)]}
    f = RangedFile(store, ref, table)
    start = len(data) - 200
    for a, b in [(5, 40), (40, 41), (41, 90), (0, 200), (199, 200)]:
        assert bytes(f.read(start + a, b - a)) == data[start + a:start + b]
    g = RangedFile(store, ref, table)
    assert bytes(g.read(start + 3, 20)) == data[start + 3:start + 23]
    first = g.fetched
    assert first == ((start + 22) // block - (start + 3) // block + 1) * block  # whole blocks
    assert bytes(g.read(start + 22, 1)) == data[start + 22:start + 23] and g.fetched == first  # the kept block
    damaged = bytearray(data)
    damaged[start + 100] ^= 1
    store.put(ref, bytes(damaged))
    h = RangedFile(store, ref, table)
    assert bytes(h.read(start, 50)) == data[start:start + 50]  # blocks before the damage still read
    with pytest.raises(CorruptCheckpointError, match=r"x.safetensors: bytes \[\d+, \d+\) do not match the CRC-32"):
        h.read(start + 90, 20)
    assert bytes(RangedFile(store, ref).read(start + 100, 1)) == bytes([100 ^ 1])  # without a table: unchecked


def test_exclusive_put_without_hard_links(tmp_path, monkeypatch):
    """A local filesystem without hard links (some network and FUSE mounts) still gets the manifest's
    put-if-absent: checked, then renamed."""
    from hf_unified_ckpt.store import local_io

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(local_io.os, "link", no_links)
    ref = str(tmp_path / "m.json")
    store_for(ref).put(ref, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        store_for(ref).put(ref, b"second", exclusive=True)
    assert store_for(ref).read(ref) == b"first" and sorted(os.listdir(tmp_path)) == ["m.json"]


def test_writable_maps_follow_a_file_through_renames_and_let_go_of_removed_ones(tmp_path):
    """The memory tier's mappings (`local_io.WritableMaps`): a file renamed (a spare file moved back into a save) is
    written through the mapping it already had, and its bytes are the file's; a removed file's mapping is released
    (its memory freed), and a new file is never written through an old file's mapping, even where the filesystem
    hands the old inode number to the new file; a larger size maps again, a smaller one is refused (never shrunk)."""
    from hf_unified_ckpt.store import LocalStore, WritableMaps

    store, maps = LocalStore(), WritableMaps()
    first = store.map_writable(str(tmp_path / "a"), 10_000, maps)
    first[:5] = b"hello"
    os.replace(tmp_path / "a", tmp_path / "b")
    again = store.map_writable(str(tmp_path / "b"), 10_000, maps)
    assert again.obj is first.obj and len(maps) == 1
    again[9_995:] = b"world"
    data = (tmp_path / "b").read_bytes()
    assert len(data) == 10_000 and data[:5] == b"hello" and data[-5:] == b"world"
    old = first.obj
    del first, again
    os.unlink(tmp_path / "b")
    other = store.map_writable(str(tmp_path / "c"), 10_000, maps)  # a new file (maybe the old inode number)
    other[:3] = b"new"
    assert other.obj is not old and (tmp_path / "c").read_bytes()[:3] == b"new"
    maps.prune()
    assert len(maps) == 1 and old.closed
    with pytest.raises(ValueError, match="never shrunk"):  # issue 47: a file that may be mapped is never shrunk
        store.map_writable(str(tmp_path / "c"), 4_000, maps)
    larger = store.map_writable(str(tmp_path / "c"), 12_000, maps)
    assert larger.obj is not other.obj and os.path.getsize(tmp_path / "c") == 12_000
    assert bytes(larger[:3]) == b"new" and len(maps) == 1
    del other, larger
    maps.close()
    assert len(maps) == 0


class _SubclassedS3(S3Store):
    """A store subclassed with nothing changed (a user's wrapper of S3Store)."""


class _PositionalMemory(FsspecStore):
    """A subclass that adds a capability its base lacks (never written through here)."""

    def write_at(self, ref, ranges, size, direct_io=False):
        raise NotImplementedError

    def block_size(self, ref):
        return 4096


def test_capability_flags_match_the_capability_protocols():
    """Every registered store, and subclasses (one that changes nothing, one that adds `write_at`), implements the
    `Store` protocol (`check_writable` and `close` included), and the flags the save and load choose from (in place,
    multipart, local paths) are exactly its capability protocols: multipart uploads (with a part size S3 accepts)
    and local paths; writable mappings only with local paths. No store carries stubs of a capability it lacks."""
    from hf_unified_ckpt.store import LocalPaths, MultipartUploads, PositionalWrites, Store, WritableMappings
    from hf_unified_ckpt.trainer.storage import is_remote

    register_store("subclassed-s3", _SubclassedS3)
    register_store("positional-memory", lambda scheme: _PositionalMemory("memory"))
    for ref in ("/x", "file:///x", "memory://x", "s3://bucket/x", "subclassed-s3://bucket/x", "positional-memory://x"):
        store = store_for(ref)
        sizes, staging = store.capabilities, Staging(ref, ref, 0, shared=True)
        multipart, positional = isinstance(store, MultipartUploads), isinstance(store, PositionalWrites)
        assert isinstance(store, Store), ref
        assert staging.multipart == (multipart and not positional), ref
        assert staging.in_place == (multipart or positional), ref
        assert is_remote(ref) != isinstance(store, LocalPaths), ref
        assert not isinstance(store, WritableMappings) or isinstance(store, LocalPaths), ref
        assert (sizes.part_size >= 2 * sizes.min_part_size > 0) if multipart else sizes.part_size == 0, ref
        assert not hasattr(store, "open_tensors"), ref
    assert store_for("subclassed-s3://b/x").capabilities == store_for("s3://b/x").capabilities
    assert Staging("positional-memory://x", "", 0, shared=True).in_place


def test_check_writable_and_close_on_every_store(run_ref):
    """`check_writable` writes and removes its probe (nothing left); `close` may be called twice."""
    store = store_for(run_ref)
    store.make_folder(run_ref)
    probe = join(run_ref, ".probe")
    store.check_writable(probe)
    assert store.size(probe) is None
    store.close()
    store.close()
