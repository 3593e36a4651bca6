"""Checkpoints straight into object storage, against a real S3 server (SeaweedFS on loopback, started by the
session: `conftest.s3_server`), with real DDP, DeepSpeed ZeRO-3 and FSDP2 (gloo, CPU).

The model (`llama_s3`) has 12 MB embeddings, so at 2 ranks each rank holds more than S3's 5 MiB smallest part of
them under ZeRO-3 and FSDP2 and uploads those parts itself. Every run of 2 ranks shares one launch. Tolerance when
the world size or engine changes: fp32 reduction order, as in test_resume_equivalence.py (LOSS_RTOL = STATE_ATOL =
1e-5); the same engine and world size must be bit-exact.
"""

import json
import subprocess
import sys

import pytest
import torch

from support.specs import BEST, loop_spec, run_spec
from support.states import assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.checkpoint.folder.manifest import MANIFEST_NAME
from hf_unified_ckpt.format.parts import VERIFY_BLOCK
from hf_unified_ckpt.store import join, listing, read_bytes, store_for

LOSS_RTOL = STATE_ATOL = 1e-5
# DDP: files below 64 MiB per writer are not split between ranks; 12 MB files give each rank files of its own
ENGINES = {"ddp": {"overrides": {"unified_checkpoint_max_shard_size": "12MB"}}, "z3": {"zero": 3}, "f2": {"fsdp": 2}}
MIB = 2**20


def _spec(tmp, bucket, kind, tag, resume=None, **extra):
    engine = ENGINES.get(kind, {})
    overrides = {"unified_checkpoint_storage": join(bucket, tag), **engine.get("overrides", {}),
                 **extra.pop("overrides", {})}
    spec = {**engine, "model": "llama_s3", "overrides": overrides, **extra,
            "output_dir": str(tmp / tag), "result": str(tmp / f"{tag}.pt")}
    if resume:
        spec["resume"] = join(bucket, resume, "checkpoint-3")
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_session_bucket):
    import uuid

    bucket = join(s3_session_bucket, f"engines-{uuid.uuid4().hex[:8]}")
    tmp = tmp_path_factory.mktemp("s3")
    savers = [_spec(tmp, bucket, e, e) for e in ENGINES]
    savers.append(_spec(tmp, bucket, "z3", "z3a", overrides={"unified_checkpoint_config": "async_save"}))
    # a tiny tied-embedding GPT-2: every file below 5 MiB, so each is one part from one rank, the other handing over
    savers.append({**_spec(tmp, bucket, "z3", "gpt2-z3"), "model": "gpt2"})
    resumed = [_spec(tmp, bucket, "z3", "z3-to-z3", resume="z3"), _spec(tmp, bucket, "f2", "z3-to-f2", resume="z3"),
               _spec(tmp, bucket, "z3", "z3a-to-z3", resume="z3a")]
    best = [loop_spec(_spec(tmp, bucket, "z3", "best-z3"), tmp / "best-z3-model")]
    torchrun(2, savers + resumed + best, tmp)
    out = {s["output_dir"].rsplit("/", 1)[1]: torch.load(s["result"], weights_only=False)
           for s in savers + resumed + best}
    out["f2-to-single"] = run_spec(_spec(tmp, bucket, "single", "f2-to-single", resume="f2"), 1)  # this process
    out["gpt2-z3-to-single"] = run_spec({**_spec(tmp, bucket, "single", "gpt2-z3-to-single", resume="gpt2-z3"),
                                         "model": "gpt2"}, 1)
    # resuming the loop run's last checkpoint from the bucket keeps its best checkpoint (a URL) and trains on
    again = _spec(tmp, bucket, "single", "best-again", eval=True, overrides={**BEST, "max_steps": 8})
    again["resume"] = join(bucket, "best-z3", "checkpoint-6")
    out["best-again"] = run_spec(again, 1)
    return tmp, bucket, out


