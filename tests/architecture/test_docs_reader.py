"""The on-disk format page is enough to read a checkpoint: `tests/support/format_reader.py`, written from `docs/format.md`
alone (json, zlib, safetensors, torch; nothing of the plugin), reads checkpoints the plugin wrote and gets the same
tensors, `torch.equal` and of the same dtype, as the plugin's own reader (`ComponentReader`, codecs decoded):

- one process, fp32, model and optimizer in several shards (format version 1);
- one process, GPT-2 (tied embeddings), O1 optimizer moments and an EMA (format version 2);
- DeepSpeed ZeRO-2 bf16 in one real process (torchrun, launched first so it runs beside the in-process runs): O2
  moments, fp32 master weights stored as a residual over the bf16 weights, with ties planted, and an EMA; the
  rebuilt master weights are also compared bit for bit with DeepSpeed's own fp32 master copy.

The reader also refuses what the page says a reader must refuse, and the manifest example on the page has the fields
a save writes.
"""

import ast
import json
import re
import shutil

import pytest
import torch

from support.paths import ROOT, SUPPORT
from support.trainers import train
from support.launches import kill_tree, torchrun_popen
from support.format_reader import FormatError, UnsupportedFormat, optimizer_value, read_checkpoint
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader
from hf_unified_ckpt.errors import UnsupportedCheckpointError

DOC = ROOT / "docs" / "format.md"
#: What the independent reader may import (format.md: "Reference reader and tests").
ALLOWED_IMPORTS = {"__future__", "json", "math", "os", "zlib", "dataclasses", "torch", "safetensors"}
SMALL = {"max_steps": 2, "save_steps": 2}


@pytest.fixture(scope="module")
def deepspeed_launch(tmp_path_factory):
    """DeepSpeed ZeRO-2 bf16, one process, saving at step 2 with O2, residual master weights and an EMA; ties planted
    in the fp32 master weights at step 2; DeepSpeed's own view of the state recorded at step 2."""
    tmp = tmp_path_factory.mktemp("docs-reader-ds")
    spec = {"zero": 2, "plant_ties": 2, "record_at": 2, "output_dir": str(tmp / "z2"), "result": str(tmp / "z2.pt"),
            "overrides": {"bf16": True, **SMALL, "ckpt_quant_stage": "O2",
                          "unified_checkpoint_config": "residual_master_weight ema"}}
    proc = torchrun_popen(1, [spec], tmp)
    yield tmp, proc
    if proc.poll() is None:
        kill_tree(proc.pid)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, deepspeed_launch):
    """The in-process runs (requesting the launch first, so that it runs meanwhile). Returns (folder, trainers)."""
    tmp = tmp_path_factory.mktemp("docs-reader")
    trainers = {
        "plain": train(tmp / "plain", **SMALL, unified_checkpoint_max_shard_size="20KB")[0],
        "o1-ema": train(tmp / "o1-ema", model_kind="gpt2", **SMALL, ckpt_quant_stage="O1",
                        unified_checkpoint_config="ema", unified_checkpoint_max_shard_size="16KB")[0],
    }
    return tmp, trainers


@pytest.fixture(scope="module")
def deepspeed(deepspeed_launch):
    tmp, proc = deepspeed_launch
    try:
        code = proc.wait(timeout=600)
    except Exception:
        kill_tree(proc.pid)
        raise
    if code != 0:
        log = "\n".join(p.read_text(errors="replace")[-6000:] for p in tmp.glob("spec-*.log"))
        pytest.fail(f"the DeepSpeed launch failed ({code}):\n{log}")
    return tmp / "z2" / "checkpoint-2", torch.load(tmp / "z2.pt", weights_only=False)


def read_alike(folder):
    """The independent reader's checkpoint, after checking every component against the plugin's reader."""
    ckpt = read_checkpoint(folder)
    mine = {"model": ckpt.model, "optimizer": ckpt.optimizer, "master_weights": ckpt.master_weights,
            "ema": ckpt.ema}
    components = ckpt.manifest["components"]
    assert set(components) <= set(mine)
    with ComponentReader(folder, components["model"]["file_stem"]) as model:
        for name, entry in components.items():
            theirs = model if name == "model" else ComponentReader(folder, entry["file_stem"], anchor=model)
            assert sorted(mine[name]) == sorted(theirs.keys()), name
            for key in theirs.keys():
                expected = theirs.get(key)
                assert mine[name][key].dtype == expected.dtype and torch.equal(mine[name][key], expected), (name, key)
            assert entry["tensors"] == len(mine[name]), name
    return ckpt


