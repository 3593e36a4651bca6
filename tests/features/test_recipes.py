"""The five recipes (examples/recipes/{pretrain,sft,dpo}.py with configs/recipes/*.yaml), launched as users launch
them: torchrun, `accelerate launch` (configs/accelerate/*.yaml) and the `deepspeed` launcher.

Each test trains a recipe for 6 steps with a unified checkpoint every 3 (that run is also the uninterrupted
baseline), resumes checkpoint-3 on another engine and/or number of processes with the same global batch
(per-device batch x processes), checks that the resumed losses of steps 4-6 and the final weights match the
baseline's, and loads the final checkpoint for inference (`from_pretrained`, or `PeftModel.from_pretrained` on the
same tiny base model for LoRA) and generates. FSDP runs go through tests/support/workers/recipe_runner.py, which keeps FSDP on CPU
(accelerate would silently run DDP) and asserts that the model was really sharded; the recipes run unchanged.

Tolerance: the number of processes or the engine changes the fp32 reduction order (measured about 1e-7), so as in
test_every_engine.py the losses may differ by LOSS_RTOL relative and the weights by STATE_ATOL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.paths import ROOT, WORKERS
from support.env import THREADS
from support.launches import _free_port

RECIPES = ROOT / "examples" / "recipes"
RUNNER = WORKERS / "recipe_runner.py"
RUNNER_CHECK_LINE = "recipe_runner: FSDP sharded the model"
LOSS_RTOL = STATE_ATOL = 1e-5
GLOBAL_BATCH = 8  # per_device_train_batch_size 4 in the YAMLs x 2 processes
FSDP2_ARGS = ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
              json.dumps({"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                          "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"})]


def _bin(name: str, module: str) -> list[str]:
    """The console script next to this interpreter (what users type), else its module."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def torchrun(nproc: int, *script_and_args) -> list[str]:
    return [*_bin("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node", str(nproc),
            *map(str, script_and_args)]


def accelerate(config: str, *script_and_args) -> list[str]:
    return [*_bin("accelerate", "accelerate.commands.accelerate_cli"), "launch", "--config_file",
            f"configs/accelerate/{config}.yaml", "--main_process_port", "0", *map(str, script_and_args)]


def deepspeed(nproc: int, *script_and_args) -> list[str]:
    return [*_bin("deepspeed", "deepspeed.launcher.runner"), "--num_gpus", str(nproc), "--master_port",
            str(_free_port()), *map(str, script_and_args)]


def python(*script_and_args) -> list[str]:
    return [sys.executable, *map(str, script_and_args)]


def recipe(name: str) -> str:
    return str(RECIPES / f"{name}.py")


def config(name: str) -> list[str]:
    return ["--config", f"configs/recipes/{name}.yaml"]


def launch(cmd: list[str], timeout: int = 300) -> str:
    """Run one launch from the repository root (relative config paths, as in the recipes' docstrings); on a timeout
    the launcher and the processes it started (its own session) are killed."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-5000:]}")
    if proc.returncode != 0:
        pytest.fail(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}\n{err[-8000:]}")
    return out + err


def assert_saved_by(folder: Path, **expected) -> None:
    """The manifest says which engine and how many processes wrote the checkpoint."""
    saved_by = json.loads((folder / "unified_checkpoint.json").read_text())["saved_by"]
    assert {k: saved_by[k] for k in expected} == expected, saved_by


def losses(folder: Path) -> dict[int, float]:
    state = json.loads((folder / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def assert_resume_matches(saved: Path, resumed: Path) -> None:
    """`resumed` (one launch from saved/checkpoint-3) continues `saved` (the uninterrupted run)."""
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-6"], "did not start at step 3"
    base, got = losses(saved / "checkpoint-6"), losses(resumed / "checkpoint-6")
    for step in (4, 5, 6):
        assert abs(got[step] - base[step]) <= LOSS_RTOL * abs(base[step]), (step, got[step], base[step])
    assert base[6] != base[3], "the loss did not move: nothing to compare"
    want, have = weights(saved / "checkpoint-6"), weights(resumed / "checkpoint-6")
    assert set(have) == set(want)
    for key, ref in want.items():
        assert torch.allclose(have[key].double(), ref.double(), rtol=0, atol=STATE_ATOL), key
    start = weights(saved / "checkpoint-3")
    assert any(not torch.equal(start[k], want[k]) for k in want), "steps 4-6 changed nothing"


def assert_generates(folder: Path, lora: bool) -> None:
    """The checkpoint loads for inference on its own (tokenizer included) and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("w1 w2 w3 w4 w5 w6", return_tensors="pt", add_special_tokens=False).input_ids
    if lora:
        from peft import PeftModel

        if str(RECIPES) not in sys.path:
            sys.path.insert(0, str(RECIPES))
        import tiny

        base = tiny.llama()  # the recipes' base model: the same config and seed
        with torch.no_grad():
            base_logits = base(ids).logits
        model = PeftModel.from_pretrained(base, folder)
        loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        saved = weights(folder)
        assert len(loaded) == len(saved) > 0
        assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, base_logits), "the adapter changes nothing"
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
        saved = weights(folder)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[0, : ids.shape[1]], ids[0])
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) or tokenizer.eos_token_id in out[0]


def run_output(tmp: Path, name: str) -> list[str]:
    return ["--output_dir", str(tmp / name)]


def resume_from(tmp: Path, name: str) -> list[str]:
    return ["--resume_from_checkpoint", str(tmp / name / "checkpoint-3")]