@pytest.mark.dist
@pytest.mark.parametrize("saved_by,resumed_as", [("z3", "z3"), ("z3", "f2"), ("f2", "single"), ("z3a", "z3"),
                                                 ("gpt2-z3", "single")])
def test_bucket_checkpoints_resume_on_another_engine_and_world_size(runs, saved_by, resumed_as):
    """z3a: ZeRO-3 with async_save (the ranks' uploads and hand-overs run in the background): resumed, the same as
    the synchronous run, bit for bit."""
    _, bucket, out = runs
    exact = saved_by.rstrip("a") == resumed_as
    baseline = out[saved_by.rstrip("a")]
    assert_resumed_matches(out[f"{saved_by}-to-{resumed_as}"], baseline, (4, 5, 6), exact, LOSS_RTOL, STATE_ATOL)
    assert sorted(listing(join(bucket, f"{saved_by}-to-{resumed_as}"))) == ["checkpoint-6"]


@pytest.mark.dist
@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_rank_uploads_its_own_parts(runs, engine):
    """The manifest records who uploaded each part: both ranks uploaded parts of at least 5 MiB. DDP writes whole
    files per rank: nothing crosses ranks. Under ZeRO-3 and FSDP2 each rank holds half of every tensor; halves
    below 5 MiB (the decoder layer's, ~0.5 MiB each) cannot be parts of their own, so about half of those bytes
    go to the rank that uploads their part: measured 7.1 MB of 90 MB here, bounded below 10%."""
    _, bucket, _ = runs
    manifest = json.loads(read_bytes(join(bucket, engine, "checkpoint-6", MANIFEST_NAME)))
    upload = manifest["saved_by"]["upload"]
    assert upload["min_part_size"] == 5 * MIB
    big = {rank for name, entry in manifest["files"].items() for offset, length, crc, rank in entry.get("parts", [])
           if length >= 5 * MIB}
    assert big == {0, 1}
    total = sum(entry["size"] for entry in manifest["files"].values())
    if engine == "ddp":
        assert upload["hand_over_bytes"] == 0, upload
    else:
        assert 0 < upload["hand_over_bytes"] < 0.1 * total, (upload, total)


@pytest.mark.dist
def test_bucket_holds_only_checkpoints_and_the_output_dir_the_rest(runs):
    tmp, bucket, _ = runs
    assert sorted(listing(join(bucket, "z3"))) == ["checkpoint-3", "checkpoint-6"]
    assert not [p for p in (tmp / "z3").iterdir() if p.name.startswith("checkpoint")]
    assert store_for(bucket).abort_uploads(bucket) == []  # no multipart upload left behind


