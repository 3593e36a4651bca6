"""TRL's SFTTrainer and DPOTrainer: two added lines (config class + attach), save unified, resume exactly."""

import pytest
import torch
from datasets import Dataset

import hf_unified_ckpt
from support.env import reset_accelerate_state
from support.models import build_model
from support.states import final_state
from support.text import local_tokenizer, texts
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

def _run(kind, output_dir, resume=None, model_kind="llama", how="attach"):
    from trl import DPOTrainer, SFTTrainer

    from hf_unified_ckpt.trl_configs import UnifiedDPOConfig, UnifiedSFTConfig

    reset_accelerate_state()
    common = dict(output_dir=str(output_dir), max_steps=4, save_steps=2, per_device_train_batch_size=4, use_cpu=True,
                  bf16=False, report_to=[], logging_steps=1, unified_checkpoint=True, disable_tqdm=True, seed=0)
    sentences = texts(48)
    callbacks = [hf_unified_ckpt.UnifiedCheckpointCallback()] if how == "callback" else None
    if kind == "sft":
        trainer = SFTTrainer(model=build_model(model_kind), args=UnifiedSFTConfig(max_length=16, **common),
                             train_dataset=Dataset.from_dict({"text": sentences}), processing_class=local_tokenizer(),
                             callbacks=callbacks)
    else:
        pref = Dataset.from_dict({"prompt": sentences[:24], "chosen": sentences[24:], "rejected": sentences[:24][::-1]})
        trainer = DPOTrainer(model=build_model(model_kind), ref_model=build_model("llama", seed=1),
                             args=UnifiedDPOConfig(max_length=32, **common), train_dataset=pref,
                             processing_class=local_tokenizer(), callbacks=callbacks)
    if how == "attach":
        hf_unified_ckpt.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.mark.parametrize("kind,model_kind", [("sft", "llama"), ("sft", "lora"), ("dpo", "llama"), ("dpo", "lora")])
def test_trl_trainer_saves_unified_and_resumes_exactly(kind, model_kind, tmp_path):
    trainer, base = _run(kind, tmp_path / "a", model_kind=model_kind)
    ckpt = tmp_path / "a" / "checkpoint-2"
    layout = detect_layout(ckpt)
    assert layout.kind == "unified" and layout.complete
    names = {p.name for p in ckpt.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert ("adapter_model.safetensors" in names) == (model_kind == "lora")
    resumed, losses = _run(kind, tmp_path / "b", resume=str(ckpt), model_kind=model_kind)
    assert [losses[s] for s in (3, 4)] == [base[s] for s in (3, 4)]
    a, b = final_state(trainer), final_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainer_with_the_callback_alone(kind, tmp_path):
    """`callbacks=[UnifiedCheckpointCallback()]` instead of attach: the TRL trainer saves unified and resumes
    exactly, like the attached one."""
    trainer, base = _run(kind, tmp_path / "a", how="callback")
    from hf_unified_ckpt.trainer.mixin import UnifiedCheckpointMixin

    assert isinstance(trainer, UnifiedCheckpointMixin)
    assert detect_layout(tmp_path / "a" / "checkpoint-2").kind == "unified"
    _, attached = _run(kind, tmp_path / "b")
    assert attached == base
    _, losses = _run(kind, tmp_path / "c", resume=str(tmp_path / "a" / "checkpoint-2"), how="callback")
    assert [losses[s] for s in (3, 4)] == [base[s] for s in (3, 4)]
