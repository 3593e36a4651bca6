"""Complete or loud: corrupted, truncated and missing files and hostile names are found before any tensor
loads, by `hf-unified-ckpt verify`, by `verify_checkpoint`, and by a Trainer resume; so is optimizer state or EMA
that does not fit its parameter, in files whose manifest was re-signed (one process, ZeRO-3, FSDP2)."""

import json
import shutil

import pytest
import torch

import hf_unified_ckpt.checkpoint.folder.safetensors_io as sio
from support.faults import resign, rewrite_tensor
from support.trainers import make_trainer, train
from support.launches import torchrun
from hf_unified_ckpt.tools.cli import main as cli
from hf_unified_ckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError
from hf_unified_ckpt.checkpoint.load.loading import verify_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A one-process checkpoint in several files per component, with an EMA."""
    run = tmp_path_factory.mktemp("good")
    train(run, max_steps=3, save_steps=3, unified_checkpoint_max_shard_size="40KB", unified_checkpoint_config="ema")
    return run / "checkpoint-3"


@pytest.fixture
def ckpt(good, tmp_path):
    copy = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(good, copy)
    return copy


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Fail the test if any tensor is read."""
    def forbidden(*a, **k):
        raise AssertionError("a tensor was read before verification finished")
    monkeypatch.setattr(sio.ComponentReader, "get", forbidden)
    monkeypatch.setattr(sio.ComponentReader, "get_slice", forbidden)


def _flip_bit(path, offset_from_end=5):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def _rewrite_consistently(ckpt, name, new_text):
    """What a hostile writer does: change a file and fix its manifest record so checksums still match."""
    (ckpt / name).write_text(new_text)
    resign(ckpt, name)


def _a_shard(ckpt, stem):
    return sorted(ckpt.glob(f"{stem}*.safetensors"))[0]