@pytest.mark.dist
def test_cli_reads_bucket_checkpoints_and_exports_for_from_pretrained(runs, tmp_path):
    _, bucket, out = runs
    ckpt = join(bucket, "f2", "checkpoint-6")
    cli = [sys.executable, "-m", "hf_unified_ckpt.tools.cli"]
    for command in (["info", ckpt], ["verify", ckpt]):
        done = subprocess.run(cli + command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert "global_step" in subprocess.run(cli + ["info", ckpt], capture_output=True, text=True).stdout
    done = subprocess.run(cli + ["export", ckpt, str(tmp_path / "model")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    final = out["f2"]["state"]
    assert all(torch.equal(t, final[n]) for n, t in model.state_dict().items())


@pytest.mark.dist
def test_best_model_rotation_and_save_model_with_the_bucket(runs):
    """ZeRO-3 x 2 with evaluation, load_best_model_at_end, save_total_limit=2 and save_model: the best checkpoint is
    a URL kept by rotation, the final weights are its weights, and the model folder (output_dir side) loads them.
    Resumed from the bucket, the run keeps that best checkpoint."""
    tmp, bucket, out = runs
    result = out["best-z3"]
    best = result["best"]
    assert best.startswith(bucket) and not best.endswith("checkpoint-6"), best
    assert sorted(listing(join(bucket, "best-z3"))) == sorted({"checkpoint-6", best.rsplit("/", 1)[1]})
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    with ComponentReader(best, "model") as reader:
        assert [k for k, v in result["state"].items() if not torch.equal(reader.get(k), v)] == []
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp / "best-z3-model").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in result["state"].items())
    again = out["best-again"]
    # kept across the resume (the Trainer would drop a best checkpoint it cannot os.path.isdir), and loaded at the end
    assert again["global_step"] == 8 and again["best"] == best
    assert all(torch.equal(again["state"][k], v) for k, v in result["state"].items())


def _single_trainer(tmp_path, storage, **overrides):
    from support.trainers import make_trainer

    return make_trainer(tmp_path / "out", "llama", unified_checkpoint_storage=storage, **overrides)


def test_unwritable_storage_is_refused_before_the_first_step(s3_bucket, tmp_path, monkeypatch):
    """Read-only credentials and a missing bucket are refused by train() before anything trains; the error names
    the URL and what to check, never a secret."""
    from support.s3_server import READ_ONLY_KEY, READ_ONLY_SECRET, SECRET_KEY

    from hf_unified_ckpt.errors import UnsupportedCheckpointError

    store = store_for(s3_bucket)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READ_ONLY_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READ_ONLY_SECRET)
    store.close()  # the next request signs with the environment's credentials
    try:
        trainer = _single_trainer(tmp_path, join(s3_bucket, "run"))
        with pytest.raises(UnsupportedCheckpointError, match="a test write under it failed before training") as e:
            trainer.train()
        assert trainer.state.global_step == 0 and "Access Denied" in str(e.value)
        assert READ_ONLY_SECRET not in str(e.value) and "credentials" in str(e.value)
    finally:
        monkeypatch.undo()
        store.close()
    trainer = _single_trainer(tmp_path, "s3://hfuc-no-such-bucket/run")
    with pytest.raises(UnsupportedCheckpointError, match="s3://hfuc-no-such-bucket/run") as e:
        trainer.train()
    assert trainer.state.global_step == 0 and "bucket exists" in str(e.value) and SECRET_KEY not in str(e.value)
    assert listing(s3_bucket) == {}


@pytest.mark.parametrize("value,words", [
    ("s3://KEY:SECRET@bucket/run", "carries credentials"), ("s3://bucket/run?endpoint=x", "carries credentials"),
    ("/local/folder", "is a local path"), ("s3:///run", "names no bucket"),
    ("gs://bucket/run", "not supported yet: only s3://"), ("az://container/run", "not supported yet"),
])
def test_bad_storage_urls_are_refused_when_the_arguments_are_built(value, words, tmp_path):
    from support.trainers import make_args

    with pytest.raises(ValueError, match=words) as e:
        make_args(tmp_path, unified_checkpoint_storage=value)
    assert "KEY:SECRET" not in str(e.value)  # the refused URL is not echoed


@pytest.mark.dist
def test_no_credential_is_written_anywhere(runs, s3_server):
    """The access key and secret appear in no object of the bucket (training_args.bin included)."""
    from support.s3_server import ACCESS_KEY, SECRET_KEY

    _, bucket, _ = runs
    store = store_for(bucket)
    keys = store.fs.find(store._key(bucket))
    assert any(k.endswith("training_args.bin") for k in keys)
    for key in keys:
        data = store.read(f"s3://{key}")
        assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data, key


def test_a_forked_worker_gets_a_client_of_its_own(s3_bucket):
    """A DataLoader worker (forked) that touches the store builds its own client instead of using the parent's
    event loop and connections; the parent's client still works after the fork, and after `close`."""
    import multiprocessing

    store = store_for(s3_bucket)
    store.put(join(s3_bucket, "x"), b"parent")
    parent_fs = store.fs

    def child(queue):
        queue.put((store.read(join(s3_bucket, "x")), store.fs is not parent_fs))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0 and got == (b"parent", True)
    assert store.read(join(s3_bucket, "x")) == b"parent" and store.fs is parent_fs
    store.close()
    assert store.read(join(s3_bucket, "x")) == b"parent"


