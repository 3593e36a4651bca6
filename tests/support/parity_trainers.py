"""The trainer classes the parity harness (`parity.py`) runs besides the plain Trainer, each recording what the
runs compare: TRL's SFTTrainer, DPOTrainer and GRPOTrainer (adaptive entropy: its `_save_checkpoint` writes
`entropy_ctrl_state.json` into the checkpoint after the base save and its `_load_optimizer_and_scheduler` reads it
back), and a user's subclass (`HookedTrainer`) whose own `_save_checkpoint` writes a file into the checkpoint before
and after the base save, and whose load hooks read it back. All record the content of every training batch, and
the subclass every call of its hooks with what it found.

A scenario picks one with `"trainer"`: "plain" (default), "sft", "dpo", "grpo", "hooked"."""

from __future__ import annotations

import hashlib
import json
import os

import torch

#: Training arguments every TRL scenario of the harness adds (tiny runs: 2 CPU cores are shared).
TRL_ARGS = {"sft": dict(max_length=16), "dpo": dict(max_length=24),
            "grpo": dict(num_generations=2, max_completion_length=4, use_adaptive_entropy=True, entropy_coef=0.2,
                         entropy_coef_delta=0.05, per_device_train_batch_size=4, learning_rate=1e-2)}


def batch_digest(inputs) -> str:
    """The content of one training batch (its tensors by key; GRPO's rows of prompts as text), hashed."""
    digest = hashlib.sha256()
    if isinstance(inputs, list):
        digest.update(json.dumps(inputs, sort_keys=True, default=str).encode())
        return digest.hexdigest()[:16]
    for key in sorted(inputs):
        value = inputs[key]
        if isinstance(value, torch.Tensor):
            digest.update(key.encode())
            digest.update(value.detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()[:16]


def config_class(kind: str):
    """The config class of trainer `kind` (None: `UnifiedCheckpointArguments`): the plugin's TRL config classes for
    SFT and DPO, TRL's `GRPOConfig` (given the plugin's fields by `with_unified_checkpoint`, bound to no name)."""
    if kind == "sft":
        from hf_unified_ckpt.trl_configs import UnifiedSFTConfig
        return UnifiedSFTConfig
    if kind == "dpo":
        from hf_unified_ckpt.trl_configs import UnifiedDPOConfig
        return UnifiedDPOConfig
    if kind == "grpo":
        from trl import GRPOConfig
        return GRPOConfig
    return None


def _reward(completions, **kwargs):
    """GRPO's reward: longer completions score higher (no model, no server)."""
    return [len(c) / 10 for c in completions]


def recording(base: type, recorder):
    """`base` recording the batches it trains on."""

    class Recording(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            recorder.batches.append(batch_digest(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
    return Recording


def hooked_trainer(recorder):
    """A user's subclass of the Trainer with its own `_save_checkpoint` (a file written into the checkpoint folder
    before the base save, `_get_output_dir` as transformers computes it, another after it) and load hooks reading
    them back; every call recorded with the step, the folder's name and what it found."""
    from transformers import Trainer

    class HookedTrainer(recording(Trainer, recorder)):
        extra = 0.0

        def _folder(self, trial):
            return os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")

        def _save_checkpoint(self, model, trial):
            folder = self._folder(trial)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "before_base.txt"), "w") as f:
                f.write(f"step {self.state.global_step}")
            super()._save_checkpoint(model, trial)
            exists = os.path.isdir(folder)
            self.extra += 1.5
            if self.args.should_save:
                with open(os.path.join(folder, "extra_state.json"), "w") as f:
                    json.dump({"extra": self.extra, "step": self.state.global_step}, f)
            recorder.calls.append(["save", self.state.global_step, exists,
                                   sorted(n for n in os.listdir(folder) if n in ("before_base.txt", "extra_state.json"))])

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            found = None
            if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "extra_state.json")):
                with open(os.path.join(checkpoint, "extra_state.json")) as f:
                    found = json.load(f)
                self.extra = found["extra"]
            recorder.calls.append(["load_optimizer_and_scheduler", _name(checkpoint), found,
                                   checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "before_base.txt"))])

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            recorder.calls.append(["load_from_checkpoint", _name(resume_from_checkpoint)])
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

        def _load_rng_state(self, checkpoint):
            recorder.calls.append(["load_rng_state", _name(checkpoint)])
            return super()._load_rng_state(checkpoint)

    return HookedTrainer


def _name(path):
    return None if path is None else os.path.basename(os.path.normpath(str(path)))


def build_trainer(kind: str, recorder, model, training_args, train_set, eval_set, compute_metrics, callbacks):
    """The Trainer of trainer `kind` (see the module docstring) over `model`."""
    from transformers import Trainer

    if kind == "plain":
        cls = recording(Trainer, recorder)
        return cls(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                   compute_metrics=compute_metrics, callbacks=callbacks)
    if kind == "hooked":
        return hooked_trainer(recorder)(model=model, args=training_args, train_dataset=train_set,
                                        eval_dataset=eval_set, compute_metrics=compute_metrics, callbacks=callbacks)
    from datasets import Dataset
    from support.text import local_tokenizer, texts as sentences

    texts = sentences(48)
    if kind == "sft":
        from trl import SFTTrainer
        return recording(SFTTrainer, recorder)(model=model, args=training_args, callbacks=callbacks,
                                               train_dataset=Dataset.from_dict({"text": texts}),
                                               processing_class=local_tokenizer())
    if kind == "dpo":
        from support.models import build_model
        from trl import DPOTrainer
        pref = Dataset.from_dict({"prompt": texts[:24], "chosen": texts[24:], "rejected": texts[:24][::-1]})
        return recording(DPOTrainer, recorder)(model=model, ref_model=build_model("llama", seed=1), args=training_args,
                                               train_dataset=pref, processing_class=local_tokenizer(),
                                               callbacks=callbacks)
    if kind == "grpo":
        from trl import GRPOTrainer
        return recording(GRPOTrainer, recorder)(model=model, reward_funcs=_reward, args=training_args,
                                                train_dataset=Dataset.from_dict({"prompt": texts[:16]}),
                                                processing_class=local_tokenizer(), callbacks=callbacks)
    raise ValueError(kind)


#: Names that differ by design between a native checkpoint folder and a unified one (training-loop.md, "file names
#: inside checkpoint-N"): the weights' (ZeRO-3 natively writes none; the weights are compared by value), the
#: optimizer's and RNG's files, the engines' folders and scripts, the manifest.
_RENAMED = ("model.safetensors", "model-0", "pytorch_model", "optimizer.pt", "optimizer.bin", "rng_state",
            "global_step", "latest", "zero_to_fp32.py", "zero_to_torch.py", "optimizer_0", "unified_checkpoint.json",
            "optimizer.safetensors", "optimizer-0", "master", "ema")


def checkpoint_files(output_dir: str) -> dict[str, list[str]]:
    """The files of every `checkpoint-N` in `output_dir`, by name, the documented renames left out."""
    if not os.path.isdir(output_dir):
        return {}
    out = {}
    for name in sorted(os.listdir(output_dir)):
        folder = os.path.join(output_dir, name)
        if name.startswith("checkpoint-") and os.path.isdir(folder):
            out[name] = sorted(n for n in os.listdir(folder) if not n.startswith(_RENAMED))
    return out


def model_card(output_dir: str) -> str | None:
    """`output_dir/README.md` (TRL's model card), the run folder's own name written as `<run>`."""
    path = os.path.join(output_dir, "README.md")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().replace(os.path.basename(os.path.normpath(output_dir)), "<run>")
