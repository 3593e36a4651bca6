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

from _runs import assert_resumed_matches, run_spec
from conftest import torchrun
from hf_unified_ckpt.checkpoint.manifest import MANIFEST_NAME
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
    resumed = [_spec(tmp, bucket, "z3", "z3-to-z3", resume="z3"), _spec(tmp, bucket, "f2", "z3-to-f2", resume="z3"),
               _spec(tmp, bucket, "z3", "f2-to-z3", resume="f2")]
    torchrun(2, savers + resumed, tmp)
    out = {s["output_dir"].rsplit("/", 1)[1]: torch.load(s["result"], weights_only=False) for s in savers + resumed}
    for saved_by in ("ddp", "f2"):  # on one process, in this one
        tag = f"{saved_by}-to-single"
        out[tag] = run_spec(_spec(tmp, bucket, "single", tag, resume=saved_by), 1)
    return tmp, bucket, out


@pytest.mark.dist
@pytest.mark.parametrize("saved_by,resumed_as", [("z3", "z3"), ("z3", "f2"), ("f2", "z3"), ("ddp", "single"),
                                                 ("f2", "single")])
def test_bucket_checkpoints_resume_on_another_engine_and_world_size(runs, saved_by, resumed_as):
    _, bucket, out = runs
    exact = saved_by == resumed_as
    assert_resumed_matches(out[f"{saved_by}-to-{resumed_as}"], out[saved_by], (4, 5, 6), exact, LOSS_RTOL,
                           STATE_ATOL)
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