# ---- faults: throttling, dropped connections, a failing part (a fault-injecting proxy before the real server) ----

@pytest.fixture
def faulty(s3_server, s3_session_bucket):
    """(run prefix, proxy): a store registered as `s3faulty://` that talks to the real server through the proxy."""
    import uuid

    from support.s3_faults import FaultyProxy

    from hf_unified_ckpt.store import S3Store, register_store

    proxy = FaultyProxy(s3_server.endpoint).start()
    register_store("s3faulty", lambda scheme: S3Store(scheme, endpoint_url=proxy.endpoint))  # default retries
    bucket = s3_session_bucket.split("://", 1)[1]
    try:
        yield f"s3faulty://{bucket}/faults-{uuid.uuid4().hex[:8]}", proxy
    finally:
        store_for("s3faulty://x").close()
        proxy.stop()


def _state_of(model, opt):
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _fault_model(seed=0):
    """About 22 MB of weights and moments: 3 optimizer files of several 5 MiB+ parts."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1201, 1500), torch.nn.Linear(1500, 7))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for k in (1, 2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
        opt.step()
    return model, opt


def _save_to(final, model, opt, step):
    from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint
    from hf_unified_ckpt.engines.replicated import ReplicatedEngine
    from hf_unified_ckpt.options import parse_options

    options = parse_options(unified_checkpoint=True, max_shard_size="8MB")
    return save_checkpoint(ReplicatedEngine(model, opt), SaveRequest(final, step, options, show_progress=False),
                           {"trainer_state.json": b"{}"})


def _load_from(final, checked_on_read=False):
    """Verify (as `verify` does, or as a resume from the bucket does: `checked_on_read`) and load `final`."""
    from hf_unified_ckpt.checkpoint.load.loading import load_checkpoint, verify_checkpoint
    from hf_unified_ckpt.engines.replicated import ReplicatedEngine
    from hf_unified_ckpt.options import parse_options

    model, opt = _fault_model(seed=5)
    load_checkpoint(final, ReplicatedEngine(model, opt), verify_checkpoint(final, checked_on_read=checked_on_read),
                    parse_options(unified_checkpoint=True))
    return _state_of(model, opt)


def _same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_throttling_and_dropped_connections_are_retried(faulty):
    from support.s3_faults import Fault

    from support.faults import record_fault

    run, proxy = faulty
    record_fault("S3 503 SlowDown and dropped connections", survived=False)
    model, opt = _fault_model()
    proxy.faults[:] = [Fault("503", ("partNumber=",), "PUT", times=4), Fault("503", ("uploads",), "POST", times=1),
                       Fault("drop", ("partNumber=1",), "PUT", times=2),
                       Fault("drop", ("unified_checkpoint.json",), "PUT", times=1)]
    final = _save_to(join(run, "checkpoint-1"), model, opt, 1)
    assert all(f.hits == f.times for f in proxy.faults), [(f.action, f.match, f.hits) for f in proxy.faults]
    manifest = json.loads(read_bytes(join(final, MANIFEST_NAME)))
    parts = sum(len(entry.get("parts", [])) for entry in manifest["files"].values())
    assert parts >= 3 and sum(1 for _, t, what in proxy.log if "partNumber" in t and what == "relayed") == parts
    _same(_load_from(final), _state_of(model, opt))
    record_fault("S3 503 SlowDown and dropped connections", survived=True)


def test_a_part_that_keeps_failing_fails_the_save_naming_it_and_commits_nothing(faulty):
    from support.s3_faults import Fault

    from support.faults import record_fault
    from hf_unified_ckpt.checkpoint.folder.layout import detect_layout, newest_complete
    from hf_unified_ckpt.errors import UnifiedCheckpointError

    run, proxy = faulty
    record_fault("S3 part failing on every retry", survived=False)
    model, opt = _fault_model()
    one = _save_to(join(run, "checkpoint-1"), model, opt, 1)
    state1 = _state_of(model, opt)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    proxy.faults[:] = [Fault("500", ("optimizer", "partNumber=1"), "PUT", times=None)]
    with pytest.raises(UnifiedCheckpointError, match="nothing was committed") as e:
        _save_to(join(run, "checkpoint-2"), model, opt, 2)
    message = str(e.value)
    assert "uploading part 1 of s3faulty://" in message and "optimizer" in message and "InternalError" in message
    assert proxy.faults[0].hits >= 5  # retried with backoff before giving up
    assert not detect_layout(join(run, "checkpoint-2")).complete and newest_complete(run).global_step == 1
    assert store_for(run).abort_uploads(run) == []  # the failed save's uploads were aborted
    _same(_load_from(one), state1)
    proxy.faults.clear()  # the server recovers: the next save of the step commits
    _same(_load_from(_save_to(join(run, "checkpoint-2"), model, opt, 2)), _state_of(model, opt))
    record_fault("S3 part failing on every retry", survived=True)


# ---- kill -9 of the launcher and every worker at random instants of an upload ----------------------------------

KILL_DELAYS = (0.0, 0.35)  # seconds after checkpoint-6's uploads began (seeded "random" instants, reproducible)


@pytest.mark.dist
def test_killed_upload_is_never_picked_and_resume_is_exact(runs, tmp_path):
    """ZeRO-3 x 2 saving into the bucket, killed whole (SIGKILL to torchrun and both workers) while checkpoint-6
    is being uploaded: no torn checkpoint is taken for complete, `resume_from_checkpoint=True` continues from
    checkpoint-3 bit-exactly like the uninterrupted run, and its first save aborts the uploads the kill left."""
    import time

    from support.faults import record_fault
    from support.launches import kill_tree, torchrun_popen
    from hf_unified_ckpt.checkpoint.folder.layout import detect_layout, newest_complete

    _, bucket, out = runs
    store, resumed = store_for(bucket), []
    for k, delay in enumerate(KILL_DELAYS):
        name = f"kill -9 during an S3 upload (+{delay}s)"
        record_fault(name, survived=False)
        prefix = join(bucket, f"kill-{k}")
        proc = torchrun_popen(2, [_spec(tmp_path, bucket, "z3", f"kill-{k}")], tmp_path)
        deadline = time.monotonic() + 300
        while not store.uploads(join(prefix, "checkpoint-6")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-6 upload"
            time.sleep(0.02)
        time.sleep(delay)
        killed = kill_tree(proc.pid)
        proc.wait(60)
        assert len(killed) >= 3  # the launcher and both workers
        assert not detect_layout(join(prefix, "checkpoint-6")).complete, "the kill came after the commit"
        assert newest_complete(prefix).global_step == 3
        assert store.uploads(prefix)  # the kill left unfinished uploads behind
        resumed.append({**_spec(tmp_path, bucket, "z3", f"kill-{k}-resumed"),
                        "overrides": {**_spec(tmp_path, bucket, "z3", "x")["overrides"],
                                      "unified_checkpoint_storage": prefix}, "resume": True})
    torchrun(2, resumed, tmp_path)
    for k, delay in enumerate(KILL_DELAYS):
        result = torch.load(tmp_path / f"kill-{k}-resumed.pt", weights_only=False)
        assert_resumed_matches(result, out["z3"], (4, 5, 6), True, LOSS_RTOL, STATE_ATOL)
        prefix = join(bucket, f"kill-{k}")
        assert store.uploads(prefix) == [] and newest_complete(prefix).global_step == 6
        record_fault(f"kill -9 during an S3 upload (+{delay}s)", survived=True)


def test_resume_reads_only_what_it_loads_and_checks_it(s3_bucket):
    """A checkpoint uploaded in parts records a CRC-32 per 256 KiB block; a resume from the bucket does not read the
    tensor files to verify them (`checked_on_read`): each ranged read checks its blocks, so a load fetches about
    what it loads, and a damaged block is refused by name. The `verify` command still reads everything."""
    from hf_unified_ckpt.checkpoint.load.loading import verify_checkpoint
    from hf_unified_ckpt.errors import CorruptCheckpointError
    from support.faulty_store import injected, recording

    model, opt = _fault_model()
    final = _save_to(join(s3_bucket, "checkpoint-1"), model, opt, 1)
    manifest = json.loads(read_bytes(join(final, MANIFEST_NAME)))
    tensor_files = {n: e for n, e in manifest["files"].items() if n.endswith(".safetensors")}
    block = VERIFY_BLOCK
    assert all(e["blocks"]["size"] == block and len(e["blocks"]["crc32"]) == -(-e["size"] // block)
               for e in tensor_files.values())
    calls = []

    def fetched() -> list[tuple[str, int]]:  # (file name, bytes) of each read since the last clear
        return [(c.ref.rsplit("/", 1)[1], len(c.result)) for c in calls]

    with injected(recording(calls, "read"), ref=final):
        verify_checkpoint(final, checked_on_read=True)
        assert sum(n for name, n in fetched() if name in tensor_files) < 4096 * len(tensor_files)  # headers only
        calls.clear()
        _same(_load_from(final, checked_on_read=True), _state_of(model, opt))
        loaded = sum(n for name, n in fetched() if name in tensor_files)  # headers + blocks of every tensor, once
        assert loaded <= 1.1 * sum(e["size"] for e in tensor_files.values()), loaded
    victim = sorted(n for n in tensor_files if n.startswith("optimizer"))[0]
    data = bytearray(read_bytes(join(final, victim)))
    data[len(data) // 2] ^= 0x40
    store_for(final).put(join(final, victim), bytes(data))
    verify_checkpoint(final, checked_on_read=True)  # sizes and headers are fine: the damage is found on reading
    with pytest.raises(CorruptCheckpointError, match=f"{victim}: bytes .* do not match the CRC-32"):
        _load_from(final, checked_on_read=True)
    with pytest.raises(CorruptCheckpointError, match=victim):
        verify_checkpoint(final)


@pytest.mark.dist
def test_tied_model_files_below_a_part_go_up_whole(runs):
    """GPT-2 (tied embeddings) under ZeRO-3 x 2: every file is smaller than S3's smallest part, so each is one part
    uploaded by the rank holding most of it, the other rank's bytes handed over; the model file holds the tied
    weight once (no lm_head), as save_pretrained writes it."""
    _, bucket, out = runs
    folder = join(bucket, "gpt2-z3", "checkpoint-6")
    manifest = json.loads(read_bytes(join(folder, MANIFEST_NAME)))
    tensor_files = {n: e for n, e in manifest["files"].items() if n.endswith(".safetensors")}
    assert all(len(e["parts"]) == 1 and e["size"] < 5 * MIB for e in tensor_files.values())
    assert manifest["saved_by"]["upload"]["hand_over_bytes"] > 0
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    with ComponentReader(folder, "model") as reader:
        assert "lm_head.weight" not in reader.keys() and "transformer.wte.weight" in reader.keys()
        state = out["gpt2-z3"]["state"]
        assert all(torch.equal(reader.get(k), state[k]) for k in reader.keys())


# ---- 3 ranks: hand-overs point to point, a rank that cannot send its bytes ---------------------------------------

@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, s3_session_bucket):
    """One launch of 3 ranks, tiny GPT-2 under ZeRO-3, one step and one save each: every file is below a part, so
    each is uploaded by the rank holding most of it and the other two hand their bytes over. "counted" records per
    rank and file the bytes received against the plan's; in "unreadable" rank 1 cannot produce its bytes (every rank
    must see the save fail: `support.specs._refused` checks the error on each)."""
    import uuid

    bucket = join(s3_session_bucket, f"three-{uuid.uuid4().hex[:8]}")
    tmp = tmp_path_factory.mktemp("s3-three")
    once = {"max_steps": 1, "save_steps": 1}
    counted = {**_spec(tmp, bucket, "z3", "counted", overrides=once), "model": "gpt2", "record_hand_overs": True}
    unreadable = {**_spec(tmp, bucket, "z3", "unreadable", overrides=once), "model": "gpt2", "unreadable_bytes": 1,
                  "expect_error": "nothing was committed"}
    # the golden pair: Llama files of 28-56 MB, uploaded by their holders' runs, and by aggregators (ranges of 5-7 MiB
    # over the three ranks, crossing the ZeRO-3 pieces; one part per cell)
    golden = [_spec(tmp, bucket, "z3", tag, overrides={**once, **extra}, record_hand_overs=True)
              for tag, extra in (("by-holders", {}), ("aggregated", {"unified_checkpoint_config": "aggregate",
                                                                     "unified_checkpoint_aggregate_range": "8KiB"}))]
    torchrun(3, [counted, unreadable, *golden], tmp, timeout=600)  # a rank waiting for bytes that never come fails it
    return tmp, bucket


@pytest.mark.dist
def test_each_rank_receives_only_the_hand_overs_of_its_own_parts(three_ranks):
    """Each rank receives exactly the bytes the plan hands over to it (those within the parts it uploads), none of
    the hand-overs between other ranks (an all-gather gave every rank all of them); the files hold the trained
    weights."""
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    tmp, bucket = three_ranks
    ranks = [torch.load(tmp / f"counted.pt.rank{r}", weights_only=False) for r in range(3)]
    assert ranks[0] and all(files.keys() == ranks[0].keys() for files in ranks)
    for rank, files in enumerate(ranks):
        assert all(received == planned for received, planned in files.values()), (rank, files)
    # in every tensor file one rank receives the other two ranks' bytes, and the two others receive nothing
    tensor_files = [name for name in ranks[0] if name.endswith(".safetensors")]
    assert tensor_files and all(sorted(bool(files[name][1]) for files in ranks) == [False, False, True]
                                for name in tensor_files)
    folder = join(bucket, "counted", "checkpoint-1")
    manifest = json.loads(read_bytes(join(folder, MANIFEST_NAME)))
    assert manifest["saved_by"]["upload"]["hand_over_bytes"] == sum(p for files in ranks for _, p in files.values())
    state = torch.load(tmp / "counted.pt", weights_only=False)["state"]
    with ComponentReader(folder, "model") as reader:
        assert all(torch.equal(reader.get(k), state[k]) for k in reader.keys())


@pytest.mark.dist
def test_files_uploaded_by_aggregators_are_byte_identical_to_files_uploaded_by_their_holders(three_ranks):
    """Issue 58: with `aggregate`, each file's ranges (at least the 5 MiB smallest part) are uploaded by their
    aggregators, one part per cell, from the bytes the holders send them point to point; the objects are the same
    bytes, each aggregator received at most what it uploaded, and the ranks that aggregate nothing received nothing."""
    tmp, bucket = three_ranks
    folders = {tag: join(bucket, tag, "checkpoint-1") for tag in ("by-holders", "aggregated")}
    names = [n for n, size in listing(folders["by-holders"]).items() if n.endswith(".safetensors")]
    assert names and all(read_bytes(join(folders["aggregated"], n)) == read_bytes(join(folders["by-holders"], n))
                         for n in names)
    manifest = json.loads(read_bytes(join(folders["aggregated"], MANIFEST_NAME)))
    uploaders = {n: {part[3] for part in entry["parts"]} for n, entry in manifest["files"].items() if "parts" in entry}
    assert len(set().union(*uploaders.values())) == 3 and max(len(u) for u in uploaders.values()) > 1
    assert all(min(p[1] for p in e["parts"][:-1]) >= 5 * MIB for e in manifest["files"].values()
               if len(e.get("parts", [])) > 1)
    ranks = [torch.load(tmp / f"aggregated.pt.rank{r}", weights_only=False) for r in range(3)]
    uploaded = [sum(p[1] for e in manifest["files"].values() for p in e.get("parts", []) if p[3] == r)
                for r in range(3)]
    for rank, files in enumerate(ranks):
        received = sum(got for got, planned in files.values())
        assert all(got == planned for got, planned in files.values())
        assert received <= uploaded[rank], (rank, received, uploaded)  # nobody receives bytes it does not upload
    assert sum(sum(got for got, _ in files.values()) for files in ranks) == manifest["saved_by"]["upload"]["hand_over_bytes"] > 0


@pytest.mark.dist
def test_a_rank_that_cannot_send_its_bytes_fails_the_save_on_every_rank(three_ranks):
    """Rank 1 cannot produce its bytes: it still sends as many (zeros) to the ranks waiting for them, so nobody
    hangs; the save fails on every rank (each checked its error in the launch) naming rank 1's failure and only it
    (the receivers did not fail over the missing bytes), and nothing is committed or left uploading."""
    import re

    from support.faults import record_fault
    from hf_unified_ckpt.checkpoint.folder.layout import newest_complete

    name = "a rank's hand-over bytes unreadable (bucket, 3 ranks)"
    record_fault(name, survived=False)
    tmp, bucket = three_ranks
    result = torch.load(tmp / "unreadable.pt", weights_only=False)
    error = result["error"]
    assert "injected: rank 1 could not read its bytes" in error and result["global_step"] == 1
    assert {int(r) for r in re.findall(r"^rank (\d+): ", error, re.M)} == {1}, error
    prefix = join(bucket, "unreadable")
    assert newest_complete(prefix) is None
    assert store_for(prefix).abort_uploads(prefix) == []
    record_fault(name, survived=True)


def test_the_clients_event_loop_thread_ends_with_the_run(s3_bucket, tmp_path):
    """A run saving into the bucket uses an S3 client on an event loop of the store's own (a thread named
    hf_unified_ckpt-s3, not fsspec's shared loop); it ends when train() returns, and the next use starts a new one."""
    import threading

    def loops():
        return [t for t in threading.enumerate() if t.name == "hf_unified_ckpt-s3"]

    store = store_for(s3_bucket)
    store.close()
    trainer = _single_trainer(tmp_path, join(s3_bucket, "run"))
    trainer.train()
    assert trainer.state.global_step == 6 and not loops()
    assert sorted(store.list(join(s3_bucket, "run"))) == ["checkpoint-3", "checkpoint-6"] and len(loops()) == 1
    store.close()
    assert not loops()