def test_the_reader_imports_nothing_of_the_plugin():
    tree = ast.parse((SUPPORT / "format_reader.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS


def test_a_sharded_fp32_checkpoint_reads_alike(saved):
    tmp, trainers = saved
    ckpt = read_alike(tmp / "plain" / "checkpoint-2")
    manifest = ckpt.manifest
    assert manifest["format_version"] == 1 and ckpt.master_weights is None and ckpt.ema is None
    assert len(manifest["components"]["model"]["files"]) > 1 and len(manifest["components"]["optimizer"]["files"]) > 1
    trainer = trainers["plain"]
    live = trainer.model.state_dict()
    assert sorted(ckpt.model) == sorted(live) and all(torch.equal(ckpt.model[k], v) for k, v in live.items())
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = trainer.optimizer.param_groups
    assert [g["params"] for g in ckpt.optimizer_param_groups] == [[names[id(p)] for p in g["params"]] for g in groups]
    for saved_group, group in zip(ckpt.optimizer_param_groups, groups):
        assert {k: v for k, v in saved_group.items() if k != "params"} == {k: v for k, v in group.items()
                                                                          if k != "params"}
    for p, state in trainer.optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(optimizer_value(ckpt, f"{names[id(p)]}/{key}"), value), (names[id(p)], key)
    assert ckpt.optimizer["lm_head.weight/step"].shape == () and ckpt.optimizer_state_types == {}


def test_o1_moments_and_the_ema_of_a_tied_model_read_alike(saved):
    tmp, trainers = saved
    ckpt = read_alike(tmp / "o1-ema" / "checkpoint-2")
    manifest = ckpt.manifest
    assert manifest["format_version"] == 2 and manifest["components"]["optimizer"]["codec"]["stage"] == "O1"
    assert len(manifest["components"]["ema"]["files"]) > 1
    tied = "lm_head.weight"  # GPT-2's lm_head is the embedding: saved once, under transformer.wte.weight
    assert tied not in ckpt.model and tied not in ckpt.ema and not any(k.startswith(tied) for k in ckpt.optimizer)
    trainable = {n for n, p in trainers["o1-ema"].model.named_parameters() if p.requires_grad}
    assert set(ckpt.ema) == trainable and all(t.dtype == torch.float32 for t in ckpt.ema.values())
    truth = {names: p for names, p in trainers["o1-ema"].model.named_parameters()}
    moments = [k for k in ckpt.optimizer if k.endswith(("/exp_avg", "/exp_avg_sq"))]
    assert moments and all(ckpt.optimizer[k].shape == truth[k.rsplit("/", 1)[0]].shape for k in moments)


@pytest.mark.dist
def test_o2_moments_residual_master_weights_and_ema_under_deepspeed_bf16_read_alike(deepspeed):
    folder, record = deepspeed
    ckpt = read_alike(folder)
    manifest = ckpt.manifest
    assert manifest["format_version"] == 2 and manifest["saved_by"]["engine"] == "deepspeed"
    assert manifest["components"]["optimizer"]["codec"]["stage"] == "O2"
    assert manifest["components"]["master_weights"]["codec"]["name"] == "bf16_residual"
    index = json.loads((folder / "master_weights.safetensors.index.json").read_text())
    assert sum(e["ties"] for e in index["metadata"]["codec"]["tensors"].values()) > 0  # planted, then rebuilt
    at = record["at"]  # DeepSpeed's own accessors at step 2: the bf16 weights and the fp32 master copy
    masters = {k.removesuffix("/master"): v for k, v in at["optim"].items() if k.endswith("/master")}
    assert sorted(ckpt.master_weights) == sorted(masters)
    for name, master in masters.items():
        assert torch.equal(ckpt.master_weights[name].view(torch.int32), master.view(torch.int32)), name
    assert all(torch.equal(ckpt.model[k], v) for k, v in at["state"].items())
    assert sorted(ckpt.ema) == sorted(masters)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_json(path, change):
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")


def test_the_reader_refuses_what_the_page_says_a_reader_must_refuse(saved, tmp_path):
    tmp, _ = saved
    plain, o1 = tmp / "plain" / "checkpoint-2", tmp / "o1-ema" / "checkpoint-2"
    damaged = _copy(plain, tmp_path / "damaged")
    shard = damaged / "model-00001-of-00005.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="CRC-32"):
        read_checkpoint(damaged)
    newer = _copy(plain, tmp_path / "newer")
    _rewrite_json(newer / "unified_checkpoint.json", lambda m: {**m, "format_version": 3})
    with pytest.raises(UnsupportedFormat, match="format_version 3"):
        read_checkpoint(newer)
    hostile = _copy(plain, tmp_path / "hostile")
    _rewrite_json(hostile / "unified_checkpoint.json", lambda m: {**m, "files": {**m["files"], "../x": {"size": 1}}})
    with pytest.raises(FormatError, match="plain file name"):
        read_checkpoint(hostile)
    # a codec this reader does not know (same length: sizes stay right), refused by name as the plugin refuses it
    unknown = _copy(o1, tmp_path / "unknown-codec")
    index = unknown / "optimizer.safetensors.index.json"
    index.write_text(index.read_text().replace('"blockwise_codebook"', '"blockwise_codebooX"'))
    with pytest.raises(UnsupportedFormat, match="blockwise_codebooX"):
        read_checkpoint(unknown, checksums=False)
    with pytest.raises(UnsupportedCheckpointError, match="blockwise_codebooX"):
        ComponentReader(unknown, "optimizer")


def test_the_manifest_example_on_the_page_has_the_fields_a_save_writes(saved):
    tmp, _ = saved
    text = DOC.read_text()
    section = text.split("### Manifest example", 1)[1]
    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    real = json.loads((tmp / "plain" / "checkpoint-2" / "unified_checkpoint.json").read_text())

    def shape(m):
        return {"top": sorted(m), "saved_by": sorted(m["saved_by"]), "options": sorted(m["options"]),
                "components": {c: sorted(e) for c, e in m["components"].items()},
                "files": sorted({k for rec in m["files"].values() for k in rec}), "version": m["format_version"]}

    assert shape(example) == shape(real)
