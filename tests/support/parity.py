"""The native-parity harness: one scenario run twice, once with the plain Trainer, once with the plugin, and what a
user sees afterwards recorded the same way for both (`record`), so the test compares them field by field.

A scenario is a dict: `model` ("llama", "gpt2", "lora", "regression", "growing"), `args` (TrainingArguments),
`scores` ({step: value}: a scripted `eval_score` metric per evaluation, so where the best lands is chosen),
`engine` ({} one process / DDP, {"zero": 3}, {"fsdp": 2}), `plugin` (extra plugin arguments such as
`unified_checkpoint_config`), `first` (a run before the recorded one, in the same output folder: `{"args": ...}`),
`resume` (the recorded run's `resume_from_checkpoint`: True, "checkpoint-N", a missing or an empty path),
`train_twice` (a second `train()` on the same Trainer), `read_on_save` (a callback that reads the checkpoint folder
in `on_save`; `wait` first calls `hf_unified_ckpt.wait_for_saves()`), `trainer` (`parity_trainers.py`: "plain",
"sft", "dpo", "grpo", or "hooked", a user's subclass with its own `_save_checkpoint` and load hooks).

Every run computes with `support.env.THREADS` threads, so both runs of a scenario round alike.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn
from torch.utils.data import Dataset

from support.env import disable_deepspeed_jit, fsdp_on_cpu, reset_accelerate_state
from support.models import TokenDataset, build_model
from support.states import assert_sharded, final_state
from support.trainers import fsdp_args, make_args, zero_config
from support.parity_trainers import TRL_ARGS, build_trainer, checkpoint_files, config_class, model_card

#: Log keys that measure time, not training: never compared.
TIMING = ("runtime", "per_second", "step_time")


class RegressionDataset(Dataset):
    """y = 2x + 3 + noise, the Trainer's own regression test data (x of 5 features)."""

    def __init__(self, n: int = 48, seed: int = 42):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) * 2 + 3 + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModel(nn.Module):
    """A plain `nn.Module` (not a PreTrainedModel), uneven sizes (5 -> 7 -> 1), as the Trainer's tests use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(5, 7)
        self.out = nn.Linear(7, 1)

    def forward(self, input_x, labels=None, **kwargs):
        y = self.out(torch.tanh(self.hidden(input_x)))
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


class GrowingBufferModel(RegressionModel):
    """A module whose buffer grows in `forward` (one loss per training step) and whose `load_state_dict` takes
    the saved buffer's shape: the native Trainer resumes it through that override."""

    def __init__(self):
        super().__init__()
        self.register_buffer("history", torch.zeros(0))

    def forward(self, input_x, labels=None, **kwargs):
        out = super().forward(input_x, labels)
        if labels is not None and self.training:
            self.history = torch.cat([self.history, out[0].detach().reshape(1)])
        return out

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if "history" in state_dict:
            self.history = torch.empty_like(state_dict["history"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _model(kind: str):
    if kind == "regression":
        return RegressionModel()
    if kind == "growing":
        return GrowingBufferModel()
    return build_model(kind)


def _datasets(kind: str):
    if kind in ("regression", "growing"):
        return RegressionDataset(), RegressionDataset(12, seed=7)
    return TokenDataset(), TokenDataset(12, seed=7)


class _Recorder:
    """What the runs saw: the content of every training batch (in order), what `on_save` found in the checkpoint
    folder, and the calls of a subclass's checkpoint hooks (`parity_trainers.hooked_trainer`)."""

    def __init__(self):
        self.batches: list[str] = []
        self.on_save: list[dict] = []
        self.calls: list[list] = []


def _scripted_metric(scores: dict, holder: dict):
    """`compute_metrics` returning `eval_score` = scores[the step being evaluated]."""
    scores = {int(step): value for step, value in scores.items()}  # JSON keys (a launch's spec) are strings

    def compute_metrics(_prediction):
        return {"score": float(scores[holder["trainer"].state.global_step])}

    return compute_metrics


def _read_on_save(recorder: _Recorder, wait: bool):
    from transformers import TrainerCallback

    class ReadOnSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if wait:
                import hf_unified_ckpt

                hf_unified_ckpt.wait_for_saves()
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            seen = {"step": state.global_step, "folder": os.path.isdir(folder),
                    "trainer_state": os.path.isfile(os.path.join(folder, "trainer_state.json"))}
            if seen["trainer_state"]:
                with open(os.path.join(folder, "trainer_state.json")) as f:
                    saved = json.load(f)
                seen["saved_step"] = saved["global_step"]
                seen["saved_best"] = _name(saved.get("best_model_checkpoint"))
            recorder.on_save.append(seen)

    return ReadOnSave()


def _sharded_while_training(holder: dict):
    """FSDP really sharded the model (`support.states.assert_sharded`), checked at the first step of each run."""
    from transformers import TrainerCallback

    class Sharded(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                assert_sharded(holder["trainer"])

    return Sharded()


def _name(path):
    return None if path is None else os.path.basename(os.path.normpath(str(path)))


def build(scenario: dict, output_dir: str, plugin: bool, recorder: _Recorder, args: dict, world_size: int):
    """The Trainer of one run of `scenario` (plugin attached or not)."""
    import hf_unified_ckpt

    reset_accelerate_state()
    overrides = {**args}
    engine = scenario.get("engine", {})
    if engine.get("zero"):
        disable_deepspeed_jit()
        overrides["deepspeed"] = zero_config(engine["zero"])
    if engine.get("fsdp"):
        overrides.update(fsdp_args(engine["fsdp"], "SHARDED_STATE_DICT", scenario.get("model", "llama")))
    if scenario.get("scores"):
        overrides.setdefault("metric_for_best_model", "score")
    if plugin:
        overrides.update(scenario.get("plugin", {}))
        if "flash" in overrides.get("unified_checkpoint_config", ""):
            overrides["unified_checkpoint_memory_dir"] = f"{output_dir}-memory"
    trainer_kind = scenario.get("trainer", "plain")
    overrides = {**TRL_ARGS.get(trainer_kind, {}), **overrides}
    training_args = make_args(output_dir, world_size=world_size, unified_checkpoint=plugin,
                              config=config_class(trainer_kind), **overrides)
    kind = scenario.get("model", "llama")
    model = _model(kind)
    train_set, eval_set = _datasets(kind)
    holder = {}
    callbacks = [_read_on_save(recorder, scenario["read_on_save"] == "wait")] if scenario.get("read_on_save") else []
    if engine.get("fsdp"):
        callbacks.append(_sharded_while_training(holder))
    trainer = build_trainer(trainer_kind, recorder, model, training_args, train_set,
                            eval_set if training_args.eval_strategy != "no" else None,
                            _scripted_metric(scenario["scores"], holder) if scenario.get("scores") else None,
                            callbacks)
    holder["trainer"] = trainer
    if plugin:
        hf_unified_ckpt.attach(trainer)
    return trainer


def run(scenario: dict, output_dir: str, plugin: bool, world_size: int = 1) -> dict:
    """Run `scenario` natively or with the plugin in `output_dir`; what a user sees afterwards (`record`)."""
    shim = fsdp_on_cpu() if scenario.get("engine", {}).get("fsdp") else contextlib.nullcontext()
    recorder = _Recorder()
    error = None
    with shim:
        uninterrupted = None
        if "first" in scenario:
            first = build(scenario, output_dir, plugin, _Recorder(), {**scenario["args"], **scenario["first"]},
                          world_size)
            first.train()
            uninterrupted = {"weights": {k: v.detach().cpu().clone() for k, v in final_state(first).items()},
                             "log_history": _history(first.state)}
        trainer = build(scenario, output_dir, plugin, recorder, scenario["args"], world_size)
        resume = scenario.get("resume")
        if isinstance(resume, str) and resume != "missing":
            resume = os.path.join(output_dir, resume)
        elif resume == "missing":
            resume = os.path.join(output_dir, "no-such-checkpoint")
        try:
            trainer.train(resume_from_checkpoint=resume)
            if scenario.get("train_twice"):
                trainer.train()
        except Exception as e:  # noqa: BLE001 - the type and message are what is compared
            error = {"type": type(e).__name__, "value_error": isinstance(e, ValueError),
                     "message": str(e).replace(output_dir, "<output_dir>")}
    return {**record(trainer, recorder, output_dir, error), "uninterrupted": uninterrupted}


def _history(state) -> list[dict]:
    """The log history, without the entries that measure time."""
    return [{k: v for k, v in entry.items() if not any(t in k for t in TIMING)} for entry in state.log_history]


def record(trainer, recorder: _Recorder, output_dir: str, error: dict | None) -> dict:
    """What the harness compares: weights and buffers, the trainer state, the checkpoints left and the files in each
    (by name, the documented renames left out), `output_dir/README.md`, the batches, what `on_save` saw, the
    subclass's hook calls, the error. Collective under ZeRO-3 and FSDP (the weights are gathered)."""
    state = trainer.state
    history = _history(state)
    return {
        "weights": {k: v.detach().cpu().clone() for k, v in final_state(trainer).items()},
        "best_metric": state.best_metric, "best_global_step": state.best_global_step,
        "best_model_checkpoint": _name(state.best_model_checkpoint),
        "best_exists": state.best_model_checkpoint is not None and os.path.isdir(state.best_model_checkpoint),
        "global_step": state.global_step, "epoch": state.epoch, "log_history": history,
        "checkpoints": sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint-"))
        if os.path.isdir(output_dir) else [],
        "checkpoint_files": checkpoint_files(output_dir), "readme": model_card(output_dir),
        "batches": recorder.batches, "on_save": recorder.on_save, "calls": recorder.calls, "error": error,
    }


def run_pair(scenario: dict, workdir: str, world_size: int = 1) -> dict:
    """The scenario natively, then with the plugin, each in a folder of its own."""
    return {"native": run(scenario, os.path.join(workdir, "native"), False, world_size),
            "plugin": run(scenario, os.path.join(workdir, "plugin"), True, world_size)}