def test_the_output_dir_lease_is_a_conditional_object_in_the_bucket(s3_bucket, caplog):
    """Issue 55, item 4, on a bucket: the lease object is created with a conditional put (SeaweedFS honours
    `If-None-Match: *`: no warning that the prefix is unprotected); a second job is refused naming the first;
    renewing rewrites it; giving it back leaves nothing in the bucket."""
    from hf_unified_ckpt.checkpoint.folder.lease import Lease, lease_name
    from hf_unified_ckpt.errors import OutputDirInUseError
    from hf_unified_ckpt.options import LeaseOptions

    first = Lease(s3_bucket, "first", LeaseOptions(wait=0.0))
    with caplog.at_level("WARNING"):
        first.acquire()
    assert not [r for r in caplog.records if "conditional writes" in r.getMessage()]
    assert sorted(listing(s3_bucket)) == [lease_name(1)]
    with pytest.raises(OutputDirInUseError, match=f"pid {__import__('os').getpid()}, started "):
        Lease(s3_bucket, "second", LeaseOptions(wait=0.0)).acquire()
    before = json.loads(read_bytes(join(s3_bucket, lease_name(1))))["renewed"]
    assert first.renew() and json.loads(read_bytes(join(s3_bucket, lease_name(1))))["renewed"] >= before
    first.release()
    assert listing(s3_bucket) == {}