FAULTS = {
    "bit flip in a model shard": (lambda c: _flip_bit(_a_shard(c, "model")), "model", "does not match"),
    "bit flip in an optimizer shard": (lambda c: _flip_bit(_a_shard(c, "optimizer")), "optimizer", "does not match"),
    "truncated optimizer shard": (lambda c: (p := _a_shard(c, "optimizer")).write_bytes(p.read_bytes()[:-100]),
                                  "optimizer", "truncated"),
    "missing model shard": (lambda c: _a_shard(c, "model").unlink(), "model", "missing"),
    "missing rng state": (lambda c: (c / "rng_state_0.pth").unlink(), "rng_state_0.pth", "missing"),
    "missing trainer state": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json", "missing"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_named_by_verify_and_before_load(ckpt, fault, no_tensor_reads, capsys):
    damage, names, words = FAULTS[fault]
    damage(ckpt)
    assert cli(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert names in err and words in err
    with pytest.raises(CorruptCheckpointError) as e:
        verify_checkpoint(ckpt)
    assert names in str(e.value) and words in str(e.value) and "Nothing was loaded" in str(e.value)


@pytest.mark.parametrize("fault", ["bit flip in an optimizer shard", "missing model shard"])
def test_trainer_resume_refuses_damaged_checkpoint_before_loading(ckpt, fault, tmp_path, no_tensor_reads):
    FAULTS[fault][0](ckpt)
    with pytest.raises(CorruptCheckpointError, match=FAULTS[fault][2]):
        train(tmp_path / "resumed", max_steps=6, resume=str(ckpt))


def test_single_process_resume_names_a_truncated_file_as_verify_does(ckpt, tmp_path, no_tensor_reads, capsys):
    shard = _a_shard(ckpt, "optimizer")
    expected = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    line = f"{shard.name}: {expected - 100} bytes on disk, expected {expected} (truncated or overwritten)"
    assert cli(["verify", str(ckpt)]) == 1 and line in capsys.readouterr().err
    with pytest.raises(CorruptCheckpointError) as e:
        train(tmp_path / "resumed", max_steps=6, resume=str(ckpt))
    assert line in str(e.value) and "Nothing was loaded" in str(e.value)
    assert "machine" not in str(e.value), str(e.value)  # one process: no machines to copy files between


def test_good_checkpoint_verifies(good, capsys):
    assert cli(["verify", str(good)]) == 0
    assert "sizes and checksums match" in capsys.readouterr().out


@pytest.mark.parametrize("hostile", ["../../outside.safetensors", "/etc/passwd", "sub/dir.safetensors", ".."])
def test_hostile_index_entry_is_rejected(ckpt, hostile, no_tensor_reads, capsys):
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = hostile
    _rewrite_consistently(ckpt, "optimizer.safetensors.index.json", json.dumps(index))
    assert cli(["verify", str(ckpt)]) == 1
    assert "hostile" in capsys.readouterr().err
    with pytest.raises(CorruptCheckpointError, match="hostile"):
        verify_checkpoint(ckpt)
    with pytest.raises(CorruptCheckpointError, match="hostile"):
        sio.ComponentReader(ckpt, "optimizer")


@pytest.mark.parametrize("hostile", ["../escape.bin", "/abs/path.bin"])
def test_hostile_manifest_entry_is_rejected(ckpt, hostile):
    manifest = json.loads((ckpt / "unified_checkpoint.json").read_text())
    manifest["files"][hostile] = {"size": 1, "crc32": "00000000"}
    (ckpt / "unified_checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="hostile"):
        verify_checkpoint(ckpt)


def test_unknown_manifest_version_is_refused_with_upgrade_hint(ckpt, tmp_path):
    manifest = json.loads((ckpt / "unified_checkpoint.json").read_text())
    manifest["format_version"] = 99
    (ckpt / "unified_checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsupportedCheckpointError, match="format_version 99.*Upgrade"):
        verify_checkpoint(ckpt)
    with pytest.raises(UnsupportedCheckpointError, match="format_version 99.*Upgrade"):  # docs/format.md
        train(tmp_path / "resumed", max_steps=6, resume=str(ckpt))


def test_corrupt_manifest_json_makes_the_folder_incomplete(ckpt, tmp_path, capsys):
    (ckpt / "unified_checkpoint.json").write_text("{not json")
    assert cli(["info", "--json", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "unified-incomplete" and info["complete"] is False and "not valid JSON" in info["reason"]
    with pytest.raises(IncompleteCheckpointError, match="not valid JSON"):
        train(tmp_path / "resumed", max_steps=6, resume=str(ckpt))


def _saved_layers(tmp_path, layers: int, width: int = 2):
    """A checkpoint of `layers` Linear(2, width) layers, and its model reader."""
    import torch
    from torch import nn

    from hf_unified_ckpt.engines.replicated import ReplicatedEngine
    from hf_unified_ckpt.options import UnifiedCheckpointOptions
    from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint

    model = nn.Sequential(*(nn.Linear(2, width) for _ in range(layers)))
    request = SaveRequest(tmp_path / "checkpoint-1", 1, UnifiedCheckpointOptions(enabled=True), show_progress=False)
    save_checkpoint(ReplicatedEngine(model, torch.optim.SGD(model.parameters(), lr=0.1)), request, {})
    return sio.ComponentReader(tmp_path / "checkpoint-1", "model")


@pytest.mark.parametrize("layers,width,words", [
    (13, 2, "missing 12 tensor(s): ['10.bias', '10.weight', '11.bias', '11.weight', '12.bias', ...]"),
    (1, 2, "unexpected 12 tensor(s): ["),
    (7, 3, "the model's load_state_dict refused the checkpoint's weights: Error(s) in loading state_dict for "
           "Sequential:\n\tsize mismatch for 0.weight: copying a param with shape torch.Size([2, 2]) from checkpoint"),
])
def test_model_mismatch_says_how_many_tensors_and_shows_the_first(tmp_path, layers, width, words):
    """Missing or unexpected keys: counted, the first few shown. Shapes: the module's own `load_state_dict` (as
    the native Trainer's resume) decides, and its error is passed on with the fix."""
    from torch import nn

    from hf_unified_ckpt.engines.replicated import ReplicatedEngine

    reader = _saved_layers(tmp_path, 7)
    model = nn.Sequential(*(nn.Linear(2, width) for _ in range(layers)))
    with pytest.raises(UnsupportedCheckpointError) as e:
        ReplicatedEngine(model, None).load_model(reader)
    assert words in str(e.value) and (", ...]" in str(e.value) or "size mismatch" in words), str(e.value)
    assert "Build the same architecture (config)" in str(e.value)


def test_adapter_mismatch_says_how_many_tensors(tmp_path):
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from hf_unified_ckpt.engines.replicated import ReplicatedEngine

    reader = _saved_layers(tmp_path, 7)  # plain weights: none of them is an adapter tensor
    model = get_peft_model(nn.Sequential(nn.Linear(2, 2)), LoraConfig(target_modules=["0"], r=1))
    with pytest.raises(UnsupportedCheckpointError) as e:
        ReplicatedEngine(model, None).load_model(reader)
    assert "missing 2 tensor(s): [" in str(e.value) and "unexpected 14 tensor(s): [" in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state_0.pth"])
def test_a_small_file_that_pickles_code_is_refused_by_name(ckpt, name, tmp_path, no_tensor_reads):
    """A `scheduler.pt` or `rng_state_0.pth` holding a pickle whose unpickling runs code (it writes a marker file),
    its manifest record re-signed as a forger would: the resume unpickles it with `weights_only` while it checks the
    folder, refusing it before any tensor is read with an error that names the file and the global; nothing runs."""
    from support.hostile import WritesMarker

    marker = tmp_path / "marker"
    state = torch.load(ckpt / name, weights_only=False)
    torch.save({**state, "extra": WritesMarker(marker)}, ckpt / name)
    resign(ckpt, name)
    with pytest.raises(UnsupportedCheckpointError, match=rf"{name} pickles builtins.eval"):
        train(tmp_path / "resumed", max_steps=6, resume=str(ckpt))
    assert not marker.exists()


# ---- per-parameter state that does not fit its parameter, the manifest re-signed (checksums match) -----------------
#: case -> (component stem, key, how its tensor is rewritten, what verify and the resume say of it)
BAD_STATE = {
    "moment of shape [1]": ("optimizer", "model.embed_tokens.weight/exp_avg", lambda t: t.reshape(-1)[:1].clone(),
                            "has shape [1], expected [97, 30] (its parameter's shape)"),
    "moment of the same size in another shape": (
        "optimizer", "model.layers.0.mlp.up_proj.weight/exp_avg_sq", lambda t: t.reshape(t.shape[1], t.shape[0]),
        "has shape [30, 46], expected [46, 30] (its parameter's shape)"),
    "I32 moment": ("optimizer", "model.layers.0.mlp.down_proj.weight/exp_avg", lambda t: t.to(torch.int32),
                   "is I32, expected a floating-point dtype"),
    "step of shape [1]": ("optimizer", "model.norm.weight/step", lambda t: t.reshape(1),
                          "has shape [1], expected [] ('step' is saved as a 0-d tensor)"),
    "EMA of shape [1]": ("ema", "model.embed_tokens.weight", lambda t: t.reshape(-1)[:1].clone(),
                         "has shape [1], expected [97, 30] (its weight's shape)"),
}


def _break_state(ckpt, case) -> str:
    """Rewrite one tensor as `BAD_STATE[case]` says and re-sign its file; the line naming it (file: key problem)."""
    stem, key, change, words = BAD_STATE[case]
    return f"{rewrite_tensor(ckpt, stem, key, change)}: {key!r} {words}"


@pytest.mark.parametrize("case", list(BAD_STATE))
def test_state_that_does_not_fit_its_parameter_is_named_by_verify_and_refused_before_the_first_step(
        ckpt, case, tmp_path, no_tensor_reads, capsys):
    """Issue 55 item 3: loaded unchecked, such moments made torch's AdamW write past its buffers."""
    line = _break_state(ckpt, case)
    assert cli(["verify", str(ckpt)]) == 1
    assert line in capsys.readouterr().err
    trainer = make_trainer(tmp_path / "resumed", max_steps=6)
    with pytest.raises(CorruptCheckpointError) as e:
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert line in str(e.value) and "Nothing was loaded" in str(e.value)
    assert max(h["step"] for h in trainer.state.log_history) == 3  # the saved history: no step after it
    assert trainer.state.global_step == 3 and not list((tmp_path / "resumed").glob("*checkpoint-*"))


SHARDED = {"z3": {"zero": 3}, "f2": {"fsdp": 2}}


@pytest.fixture(scope="module")
def sharded_refusals(good, tmp_path_factory):
    """ZeRO-3 and FSDP2 at 2 ranks (one launch) resuming a checkpoint with four tensors that do not fit."""
    tmp = tmp_path_factory.mktemp("bad-state")
    bad = tmp / "bad" / "checkpoint-3"
    shutil.copytree(good, bad)
    lines = [_break_state(bad, case) for case in BAD_STATE if case != "step of shape [1]"]
    torchrun(2, [{**engine, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"), "resume": str(bad),
                  "expect_error": lines[0]} for name, engine in SHARDED.items()], tmp)
    return tmp, lines, {name: torch.load(tmp / f"{name}.pt") for name in SHARDED}


@pytest.mark.dist
@pytest.mark.parametrize("engine", list(SHARDED))
def test_sharded_engines_refuse_state_that_does_not_fit_before_the_first_step(sharded_refusals, engine):
    tmp, lines, out = sharded_refusals
    assert out[engine]["error"].startswith("CorruptCheckpointError: ")
    assert out[engine]["global_step"] == 3  # the saved step: no step after it
    assert all(line in out[engine]["error"] for line in lines), out[engine]["error"]
    assert not list((tmp / engine).glob("*checkpoint-*"))