@pytest.mark.dist
def test_pretrain_zero3_deepspeed_launcher_resumes_on_one_process(tmp_path):
    """Pre-training from a config: DeepSpeed ZeRO-3 x 2 (the `deepspeed` launcher; the model is partitioned as
    from_config builds it) -> one plain `python` process."""
    out = launch(deepspeed(2, recipe("pretrain"), *config("pretrain"), *run_output(tmp_path, "saved"),
                           "--deepspeed", "configs/ds_zero3.json"))
    assert "built successfully" not in out  # the recipe switched off DeepSpeed's shared-memory op JIT build
    launch(python(recipe("pretrain"), *config("pretrain"), *run_output(tmp_path, "resumed"),
                  *resume_from(tmp_path, "saved"), "--per_device_train_batch_size", str(GLOBAL_BATCH)))
    assert_saved_by(tmp_path / "saved" / "checkpoint-3", engine="deepspeed", zero_stage=3, world_size=2)
    assert_saved_by(tmp_path / "resumed" / "checkpoint-6", world_size=1)
    assert_resume_matches(tmp_path / "saved", tmp_path / "resumed")
    assert_generates(tmp_path / "resumed" / "checkpoint-6", lora=False)


@pytest.mark.dist
def test_sft_fsdp2_accelerate_resumes_on_one_process(tmp_path):
    """SFT: FSDP2 x 2 (`accelerate launch` with configs/accelerate/fsdp2.yaml, through the FSDP-on-CPU runner)
    -> one process under torchrun."""
    out = launch(accelerate("fsdp2", RUNNER, recipe("sft"), *config("sft"), *run_output(tmp_path, "saved")))
    assert RUNNER_CHECK_LINE in out
    launch(torchrun(1, recipe("sft"), *config("sft"), *run_output(tmp_path, "resumed"),
                    *resume_from(tmp_path, "saved"), "--per_device_train_batch_size", str(GLOBAL_BATCH)))
    assert_saved_by(tmp_path / "saved" / "checkpoint-3", engine="fsdp", fsdp_version=2, world_size=2)
    assert_saved_by(tmp_path / "resumed" / "checkpoint-6", world_size=1)
    assert_resume_matches(tmp_path / "saved", tmp_path / "resumed")
    assert_generates(tmp_path / "resumed" / "checkpoint-6", lora=False)


@pytest.mark.dist
def test_dpo_zero2_torchrun_resumes_on_one_process(tmp_path):
    """DPO (full, with a reference model): DeepSpeed ZeRO-2 x 2 under torchrun -> one plain `python` process."""
    launch(torchrun(2, recipe("dpo"), *config("dpo"), *run_output(tmp_path, "saved"),
                    "--deepspeed", "configs/ds_zero2.json"))
    launch(python(recipe("dpo"), *config("dpo"), *run_output(tmp_path, "resumed"), *resume_from(tmp_path, "saved"),
                  "--per_device_train_batch_size", str(GLOBAL_BATCH)))
    assert_saved_by(tmp_path / "saved" / "checkpoint-3", engine="deepspeed", zero_stage=2, world_size=2)
    assert_saved_by(tmp_path / "resumed" / "checkpoint-6", world_size=1)
    assert_resume_matches(tmp_path / "saved", tmp_path / "resumed")
    assert_generates(tmp_path / "resumed" / "checkpoint-6", lora=False)


@pytest.mark.dist
def test_sft_lora_zero3_accelerate_resumes_on_fsdp2_at_one_process(tmp_path):
    """SFT-LoRA: DeepSpeed ZeRO-3 x 2 (`accelerate launch` with configs/accelerate/deepspeed_zero3.yaml) -> FSDP2 on
    one process (torchrun, the runner, FSDP from the command line)."""
    launch(accelerate("deepspeed_zero3", recipe("sft"), *config("sft_lora"), *run_output(tmp_path, "saved")))
    out = launch(torchrun(1, RUNNER, recipe("sft"), *config("sft_lora"), *run_output(tmp_path, "resumed"),
                          *resume_from(tmp_path, "saved"), "--per_device_train_batch_size", str(GLOBAL_BATCH),
                          *FSDP2_ARGS))
    assert RUNNER_CHECK_LINE in out
    assert_saved_by(tmp_path / "saved" / "checkpoint-3", engine="deepspeed", zero_stage=3, world_size=2)
    assert_saved_by(tmp_path / "resumed" / "checkpoint-6", engine="fsdp", world_size=1)
    assert_resume_matches(tmp_path / "saved", tmp_path / "resumed")
    assert_generates(tmp_path / "resumed" / "checkpoint-6", lora=True)


@pytest.mark.dist
def test_dpo_lora_fsdp2_torchrun_resumes_on_ddp_accelerate(tmp_path):
    """DPO-LoRA (the base model is the reference): FSDP2 x 2 (torchrun, the runner, FSDP from the command line) ->
    DDP x 2 (`accelerate launch` with configs/accelerate/ddp.yaml)."""
    out = launch(torchrun(2, RUNNER, recipe("dpo"), *config("dpo_lora"), *run_output(tmp_path, "saved"),
                          *FSDP2_ARGS))
    assert RUNNER_CHECK_LINE in out
    launch(accelerate("ddp", recipe("dpo"), *config("dpo_lora"), *run_output(tmp_path, "resumed"),
                      *resume_from(tmp_path, "saved")))
    assert_saved_by(tmp_path / "saved" / "checkpoint-3", engine="fsdp", fsdp_version=2, world_size=2)
    assert_saved_by(tmp_path / "resumed" / "checkpoint-6", engine="ddp", world_size=2)
    assert_resume_matches(tmp_path / "saved", tmp_path / "resumed")
    assert_generates(tmp_path / "resumed" / "checkpoint-6", lora=True)
