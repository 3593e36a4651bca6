"""Layout detection from file names, JSON and safetensors headers alone; lazy slice reads."""

import os
import json

import pytest
import torch
from safetensors.torch import save_file

from hf_unified_ckpt.checkpoint.folder.layout import detect_layout, newest_complete
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader


def _touch(folder, *names, state_step=None):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".safetensors"):
            save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "pt"})
        else:
            path.write_bytes(b"x")
    if state_step is not None:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": state_step}))
    return folder


@pytest.mark.parametrize("names,step,kind,complete", [
    (("model.safetensors", "optimizer.pt", "scheduler.pt"), 5, "hf-trainer", True),
    (("model.safetensors", "optimizer.pt"), None, "hf-trainer", False),  # trainer_state.json is written last
    (("global_step5/mp_rank_00_model_states.pt", "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "latest"), 5, "deepspeed", True),
    (("global_step5/mp_rank_00_model_states.pt",), 5, "deepspeed", False),
    (("pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__0_0.distcp"), 5, "fsdp", True),
    (("pytorch_model_fsdp.bin", "optimizer.bin"), 5, "fsdp", True),
    (("optimizer-00001-of-00002.safetensors", "model.safetensors"), None, "unified-incomplete", False),
    (("notes.txt",), None, "unknown", False),
])
def test_detect_layout(tmp_path, names, step, kind, complete):
    layout = detect_layout(_touch(tmp_path / "checkpoint-5", *names, state_step=step))
    assert (layout.kind, layout.complete) == (kind, complete), layout.reason
    if kind != "unknown":
        assert layout.global_step == 5
    if not complete:
        assert layout.reason


@pytest.mark.parametrize("name,complete", [("final-model", True), ("checkpoint-5", False)])
def test_deepspeed_folder_without_trainer_state(tmp_path, name, complete):
    """What Trainer.save_model writes under ZeRO-3 without 16-bit weights is a complete model folder (for
    conversion, not resumable); a checkpoint-N folder without trainer_state.json stays an interrupted save."""
    folder = _touch(tmp_path / name, "config.json", "zero_to_fp32.py",
                    "global_step5/zero_pp_rank_0_mp_rank_00_model_states.pt",
                    "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (folder / "latest").write_text("global_step5")
    layout = detect_layout(folder)
    assert (layout.kind, layout.complete, layout.global_step, layout.trainer_state) == ("deepspeed", complete, 5, False)
    assert ("save_model" if complete else "trainer_state.json is missing") in layout.reason


def test_truncated_legacy_weights_make_it_incomplete(tmp_path):
    folder = _touch(tmp_path / "checkpoint-2", "model.safetensors", state_step=2)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-3])
    layout = detect_layout(folder)
    assert not layout.complete and "truncated" in layout.reason


def test_newest_complete_skips_incomplete_and_hidden(tmp_path):
    _touch(tmp_path / "checkpoint-2", "model.safetensors", state_step=2)
    _touch(tmp_path / "checkpoint-10", "model.safetensors", state_step=10)
    _touch(tmp_path / "checkpoint-12", "model.safetensors")  # no trainer_state.json
    _touch(tmp_path / ".checkpoint-14.incomplete", "model.safetensors", state_step=14)
    assert os.path.basename(newest_complete(tmp_path).path) == "checkpoint-10"  # numeric, not lexical, order


def test_component_reader_reads_slices_lazily(tmp_path):
    t = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    save_file({"a.weight": t}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with ComponentReader(tmp_path, "model") as reader:
        assert reader.keys() == ["a.weight"] and reader.specs() == {"a.weight": ((8, 5), "F32")}
        assert torch.equal(reader.get_slice("a.weight")[3:5], t[3:5])
        with pytest.raises(KeyError, match="b.weight"):
            reader.get("b.weight")
