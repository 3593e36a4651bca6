"""A trainer class's own `_save_checkpoint` and load hooks (issue 56; the side-by-side comparison with the native
Trainer is `test_native_parity.py`'s `hooked-*`, `grpo-*` and TRL scenarios): what the class writes into
`checkpoint-N` is part of the checkpoint in object storage and in the preemption save too, and is read back by its
load hook; a class built on the mixin runs its own hook; what cannot run is refused before the first step; a config
class made by `with_unified_checkpoint` unpickles in a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import Trainer, TrainerCallback

import hf_unified_ckpt
from support.env import reset_accelerate_state
from support.models import TokenDataset, build_model
from support.trainers import make_args
from hf_unified_ckpt.errors import TrainingPreempted, UnsupportedCheckpointError
from hf_unified_ckpt.store import read_bytes
from support.parity import _Recorder
from support.parity_trainers import hooked_trainer

HOOK_FILES = ["before_base.txt", "extra_state.json"]


def _hooked(output_dir, recorder=None, **overrides):
    reset_accelerate_state()
    recorder = recorder or _Recorder()
    args = make_args(output_dir, max_steps=4, save_steps=2, **overrides)
    trainer = hooked_trainer(recorder)(model=build_model("llama"), args=args, train_dataset=TokenDataset())
    return hf_unified_ckpt.attach(trainer), recorder


def _manifest(folder) -> dict:
    return json.loads(read_bytes(f"{folder}/unified_checkpoint.json"))


def test_the_class_hook_files_go_to_object_storage_and_are_read_back_on_resume(tmp_path):
    storage = f"memory://class-hooks-{os.getpid()}/run"
    trainer, _ = _hooked(tmp_path / "out", unified_checkpoint_storage=storage)
    trainer.train()
    for step in (2, 4):
        listed = _manifest(f"{storage}/checkpoint-{step}")["files"]
        assert set(HOOK_FILES) <= set(listed), listed
    assert json.loads(read_bytes(f"{storage}/checkpoint-2/extra_state.json")) == {"extra": 1.5, "step": 2}
    assert sorted(os.listdir(tmp_path / "out")) == [], "nothing left in output_dir (no hook folder, no stray file)"
    resumed, recorder = _hooked(tmp_path / "out", unified_checkpoint_storage=storage)
    resumed.train(resume_from_checkpoint=f"{storage}/checkpoint-2")
    load = next(c for c in recorder.calls if c[0] == "load_optimizer_and_scheduler")
    assert load[2] == {"extra": 1.5, "step": 2} and load[3], recorder.calls
    assert recorder.calls[-1][:3] == ["save", 4, True] and resumed.extra == 3.0


class _SignalAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_the_preemption_save_runs_the_class_hook(tmp_path):
    trainer, recorder = _hooked(tmp_path / "out", save_on_preemption=True, preemption_signals="SIGUSR1")
    trainer.add_callback(_SignalAt(3))
    with pytest.raises(TrainingPreempted):
        trainer.train()
    assert recorder.calls[-1] == ["save", 3, True, HOOK_FILES], recorder.calls
    assert set(HOOK_FILES) <= set(_manifest(tmp_path / "out" / "checkpoint-3")["files"])


def test_a_class_built_on_the_mixin_runs_its_own_save_checkpoint(tmp_path):
    reset_accelerate_state()

    class Mine(hf_unified_ckpt.UnifiedCheckpointMixin, Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            folder = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            with open(os.path.join(folder, "mine.txt"), "w") as f:
                f.write("mine")

    trainer = Mine(model=build_model("llama"), args=make_args(tmp_path, max_steps=2, save_steps=2),
                   train_dataset=TokenDataset())
    trainer.train()
    assert "mine.txt" in _manifest(tmp_path / "checkpoint-2")["files"]
    assert (tmp_path / "checkpoint-2" / "mine.txt").read_text() == "mine"


def test_a_class_overriding_a_native_write_is_refused_before_the_first_step(tmp_path):
    reset_accelerate_state()

    class SavesItsOwnRng(Trainer):
        def _save_rng_state(self, output_dir):
            super()._save_rng_state(output_dir)

    trainer = hf_unified_ckpt.attach(SavesItsOwnRng(model=build_model("llama"), train_dataset=TokenDataset(),
                                                    args=make_args(tmp_path, max_steps=2, save_steps=2)))
    with pytest.raises(UnsupportedCheckpointError, match=r"^SavesItsOwnRng overrides _save_rng_state, which the base"):
        trainer.train()
    assert trainer.state.global_step == 0 and not [p for p in os.listdir(tmp_path) if "checkpoint" in p]


def test_a_hook_writing_a_folder_is_refused_at_that_save_and_nothing_is_committed(tmp_path):
    reset_accelerate_state()

    class WritesAFolder(Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            folder = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            os.makedirs(os.path.join(folder, "extra"))

    trainer = hf_unified_ckpt.attach(WritesAFolder(model=build_model("llama"), train_dataset=TokenDataset(),
                                                   args=make_args(tmp_path, max_steps=2, save_steps=2)))
    with pytest.raises(UnsupportedCheckpointError, match=r"^WritesAFolder._save_checkpoint wrote the folder\(s\) "
                                                         r"\['extra'\] into checkpoint-2"):
        trainer.train()
    assert not [p for p in os.listdir(tmp_path) if "checkpoint" in p], os.listdir(tmp_path)


def test_a_config_class_bound_to_no_name_unpickles_equal_without_the_class_made_in_this_process(tmp_path):
    """`training_args.bin` of `with_unified_checkpoint(GRPOConfig)` (bound to no importable name): pickled by its base
    class, so a process that never made the class (its cache emptied here; `slow`: a fresh interpreter) unpickles it
    into an equal object."""
    from trl import GRPOConfig

    from hf_unified_ckpt import arguments

    made = hf_unified_ckpt.with_unified_checkpoint(GRPOConfig)
    args = made(output_dir=str(tmp_path), unified_checkpoint=True, unified_checkpoint_config="async_save",
                use_cpu=True, report_to=[])
    torch.save(args, tmp_path / "training_args.bin")
    del arguments._CACHE[GRPOConfig]
    try:
        loaded = torch.load(tmp_path / "training_args.bin", weights_only=False)
        fresh = hf_unified_ckpt.with_unified_checkpoint(GRPOConfig)
        assert fresh is not made and type(loaded) is fresh
        assert loaded == fresh(output_dir=str(tmp_path), unified_checkpoint=True,
                               unified_checkpoint_config="async_save", use_cpu=True, report_to=[])
        assert loaded.unified_checkpoint_options == args.unified_checkpoint_options
    finally:
        arguments._CACHE[GRPOConfig] = made


def test_a_hook_writing_by_a_path_built_from_output_dir_is_refused_at_that_save(tmp_path):
    """A class writing into `args.output_dir/checkpoint-N` (not `_get_output_dir(trial)`): that folder is the save's
    to write, so the files would be lost without a word; the save is refused, naming the class."""
    reset_accelerate_state()

    class BuildsItsOwnPath(Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "mine.txt"), "w") as f:
                f.write("mine")

    trainer = hf_unified_ckpt.attach(BuildsItsOwnPath(model=build_model("llama"), train_dataset=TokenDataset(),
                                                      args=make_args(tmp_path, max_steps=2, save_steps=2)))
    with pytest.raises(UnsupportedCheckpointError, match=r"^BuildsItsOwnPath._save_checkpoint wrote into .*"
                                                         r"checkpoint-2 by a path it did not get from"):
        trainer.train()
    assert not (tmp_path / "checkpoint-2" / "unified_checkpoint.json").exists()


FRESH = """
import sys, torch
from trl import GRPOConfig
from hf_unified_ckpt import with_unified_checkpoint
loaded = torch.load(sys.argv[1], weights_only=False)
expected = with_unified_checkpoint(GRPOConfig)(output_dir=sys.argv[2], unified_checkpoint=True,
                                               unified_checkpoint_config="async_save", use_cpu=True, report_to=[])
assert type(loaded) is with_unified_checkpoint(GRPOConfig), type(loaded)
assert loaded == expected and loaded.unified_checkpoint_options == expected.unified_checkpoint_options
print("equal")
"""


@pytest.mark.slow
def test_a_config_class_bound_to_no_name_unpickles_equal_in_a_fresh_interpreter(tmp_path):
    from trl import GRPOConfig

    args = hf_unified_ckpt.with_unified_checkpoint(GRPOConfig)(
        output_dir=str(tmp_path), unified_checkpoint=True, unified_checkpoint_config="async_save", use_cpu=True,
        report_to=[])
    torch.save(args, tmp_path / "training_args.bin")
    done = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "training_args.bin"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0 and done.stdout.strip().endswith("equal"), done.stderr[-3000:]
