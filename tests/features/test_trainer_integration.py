"""Trainer integration on one process: from_pretrained, native write replaced, rotation, resume selection,
legacy plain-Trainer folders, refusals."""

import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_unified_ckpt
from support.env import reset_accelerate_state
from support.models import TokenDataset, build_model
from support.states import final_state
from support.trainers import losses_of, make_args, train
from hf_unified_ckpt.errors import CheckpointNotFoundError, UnsupportedCheckpointError
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(TokenDataset(4, seed=7).data).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_from_pretrained_gives_the_trained_logits_and_save_pretrained_names(kind, tmp_path):
    trainer, _ = train(tmp_path / "run", model_kind=kind, max_steps=3, save_steps=3)
    ckpt = tmp_path / "run" / "checkpoint-3"
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert torch.equal(_logits(loaded), _logits(trainer.model))
    trainer.model.save_pretrained(tmp_path / "native")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as ours, \
            safe_open(str(tmp_path / "native" / "model.safetensors"), "pt") as native:
        assert sorted(ours.keys()) == sorted(native.keys())
        assert ours.metadata() == {"format": "pt"}
        for key in native.keys():
            assert torch.equal(ours.get_tensor(key), native.get_tensor(key)), key
        if kind == "gpt2":
            assert "lm_head.weight" not in ours.keys() and loaded.lm_head.weight is loaded.transformer.wte.weight


def test_native_checkpoint_write_is_replaced_not_doubled(tmp_path, monkeypatch):
    calls = []
    for name in ("_save_optimizer_and_scheduler", "_save_rng_state", "save_model"):
        real = getattr(Trainer, name)
        monkeypatch.setattr(Trainer, name, lambda self, *a, _n=name, _r=real, **k: calls.append(_n) or _r(self, *a, **k))
    train(tmp_path, max_steps=3, save_steps=3)
    assert calls == []
    names = {p.name for p in (tmp_path / "checkpoint-3").iterdir()}
    assert not names & {"optimizer.pt", "pytorch_model.bin", "rng_state.pth"}
    assert {"model.safetensors", "optimizer.safetensors", "unified_checkpoint.json", "scheduler.pt",
            "trainer_state.json", "rng_state_0.pth", "config.json"} <= names


def test_direct_io_is_the_default_and_unified_checkpoint_direct_io_false_turns_it_off(tmp_path, monkeypatch):
    """Checkpoint files go through the direct writers by default; with `unified_checkpoint_direct_io=False` through
    the page cache only; the bytes are the same. (save_model on one plain process is the Trainer's own.)"""
    import os

    from hf_unified_ckpt.store import local

    used = []
    for name in ("write_at_direct", "write_whole_direct"):
        real = getattr(local, name)
        monkeypatch.setattr(local, name, lambda path, *a, _r=real, **k: used.append(os.path.basename(path)) or
                            _r(path, *a, **k))
    for run, direct_io in (("on", True), ("off", False)):
        used.clear()
        trainer, _ = train(tmp_path / run, max_steps=2, save_steps=2, unified_checkpoint_direct_io=direct_io)
        trainer.save_model(str(tmp_path / f"{run}_model"))
        assert trainer.args.unified_checkpoint_options.direct_io is direct_io
        written = {"model.safetensors", "optimizer.safetensors", "master_weights.safetensors"} & set(used)
        assert (written == {"model.safetensors", "optimizer.safetensors"}) if direct_io else used == [], (run, used)
    for name in ("checkpoint-2/model.safetensors", "checkpoint-2/optimizer.safetensors", "model.safetensors"):
        on, off = (tmp_path / "on" / name, tmp_path / "off" / name) if "/" in name else \
            (tmp_path / "on_model" / name, tmp_path / "off_model" / name)
        assert on.read_bytes() == off.read_bytes(), name


