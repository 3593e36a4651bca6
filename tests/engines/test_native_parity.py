"""Parity with the native Trainer, side by side (`parity.py`): each scenario runs once with the plain Trainer and once
with the plugin, and afterwards every parameter and buffer (bit for bit), every `trainer.state` field a user reads
(best metric, best step, best checkpoint up to its folder name, log history, global step, epoch), the checkpoints
left by rotation, the batches trained on, what an `on_save` callback found, and the error of a failing run (its type
and the start of its message) must be the same. The deliberate differences (docs/training-loop.md, "Parity with the
native Trainer") are asserted as such: a plugin error that native raises as `ValueError` is one, and begins with
native's message, the plugin's explanation after it.

One-process scenarios run in this process (about 2 s a pair); the engine scenarios (DDP, ZeRO-2/3, FSDP2) share one
launch of 2 processes.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.launches import torchrun
from support.parity import run_pair

BEST = dict(max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True)
HIGHER = dict(BEST, greater_is_better=True)
LOWER = dict(BEST, greater_is_better=False)
EIGHT = dict(HIGHER, max_steps=8)
ASYNC = {"unified_checkpoint_config": "async_save"}
FLASH = {"unified_checkpoint_config": "flash", "unified_checkpoint_persist_every": 1}  # every save made durable
TRL_RESUME = dict(max_steps=6, save_steps=2)
TRL_SHORT = dict(max_steps=4, save_steps=2)
LAST, FIRST, MIDDLE = {2: 0.9, 4: 0.5, 6: 0.95}, {2: 0.95, 4: 0.5, 6: 0.9}, {2: 0.5, 4: 0.95, 6: 0.9}
LOW_LAST, LOW_FIRST, LOW_MIDDLE = {2: 0.9, 4: 0.5, 6: 0.1}, {2: 0.1, 4: 0.5, 6: 0.9}, {2: 0.5, 4: 0.1, 6: 0.9}
OLD_BEST_OF_4, MIDDLE_OF_4 = {2: 0.95, 4: 0.5, 6: 0.6, 8: 0.7}, {2: 0.5, 4: 0.95, 6: 0.6, 8: 0.7}

SCENARIOS = {
    # where the best lands, both ways of comparing
    "best-last-higher": {"args": HIGHER, "scores": LAST},
    "best-first-higher": {"args": HIGHER, "scores": FIRST},
    "best-middle-higher": {"args": HIGHER, "scores": MIDDLE},
    "best-last-lower": {"args": LOWER, "scores": LOW_LAST},
    "best-first-lower": {"args": LOWER, "scores": LOW_FIRST},
    "best-middle-lower": {"args": LOWER, "scores": LOW_MIDDLE},
    "best-eval-loss": {"args": dict(BEST, metric_for_best_model="eval_loss")},
    "best-between-saves": {"args": dict(HIGHER, eval_steps=1),  # best evaluated at step 3, which is not saved
                           "scores": {1: 0.1, 2: 0.5, 3: 0.99, 4: 0.2, 5: 0.3, 6: 0.4}},
    # rotation with the best old, young and last
    "limit1-best-first": {"args": dict(HIGHER, save_total_limit=1), "scores": FIRST},
    "limit1-best-last": {"args": dict(HIGHER, save_total_limit=1), "scores": LAST},
    "limit2-best-first": {"args": dict(EIGHT, save_total_limit=2), "scores": OLD_BEST_OF_4},
    "limit2-best-middle": {"args": dict(EIGHT, save_total_limit=2), "scores": MIDDLE_OF_4},
    # the loop's other options
    "epochs": {"args": dict(HIGHER, max_steps=-1, num_train_epochs=3, eval_strategy="epoch", save_strategy="epoch"),
               "scores": {16: 0.5, 32: 0.95, 48: 0.9}},
    "grad-accumulation": {"args": dict(HIGHER, per_device_train_batch_size=3, gradient_accumulation_steps=2),
                          "scores": LAST},
    "save-strategy-best": {"args": dict(HIGHER, save_strategy="best"), "scores": {2: 0.5, 4: 0.9, 6: 0.7}},
    "save-only-model": {"args": dict(HIGHER, save_only_model=True), "scores": FIRST},
    "plain-module": {"model": "regression", "args": HIGHER, "scores": LAST},
    "plain-module-limit1": {"model": "regression", "args": dict(HIGHER, save_total_limit=1), "scores": FIRST},
    "lora": {"model": "lora", "args": HIGHER, "scores": MIDDLE},
    "tied-gpt2": {"model": "gpt2", "args": dict(HIGHER, save_total_limit=2), "scores": FIRST},
    "train-twice": {"args": HIGHER, "scores": {**FIRST, 12: 0.1}, "train_twice": True},
    "on-save-reads-folder": {"args": HIGHER, "scores": LAST, "read_on_save": "read"},
    # resume
    "resume-mid-epoch": {"args": EIGHT, "scores": MIDDLE_OF_4, "first": {"max_steps": 4}, "resume": "checkpoint-4"},
    "resume-ignore-data-skip": {"args": dict(EIGHT, ignore_data_skip=True), "scores": MIDDLE_OF_4,
                                "first": {"max_steps": 4}, "resume": "checkpoint-4"},
    "resume-true-best-kept": {"args": EIGHT, "scores": OLD_BEST_OF_4, "first": {"max_steps": 4}, "resume": True},
    "resume-earlier": {"args": dict(EIGHT, save_total_limit=2), "scores": {**MIDDLE_OF_4, 6: 0.99},
                       "first": {"max_steps": 6, "save_total_limit": None},
                       "resume": "checkpoint-2"},
    "resume-plain-module": {"model": "regression", "args": EIGHT, "scores": LAST | {8: 0.2},
                            "first": {"max_steps": 4}, "resume": True},
    "resume-growing-buffer": {"model": "growing", "args": dict(max_steps=6, save_steps=2), "first": {"max_steps": 4},
                              "resume": "checkpoint-4"},
    "resume-missing-path": {"args": HIGHER, "scores": LAST, "fails": True, "resume": "missing"},
    "resume-empty-folder": {"args": HIGHER, "scores": LAST, "fails": True, "resume": "empty"},
    "resume-true-nothing-saved": {"args": HIGHER, "scores": LAST, "fails": True, "resume": True},
    # background saves
    "async-best-last": {"args": HIGHER, "scores": LAST, "plugin": ASYNC},
    "async-limit1-best-first": {"args": dict(HIGHER, save_total_limit=1), "scores": FIRST, "plugin": ASYNC},
    "async-on-save-waits": {"args": HIGHER, "scores": LAST, "plugin": ASYNC, "read_on_save": "wait"},
    "async-resume": {"args": EIGHT, "scores": MIDDLE_OF_4, "first": {"max_steps": 4}, "resume": True,
                     "plugin": ASYNC},
    "flash-best-last": {"args": HIGHER, "scores": LAST, "plugin": FLASH},
    # deliberate: flash makes every `persist_every`-th save durable (4 by default), the last and the best
    "flash-persist-every-4th": {"args": dict(EIGHT, save_total_limit=3), "scores": {**OLD_BEST_OF_4, 8: 0.1},
                                "plugin": {"unified_checkpoint_config": "flash"},
                                "differs": {"checkpoints": ([["checkpoint-2", "checkpoint-6", "checkpoint-8"]],
                                                            ["checkpoint-2", "checkpoint-8"])}},
    "flash-limit1-best-first": {"args": dict(HIGHER, save_total_limit=1), "scores": FIRST, "plugin": FLASH},
    "flash-limit2-best-middle": {"args": dict(EIGHT, save_total_limit=2), "scores": MIDDLE_OF_4, "plugin": FLASH},
    # bf16 autocast (on CPU)
    "bf16-best-middle": {"args": dict(HIGHER, bf16=True), "scores": MIDDLE},
    # the trainer class's own `_save_checkpoint` and load hooks (parity_trainers.py): GRPO with adaptive entropy
    # (entropy_ctrl_state.json, the model card) and a user's subclass writing a file before and after the base save;
    # resumed from checkpoint-4 of an uninterrupted run of the same length, sync, async and flash
    **{f"{kind}-resume{tag}": {"trainer": kind, "args": TRL_RESUME, "first": {}, "resume": "checkpoint-4",
                               **({"plugin": plugin} if plugin else {})}
       for kind in ("grpo", "hooked") for tag, plugin in (("", None), ("-async", ASYNC), ("-flash", FLASH))},
    # the chain runs once per save: one best decision, one rotation (the best kept under save_total_limit=1)
    "hooked-limit1-best-first": {"trainer": "hooked", "args": dict(HIGHER, save_total_limit=1), "scores": FIRST},
}

#: Best model, rotation and background saves under the sharded engines, 2 processes, one launch.
ENGINE_SCENARIOS = {
    "ddp-best-last": {"args": HIGHER, "scores": LAST},
    "z3-best-last": {"engine": {"zero": 3}, "args": HIGHER, "scores": LAST},
    "z3-limit1-best-first": {"engine": {"zero": 3}, "model": "gpt2", "args": dict(HIGHER, save_total_limit=1),
                             "scores": FIRST},  # tied embeddings
    "z3-async-best-middle": {"engine": {"zero": 3}, "args": HIGHER, "scores": MIDDLE, "plugin": ASYNC},
    "z2-flash-best-last": {"engine": {"zero": 2}, "args": HIGHER, "scores": LAST, "plugin": FLASH},
    # native FSDP (SHARDED_STATE_DICT) writes no model file before it looks for the best folder, so a best evaluated
    # at the step being saved is recorded only by a rank that looks after rank 0 made the folder (a race): native
    # ends with checkpoint-2 or checkpoint-6 (seen both), and loads that one's weights
    "f2-best-last": {"engine": {"fsdp": 2}, "args": HIGHER, "scores": LAST,
                     "differs": {"best_model_checkpoint": (["checkpoint-2", "checkpoint-6"], "checkpoint-6"),
                                 "weights": "best"}},
    "f2-limit1-best-first": {"engine": {"fsdp": 2}, "model": "gpt2", "args": dict(HIGHER, save_total_limit=1),
                             "scores": FIRST},  # tied embeddings
    "f2-flash-best-middle": {"engine": {"fsdp": 2}, "args": dict(EIGHT, save_total_limit=2), "scores": MIDDLE_OF_4,
                             "plugin": FLASH},
    # TRL's SFTTrainer and DPOTrainer (their own `_save_checkpoint` writes the model card): sync saves resumed within
    # a run of the same length, async and flash saves, each on another engine
    "ddp-sft-resume": {"trainer": "sft", "args": TRL_SHORT, "first": {}, "resume": "checkpoint-2"},
    "z3-sft-async": {"trainer": "sft", "engine": {"zero": 3}, "args": TRL_SHORT, "plugin": ASYNC},
    "z2-sft-flash": {"trainer": "sft", "engine": {"zero": 2}, "args": TRL_SHORT, "plugin": FLASH},
    "z3-dpo-resume": {"trainer": "dpo", "engine": {"zero": 3}, "args": TRL_SHORT, "first": {},
                      "resume": "checkpoint-2"},
    "ddp-dpo-async": {"trainer": "dpo", "args": TRL_SHORT, "plugin": ASYNC},
    "z2-dpo-flash": {"trainer": "dpo", "engine": {"zero": 2}, "args": TRL_SHORT, "plugin": FLASH},
}

#: Files a unified checkpoint always holds, which a native one may lack (FSDP's sharded state dict writes neither).
ALWAYS_WRITTEN = {"config.json", "generation_config.json", "training_args.bin"}
COMPARED = ("best_metric", "best_global_step", "best_model_checkpoint", "best_exists", "global_step", "epoch",
            "log_history", "checkpoints", "readme", "batches", "on_save", "calls")


def assert_parity(out: dict, scenario: dict) -> None:
    native, plugin = out["native"], out["plugin"]
    assert bool(native["error"]) == bool(scenario.get("fails")), native["error"]  # the scenario runs as meant
    if native["error"] or plugin["error"]:
        assert native["error"] and plugin["error"], (native["error"], plugin["error"])
        assert plugin["error"]["value_error"] == native["error"]["value_error"], (native["error"], plugin["error"])
        assert plugin["error"]["message"].startswith(native["error"]["message"]), (native["error"], plugin["error"])
    differs = scenario.get("differs", {})  # deliberate, or native's bug: (native's possible values, the plugin's)
    for key in COMPARED:
        natives, want = differs.get(key, ([native[key]], native[key]))
        assert native[key] in natives and plugin[key] == want, (key, native[key], plugin[key])
    for name in set(native["checkpoint_files"]) & set(plugin["checkpoint_files"]):  # "checkpoints" says which differ
        natives, plugins = set(native["checkpoint_files"][name]), set(plugin["checkpoint_files"][name])
        assert natives <= plugins and plugins - natives <= ALWAYS_WRITTEN, (name, natives, plugins)
    if scenario.get("first") == {}:  # resumed within a run of the same length: bit-exact against it, as natively
        for side in (native, plugin):  # the losses (TRL counts some metrics, `num_tokens`, per train() call)
            steps = [(e["step"], e["loss"]) for e in side["log_history"] if "loss" in e]
            assert steps == [(e["step"], e["loss"]) for e in side["uninterrupted"]["log_history"] if "loss" in e]
            whole = side["uninterrupted"]["weights"]
            assert [k for k, v in whole.items() if not torch.equal(side["weights"][k], v)] == []
    assert sorted(plugin["weights"]) == sorted(native["weights"])
    if differs.get("weights") == "best":  # the plugin's weights are its best checkpoint's, whatever native loaded
        from safetensors.torch import load_file

        native = {**native, "weights": load_file(os.path.join(out["plugin_dir"], plugin["best_model_checkpoint"],
                                                              "model.safetensors"))}
    assert [k for k, v in native["weights"].items() if not torch.equal(plugin["weights"][k], v)] == []


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_plugin_behaves_as_the_native_trainer(name, tmp_path):
    scenario = SCENARIOS[name]
    if scenario.get("resume") == "empty":
        for side in ("native", "plugin"):
            os.makedirs(tmp_path / side / "empty")
    elif scenario.get("resume") is True and not scenario.get("first"):
        for side in ("native", "plugin"):
            os.makedirs(tmp_path / side)
    assert_parity(run_pair(scenario, str(tmp_path)), scenario)


#: Sharded engines write saved tensors into their shards by position: a checkpoint of another shape is refused before
#: the first step, naming the tensor (one process and DDP leave it to the module's `load_state_dict`, as native).
SHAPE_REFUSALS = {"z3-other-shape": {"zero": 3}, "f2-other-shape": {"fsdp": 2}}


def _shape_runs(tmp) -> list[dict]:
    saver = {"zero": 3, "output_dir": str(tmp / "shape-saver"), "overrides": {"max_steps": 2, "save_steps": 2}}
    return [saver] + [{**engine, "model": "llama_tp", "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"),
                       "resume": str(tmp / "shape-saver" / "checkpoint-2"), "overrides": {"max_steps": 4},
                       "expect_error": "shape mismatch between checkpoint and model"}
                      for name, engine in SHAPE_REFUSALS.items()]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity-engines")
    runs = [{"parity": scenario, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt")}
            for name, scenario in ENGINE_SCENARIOS.items()]
    torchrun(2, runs + _shape_runs(tmp), tmp)
    return {name: {**torch.load(tmp / f"{name}.pt", weights_only=False), "plugin_dir": str(tmp / name / "plugin")}
            for name in [*ENGINE_SCENARIOS, *SHAPE_REFUSALS]}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(ENGINE_SCENARIOS))
def test_plugin_behaves_as_the_native_trainer_on_every_engine(engine_runs, name):
    assert_parity(engine_runs[name], ENGINE_SCENARIOS[name])


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SHAPE_REFUSALS))
def test_a_shape_the_sharded_engine_cannot_take_is_refused_before_the_first_step(engine_runs, name):
    out = engine_runs[name]
    assert out["global_step"] == 2, out  # the resumed step: no step was trained
    assert not [p for p in os.listdir(out["plugin_dir"].removesuffix("/plugin")) if "checkpoint-" in p]
    assert out["error"].startswith("UnsupportedCheckpointError: shape mismatch between checkpoint and model in "), out
    assert "model.layers.0.self_attn.q_proj.weight: checkpoint (30, 30) vs model (32, 32)" in out["error"], out
