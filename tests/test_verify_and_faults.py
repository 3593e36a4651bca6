"""Complete or loud: corrupted, truncated and missing files and hostile names are found before any tensor
loads, by `hf-unified-ckpt verify`, by `verify_checkpoint`, and by a Trainer resume."""

import json
import shutil

import pytest

import hf_unified_ckpt.checkpoint.safetensors_io as sio
from _runs import train
from hf_unified_ckpt.tools.cli import main as cli
from hf_unified_ckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError
from hf_unified_ckpt.checkpoint.load import verify_checkpoint
from hf_unified_ckpt.checkpoint.files import file_crc32


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    run = tmp_path_factory.mktemp("good")
    train(run, max_steps=3, save_steps=3, unified_checkpoint_max_shard_size="40KB")
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
    manifest = json.loads((ckpt / "unified_checkpoint.json").read_text())
    manifest["files"][name] = {"size": (ckpt / name).stat().st_size, "crc32": file_crc32(ckpt / name)}
    (ckpt / "unified_checkpoint.json").write_text(json.dumps(manifest))


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
    from hf_unified_ckpt.checkpoint.save import SaveRequest, save_checkpoint

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
