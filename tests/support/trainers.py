"""One Trainer run: its TrainingArguments (DeepSpeed ZeRO and FSDP configs), the Trainer, `train`.
"""

from __future__ import annotations

import os

import torch

from .env import THREADS, reset_accelerate_state
from .models import GLOBAL_BATCH, LAYER_CLASS, TokenDataset, build_model, pretrained_model, tp_model


_TP_TRAINERS: dict = {}


def tp_trainer_class():
    """`Trainer` with the plugin mixed in: the way to build a Trainer for a model sharded at load time, which the
    plain Trainer refuses to checkpoint with optimizer state in its `__init__`, before any callback runs."""
    if not _TP_TRAINERS:
        from transformers import Trainer

        from hf_unified_ckpt import UnifiedCheckpointMixin

        _TP_TRAINERS["cls"] = type("TPTrainer", (UnifiedCheckpointMixin, Trainer), {})
    return _TP_TRAINERS["cls"]


def make_args(output_dir, world_size: int = 1, max_steps: int = 6, save_steps: int = 3, optim: str = "adamw_torch",
              config: type | None = None, **overrides):
    """The arguments of a test run: `UnifiedCheckpointArguments`, or `config` (a TRL config class) with the plugin's
    fields (`with_unified_checkpoint`)."""
    from hf_unified_ckpt import UnifiedCheckpointArguments, with_unified_checkpoint

    kwargs = dict(
        output_dir=str(output_dir), per_device_train_batch_size=GLOBAL_BATCH // world_size,
        gradient_accumulation_steps=1, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
        logging_steps=1, learning_rate=5e-3, warmup_steps=1, lr_scheduler_type="linear", weight_decay=0.01,
        use_cpu=True, report_to=[], disable_tqdm=True, seed=0, optim=optim, unified_checkpoint=True,
        dataloader_num_workers=0, save_only_model=False,
    )
    if world_size > 1:
        kwargs["ddp_backend"] = "gloo"
    kwargs.update(overrides)
    return (UnifiedCheckpointArguments if config is None else with_unified_checkpoint(config))(**kwargs)


def zero_config(stage: int, fp16: dict | None = None, **extra) -> dict:
    """A DeepSpeed config for the Trainer ("auto" values filled from TrainingArguments); `fp16`: the loss
    scaler's settings (fp16 itself follows the arguments' `fp16`)."""
    return {"zero_optimization": {"stage": stage, **extra}, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", **(fp16 or {})}}


#: A dynamic loss scaler that moves within a few steps of the tiny model (measured: overflows at steps 4, 6, 10).
FP16_SCALER = {"fp16": {"loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 2,
                        "min_loss_scale": 1}}


def make_trainer(output_dir, model_kind: str = "llama", world_size: int = 1, optim: str = "adamw_torch",
                 attach: bool = True, eval_dataset=None, tp: tuple[int, int] | None = None, **overrides):
    """A Trainer (attached) for one run, computing with `THREADS` threads. `tp` = (tp_size, fsdp_size): the model is
    sharded at load time by transformers and the global batch is split over the data-parallel ranks only."""
    from transformers import Trainer

    import hf_unified_ckpt

    reset_accelerate_state()
    model_dtype = overrides.pop("model_dtype", None)
    if tp:
        world_size //= max(tp[0], 1)  # tp_size 0: expert parallelism (tp_model)
    args = make_args(output_dir, world_size=world_size, optim=optim, **overrides)
    if tp:
        model = tp_model(model_kind, *tp, os.path.dirname(os.path.abspath(str(output_dir))), model_dtype)
    elif model_kind.endswith("_pretrained"):
        model = pretrained_model(model_kind.removesuffix("_pretrained"), os.path.dirname(os.path.abspath(str(output_dir))))
    else:
        model = build_model(model_kind)
        if model_dtype:
            model = model.to(getattr(torch, model_dtype))
    cls = tp_trainer_class() if tp and attach else Trainer
    trainer = cls(model=model, args=args, train_dataset=TokenDataset(), eval_dataset=eval_dataset)
    if attach:
        hf_unified_ckpt.attach(trainer)
    assert torch.get_num_threads() == THREADS, "something changed the thread count after pin_threads()"
    return trainer


def train(output_dir, model_kind: str = "llama", resume=None, world_size: int = 1, optim: str = "adamw_torch",
          attach: bool = True, **overrides):
    """One Trainer run. Returns (trainer, {step: loss})."""
    trainer = make_trainer(output_dir, model_kind, world_size, optim, attach, **overrides)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses_of(trainer)


def losses_of(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def fsdp_args(version: int = 2, state_dict_type: str = "SHARDED_STATE_DICT", model: str = "llama") -> dict:
    """TrainingArguments for FSDP through the Trainer (full shard, one unit per decoder layer)."""
    config = {"version": version, "transformer_layer_cls_to_wrap": [LAYER_CLASS[model]],
              "state_dict_type": state_dict_type}
    if version == 2:
        config["reshard_after_forward"] = True
    else:
        config["sync_module_states"] = False  # needs an accelerator device; every rank builds the same model
    return {"fsdp": "full_shard auto_wrap", "fsdp_config": config}