def test_rotation_keeps_limit_and_never_touches_incomplete(tmp_path):
    stray = tmp_path / "checkpoint-1"
    stray.mkdir(parents=True)
    (stray / "model.safetensors").write_bytes(b"junk")
    train(tmp_path, max_steps=6, save_steps=2, save_total_limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-4", "checkpoint-6"]


def test_resume_true_picks_newest_complete_and_says_what_it_skipped(tmp_path, caplog):
    _, base = train(tmp_path, max_steps=6, save_steps=3)
    (tmp_path / "checkpoint-6" / "unified_checkpoint.json").unlink()  # as if killed just before the commit
    assert detect_layout(tmp_path / "checkpoint-6").kind == "unified-incomplete"
    with caplog.at_level(logging.WARNING, logger="hf_unified_ckpt"):
        _, losses = train(tmp_path, max_steps=6, save_steps=3, resume=True)
    assert "Skipping" in caplog.text and "checkpoint-6" in caplog.text
    assert [losses[s] for s in (4, 5, 6)] == [base[s] for s in (4, 5, 6)]
    assert detect_layout(tmp_path / "checkpoint-6").complete


def test_resume_true_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        train(tmp_path, max_steps=3, resume=True)


def test_plain_trainer_folder_resumes_exactly_and_next_save_is_unified(tmp_path):
    _, base = train(tmp_path / "legacy", max_steps=6, save_steps=3, attach=False)
    legacy = tmp_path / "legacy" / "checkpoint-3"
    assert detect_layout(legacy).kind == "hf-trainer" and (legacy / "optimizer.pt").exists()
    trainer, losses = train(tmp_path / "resumed", max_steps=6, save_steps=3, resume=str(legacy))
    assert [losses[s] for s in (4, 5, 6)] == [base[s] for s in (4, 5, 6)]
    assert detect_layout(tmp_path / "resumed" / "checkpoint-6").kind == "unified"


def test_adafactor_resume_is_exact(tmp_path):
    trainer, base = train(tmp_path / "a", max_steps=6, save_steps=3, optim="adafactor")
    resumed, losses = train(tmp_path / "b", max_steps=6, resume=str(tmp_path / "a" / "checkpoint-3"), optim="adafactor")
    assert [losses[s] for s in (4, 5, 6)] == [base[s] for s in (4, 5, 6)]
    a, b = final_state(trainer), final_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_save_only_model_checkpoint_refuses_exact_resume(tmp_path):
    train(tmp_path / "a", max_steps=3, save_steps=3, save_only_model=True)
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert "optimizer.safetensors" not in {p.name for p in ckpt.iterdir()}
    with pytest.raises(UnsupportedCheckpointError, match="save_only_model"):
        train(tmp_path / "b", max_steps=6, resume=str(ckpt))


@pytest.mark.parametrize("overrides, word", [
    ({"unified_checkpoint_config": "async_save"}, "async_save with push_to_hub"),
    ({"unified_checkpoint_config": "flash", "unified_checkpoint_memory_dir": "MEMORY"}, "flash with push_to_hub"),
    ({"unified_checkpoint_storage": "memory://push-refusal/run"}, "unified_checkpoint_storage with push_to_hub"),
])
def test_push_to_hub_with_a_background_or_remote_save_is_refused_before_the_first_step(overrides, word, tmp_path):
    """The Hub upload reads output_dir right after a save: with a save still in flight, or checkpoints elsewhere,
    it would upload nothing or half. `train()` refuses before step 1 (push_to_hub is set after the Trainer is built:
    its __init__ would create the Hub repository, and nothing here reaches the network)."""
    reset_accelerate_state()
    overrides = {k: str(tmp_path / "memory") if v == "MEMORY" else v for k, v in overrides.items()}
    trainer = Trainer(model=build_model(), args=make_args(tmp_path / "out", **overrides), train_dataset=TokenDataset())
    hf_unified_ckpt.attach(trainer)
    trainer.args.push_to_hub = True
    with pytest.raises(UnsupportedCheckpointError, match=f"{word} is not supported yet.*Drop one of them"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_a_parameter_name_with_a_slash_is_refused_before_the_first_step(tmp_path):
    """'/' separates a parameter's name from its state's in optimizer keys: such a name is refused in train()
    (before step 1, naming the parameter), not at the first save."""
    reset_accelerate_state()
    model = build_model()
    model.register_parameter("odd/name", torch.nn.Parameter(torch.zeros(1)))
    trainer = Trainer(model=model, args=make_args(tmp_path / "out"), train_dataset=TokenDataset())
    hf_unified_ckpt.attach(trainer)
    with pytest.raises(UnsupportedCheckpointError, match=r"\['odd/name'\] contain '/'.*without '/'"):
        trainer.train()
    assert trainer.state.global_step == 0 and not list((tmp_path / "out").glob("checkpoint-*"))


def test_resume_from_a_folder_that_is_no_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match="^Can't find a valid checkpoint at .*no checkpoint files found.*readme.txt"):
        train(tmp_path / "b", max_steps=3, resume=str(tmp_path / "notes"))  # native's ValueError, native's words first


def test_the_callback_alone_gives_the_same_trainer_as_attach(tmp_path):
    """`Trainer(..., callbacks=[UnifiedCheckpointCallback()])` attaches that trainer (no global patching): the same
    save path, resume detection and checks as attach(trainer); saving and resuming alike."""
    from hf_unified_ckpt.trainer.mixin import UnifiedCheckpointMixin

    def run(out, resume=None, how="callback"):
        reset_accelerate_state()
        callbacks = [hf_unified_ckpt.UnifiedCheckpointCallback()] if how == "callback" else None
        trainer = Trainer(model=build_model(), args=make_args(out), train_dataset=TokenDataset(), callbacks=callbacks)
        if how == "attach":
            hf_unified_ckpt.attach(trainer)
        assert isinstance(trainer, UnifiedCheckpointMixin) and type(trainer) is not Trainer
        trainer.train(resume_from_checkpoint=resume)
        return trainer, losses_of(trainer)

    trainer, base = run(tmp_path / "a")
    assert sum(isinstance(c, hf_unified_ckpt.UnifiedCheckpointCallback) for c in trainer.callback_handler.callbacks) == 1
    assert detect_layout(tmp_path / "a" / "checkpoint-3").kind == "unified"
    _, attached = run(tmp_path / "b", how="attach")
    assert attached == base
    _, resumed = run(tmp_path / "c", resume=str(tmp_path / "a" / "checkpoint-3"))
    assert [resumed[s] for s in (4, 5, 6)] == [base[s] for s in (4, 5, 6)]
    with pytest.raises(CheckpointNotFoundError):  # the same resume checks (the run folder is no checkpoint)
        run(tmp_path / "d", resume=str(tmp_path / "a"))
    assert type(Trainer(model=build_model(), args=make_args(tmp_path / "e"), train_dataset=TokenDataset())) is Trainer


def test_callback_added_after_construction_is_an_error(tmp_path):
    reset_accelerate_state()
    trainer = Trainer(model=build_model(), args=make_args(tmp_path, max_steps=2), train_dataset=TokenDataset())
    trainer.add_callback(hf_unified_ckpt.UnifiedCheckpointCallback())
    with pytest.raises(RuntimeError, match="add_callback"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_attach_needs_the_plugin_arguments(tmp_path):
    reset_accelerate_state()
    trainer = Trainer(model=build_model(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                      train_dataset=TokenDataset())
    with pytest.raises(TypeError, match="UnifiedCheckpointArguments"):
        hf_unified_ckpt.attach(trainer)


def test_attach_is_per_instance_and_idempotent(tmp_path):
    reset_accelerate_state()
    args = make_args(tmp_path, max_steps=2)
    one = Trainer(model=build_model(), args=args, train_dataset=TokenDataset())
    two = Trainer(model=build_model(), args=args, train_dataset=TokenDataset())
    hf_unified_ckpt.attach(one)
    hf_unified_ckpt.UnifiedCheckpointCallback.attach(one)
    assert isinstance(one, hf_unified_ckpt.UnifiedCheckpointMixin) and isinstance(one, Trainer)
    assert not isinstance(two, hf_unified_ckpt.UnifiedCheckpointMixin) and type(two) is Trainer
    assert sum(isinstance(c, hf_unified_ckpt.UnifiedCheckpointCallback) for c in one.callback_handler.callbacks) == 1


def test_the_trainer_holds_only_its_session(tmp_path):
    """Issue 48: the plugin's state lives in one `CheckpointSession`; the Trainer holds `_uc_session` and no other
    `_uc_*` attribute, after a save (in the background, with an EMA) and after a resume, and one callback calls it."""
    from hf_unified_ckpt.trainer.hooks import SessionHooks
    from hf_unified_ckpt.trainer.session import CheckpointSession

    words = {"unified_checkpoint_config": "async_save ema"}
    saved, _ = train(tmp_path / "a", max_steps=3, save_steps=3, **words)
    resumed, _ = train(tmp_path / "b", max_steps=6, save_steps=3, resume=str(tmp_path / "a" / "checkpoint-3"), **words)
    for trainer in (saved, resumed):
        assert [name for name in vars(trainer) if name.startswith("_uc_")] == ["_uc_session"]
        assert isinstance(trainer._uc_session, CheckpointSession) and trainer._uc_session.trainer is trainer
        hooks = [c for c in trainer.callback_handler.callbacks if isinstance(c, SessionHooks)]
        assert len(hooks) == 1 and hooks[0].session is trainer._uc_session
    assert resumed._uc_session.resume.layout.path == str(tmp_path / "a" / "checkpoint-3")
    assert detect_layout(tmp_path / "b" / "checkpoint-6").kind == "unified"


def test_attach_lists_every_change_it_makes():
    """`attach`'s docstring names every Trainer method the mixin and the chain's classes (`chain.Outermost`,
    `chain.NativeStandIn`) override and every callback event it uses."""
    from hf_unified_ckpt.trainer import attach as attach_module
    from hf_unified_ckpt.trainer.chain import NativeStandIn, Outermost
    from hf_unified_ckpt.trainer.hooks import SessionHooks
    from hf_unified_ckpt.trainer.mixin import UnifiedCheckpointMixin

    overrides = [n for cls in (UnifiedCheckpointMixin, Outermost, NativeStandIn) for n in vars(cls)
                 if callable(getattr(Trainer, n, None)) and n != "__init__"]
    events = [n for n in vars(SessionHooks) if n.startswith("on_")]
    assert len(overrides) >= 14 and len(events) == 4
    missing = [n for n in overrides + events + ["_uc_session", "atexit"] if f"`{n}`" not in attach_module.__doc__]
    assert not missing, f"trainer/attach.py's docstring does not list {missing}"


def test_lora_checkpoint_loads_with_peft_from_pretrained(tmp_path):
    from peft import PeftModel

    trainer, _ = train(tmp_path, model_kind="lora", max_steps=3, save_steps=3)
    ckpt = tmp_path / "checkpoint-3"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in ckpt.iterdir()}
    assert "model.safetensors" not in {p.name for p in ckpt.iterdir()}
    loaded = PeftModel.from_pretrained(build_model("llama"), ckpt)
    assert torch.equal(_logits(loaded), _logits(trainer.model))


def test_damaged_legacy_fsdp_folder_is_a_clear_error(tmp_path):
    """A folder that looks like accelerate's sharded FSDP save but holds no readable DCP data."""
    from hf_unified_ckpt.errors import CorruptCheckpointError

    legacy = tmp_path / "checkpoint-2"
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        (legacy / sub).mkdir(parents=True)
        (legacy / sub / "__0_0.distcp").write_bytes(b"x")
    (legacy / "trainer_state.json").write_text('{"global_step": 2}')
    with pytest.raises(CorruptCheckpointError, match="pytorch_model_fsdp_0 is not a readable"):
        train(tmp_path / "b", max_steps=3, resume=str(legacy))
