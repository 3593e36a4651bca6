"""Shared fixtures for Trainer runs in tests and in the torchrun worker: a tiny model, data, one run.

Sizes are deliberately odd (vocab 97, hidden 30, intermediate 46) so nothing divides evenly by 2 or 3 ranks.
The global batch (6) is kept constant across world sizes 1, 2 and 3.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import time

import torch
from torch.utils.data import Dataset

GLOBAL_BATCH = 6
SEQ_LEN = 16
VOCAB = 97
#: Intra-op threads of every run (DESIGN.md section 5: thread counts change float rounding by about one ulp), so
#: runs compared bit-exactly compute alike whatever the machine or the caller's environment sets.
THREADS = 1


def pin_threads() -> None:
    """Compute with `THREADS` intra-op threads in this process and in the processes it starts (accelerate sets
    its own count when OMP_NUM_THREADS is unset)."""
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


def freeze_imports() -> None:
    """Import the training stack, then move every object alive now to the garbage collector's permanent generation
    (`gc.freeze`): the Trainer, accelerate and DeepSpeed call `gc.collect()` several times per run, and each call
    otherwise walks the ~440,000 objects of the imported modules (0.2 s each). Test harness only: objects created
    later are collected as usual."""
    import gc

    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import transformers.trainer  # noqa: F401

    gc.collect()
    gc.freeze()


def free_process_group_users() -> None:
    """Collect the finished runs' Trainers and models before the process group is destroyed. They sit in reference
    cycles, so without this they are freed at interpreter exit, and an FSDP2 model keeps the process group and its
    last gloo work objects (holding tensors) alive until then: their C++ destructors running during finalization
    abort the process now and then ("terminate called without an active exception", SIGABRT, pytorch#179291),
    seen in 3 of about 45 CI runs, always in a launch with FSDP2 runs. Measured in such a launch: 33 modules and the
    Trainer still alive after the runs, none after this."""
    import gc

    gc.collect()


class TokenDataset(Dataset):
    """Fixed-length random token sequences (no padding, so per-rank token counts are equal)."""

    def __init__(self, n: int = 96, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i].clone(), "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long)}


def build_model(kind: str = "llama", seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=30, intermediate_size=46, num_hidden_layers=2,
                             num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                             tie_word_embeddings=False)
        return LlamaForCausalLM(config)
    if kind == "gpt2":  # tied embeddings
        config = GPT2Config(vocab_size=VOCAB, n_embd=30, n_layer=2, n_head=3, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return GPT2LMHeadModel(config)
    if kind == "llama_s3":  # embeddings of 12 MB: each of 2 ranks holds more than S3's 5 MiB smallest part of them
        return LlamaForCausalLM(LlamaConfig(vocab_size=6007, hidden_size=512, intermediate_size=343,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                                            max_position_embeddings=64, tie_word_embeddings=False))
    if kind in TP_LLAMA:  # heads tensor parallelism can split, widths it cannot split evenly
        return LlamaForCausalLM(LlamaConfig(**TP_LLAMA[kind]))
    if kind in MOE:
        return _moe_model(kind)
    if kind == "hrm_text":  # saves fused gate_up_proj / gqkv_proj, holds them split: a concatenation when saved
        from transformers import HrmTextConfig, HrmTextForCausalLM

        return HrmTextForCausalLM(HrmTextConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=46,
                                                num_hidden_layers=2, num_attention_heads=3, head_dim=8,
                                                max_position_embeddings=64))
    if kind == "lora_moe":  # adapters on attention and on the fused experts (PEFT's target_parameters)
        from peft import LoraConfig, get_peft_model

        base = build_model("qwen3_moe", seed)
        return get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                               lora_dropout=0.0))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        base = build_model("llama", seed)
        return get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    raise ValueError(kind)


#: Mixture-of-Experts models (transformers 5 fuses their experts at run time; save_pretrained writes them per expert):
#: hidden and expert widths that are multiples of 8 (the grouped expert kernels need 16-byte strides, in bf16 too;
#: DESIGN.md section 5), 5 experts (3 + 2 rows at 2 ranks; every ZeRO partition boundary cuts an expert), vocab 97. `qwen3_moe_square`: experts of
#: intermediate size = hidden size (conversions that decide a transposition by comparing shapes; transformers
#: #47031). `deepseek_v3`: a dense first layer, routed + shared experts, MLA attention, a persistent bias buffer.
MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=46, moe_intermediate_size=8, num_experts=5, num_experts_per_tok=2, head_dim=10)),
    "qwen3_moe_square": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=46, moe_intermediate_size=32, hidden_size=32, num_experts=5, num_experts_per_tok=2,
        head_dim=8)),
    "qwen3_moe_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # lm_head is the embedding
        intermediate_size=46, moe_intermediate_size=8, num_experts=5, num_experts_per_tok=2, head_dim=10,
        tie_word_embeddings=True)),
    "qwen3_moe_ep": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # 4 experts: expert parallelism splits evenly
        intermediate_size=46, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=10)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=8, num_local_experts=5, num_experts_per_tok=2, head_dim=10)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=46, moe_intermediate_size=8, n_routed_experts=5, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=10, rope_interleave=False)),
}


@contextlib.contextmanager
def _environ(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _moe_model(kind: str):
    import transformers

    config_cls, model_cls, fields = MOE[kind]
    base = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                max_position_embeddings=64, tie_word_embeddings=False)
    config = getattr(transformers, config_cls)(**{**base, **fields})
    return getattr(transformers, model_cls)(config)


#: Llamas that transformers' tensor-parallel plan can shard at 2 ranks (it splits attention by heads: 4 heads, 2 KV
#: heads), with rows that still split unevenly (vocab 97: 49/48; intermediate 37: 19/18); one with tied embeddings.
TP_LLAMA = {kind: dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
            for kind, tied in (("llama_tp", False), ("llama_tp_tied", True))}


def tp_model(kind: str, tp_size: int, fsdp_size: int, workdir, dtype: str | None = None):
    """The `kind` model loaded as tensor-parallel users load it: `from_pretrained` with a `DistributedConfig`, which
    shards it at load time (DTensor parameters on a (fsdp, tp) mesh; FSDP2 applied by transformers when
    fsdp_size > 1), from the seeded weights rank 0 writes first."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import torch.distributed as dist

    if not dist.is_initialized():  # transformers writes from rank 0 only once there is a process group
        dist.init_process_group("gloo")
    folder = os.path.join(str(workdir), f"pretrained-{kind}")
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(folder, "config.json")):
        build_model(kind).save_pretrained(folder)
    dist.barrier()
    config = DistributedConfig(tp_size=tp_size, fsdp_size=fsdp_size) if tp_size else \
        DistributedConfig(ep_size=fsdp_size, fsdp_size=fsdp_size)  # tp_size 0: expert parallelism over fsdp_size
    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype or "float32"),
                                                distributed_config=config)


def pretrained_model(kind: str, workdir):
    """The `kind` model loaded as users load one: `from_pretrained` of the files `save_pretrained` wrote (rank 0
    writes them once; for a Mixture-of-Experts model, per expert), under whatever DeepSpeed config is active."""
    from transformers import AutoModelForCausalLM

    import torch.distributed as dist

    folder = os.path.join(str(workdir), f"pretrained-{kind}")
    if (not dist.is_initialized() or dist.get_rank() == 0) and not os.path.isfile(os.path.join(folder, "config.json")):
        build_model(kind).save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # zero.Init partitions at load: DeepSpeed's process group first (DESIGN.md 5)
        import deepspeed

        deepspeed.init_distributed("gloo")
    return AutoModelForCausalLM.from_pretrained(folder)


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


def reset_accelerate_state() -> None:
    """Prepare this process for another Trainer run: several runs share one process (DESIGN.md section 5), and
    every run computes with `THREADS` threads. Every run a test makes starts here."""
    from accelerate.state import AcceleratorState

    pin_threads()

    AcceleratorState._reset_state(reset_partial_state=False)
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        os.environ.pop(var, None)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        return
    unset_hf_deepspeed_config()
    _reset_deepspeed_autotp()


def _reset_deepspeed_autotp() -> None:
    """DeepSpeed AutoTP records its first `tp_model_init` (size, dtype, group) for the whole process and refuses a
    later run that differs (a bf16 run after an fp32 one): forgotten here, as a new process would. Its model- and
    data-parallel groups stay for the process too, so a launch runs its DeepSpeed runs without AutoTP first."""
    import sys

    init_utils = sys.modules.get("deepspeed.runtime.tensor_parallel.init_utils")
    if init_utils is not None:
        init_utils._TP_MODEL_INIT_ARGS = None


def zero_config(stage: int, fp16: dict | None = None, **extra) -> dict:
    """A DeepSpeed config for the Trainer ("auto" values filled from TrainingArguments); `fp16`: the loss
    scaler's settings (fp16 itself follows the arguments' `fp16`)."""
    return {"zero_optimization": {"stage": stage, **extra}, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", **(fp16 or {})}}


#: A dynamic loss scaler that moves within a few steps of the tiny model (measured: overflows at steps 4, 6, 10).
FP16_SCALER = {"fp16": {"loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 2,
                        "min_loss_scale": 1}}


def fp16_on_cpu() -> None:
    """Test-only: DeepSpeed's CPU accelerator reports fp16 unsupported where the CPU lacks AVX512-FP16/AMX-FP16
    ("Type fp16 is not supported on your device"); the fp16 optimizer itself runs on CPU. Lifted for this process
    so fp16 code paths run as on a GPU."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True


def disable_deepspeed_jit() -> None:
    """Skip DeepSpeed's JIT compile of its shared-memory allreduce op (DESIGN.md section 5)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


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


def assert_sharded(trainer) -> None:
    """FSDP really sharded the model: DTensor parameters (FSDP2) or FlatParameters (FSDP1), not DDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    model = trainer.model_wrapped
    params = list(model.parameters())
    world = torch.distributed.get_world_size()
    if isinstance(model, FullyShardedDataParallel):
        handles = [m._handle for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle is not None]
        from torch.distributed.fsdp._flat_param import FlatParameter

        assert handles and all(isinstance(h.flat_param, FlatParameter) for h in handles), "no FlatParameters"
        full = sum(h.flat_param._unpadded_unsharded_size.numel() for h in handles)
        assert sum(p.numel() for p in params) < full or world == 1
    else:
        assert params and all(isinstance(p, DTensor) for p in params), f"not sharded: {type(model).__name__}"
        local = sum(p.to_local().numel() for p in params)
        assert local < sum(p.numel() for p in params) or world == 1


def assert_tensor_parallel(trainer, tp_size: int, fsdp_size: int) -> None:
    """transformers really sharded the model: every linear weight is a DTensor split over a `tp` mesh dimension of
    `tp_size` (and an `fsdp` one of `fsdp_size`), holding less than the whole tensor on this rank."""
    from torch.distributed.tensor import DTensor

    linears = {n: p for n, p in trainer.model_wrapped.named_parameters() if n.endswith("proj.weight")}
    assert linears and all(isinstance(p, DTensor) for p in linears.values()), "not tensor-parallel"
    for name, p in linears.items():
        sizes = dict(zip(p.device_mesh.mesh_dim_names, p.device_mesh.shape))
        assert sizes.get("tp") == tp_size and sizes.get("fsdp", 1) == fsdp_size, (name, sizes)
        assert p.to_local().numel() < p.numel(), name


def _has_dtensors(model) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def final_state(trainer) -> dict[str, torch.Tensor]:
    """Full model weights by name on every rank. Collective under ZeRO-3: all ranks call it."""
    from accelerate.utils import extract_model_from_parallel

    module = extract_model_from_parallel(trainer.model_wrapped)
    if getattr(trainer, "is_fsdp_enabled", False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(trainer.model_wrapped, options=StateDictOptions(full_state_dict=False))
        return {k: _full(v).detach().clone() for k, v in sd.items()}
    if getattr(trainer, "is_deepspeed_enabled", False):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: _autotp_full(v, v.detach().clone()) for k, v in module.state_dict(keep_vars=True).items()}
    return {k: _full(v).detach().clone() for k, v in module.state_dict().items()}  # DTensors: tensor parallelism


def _autotp_full(p, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of an AutoTP-sharded parameter's slice `local` (as it is for unsharded ones), gathered over
    the TP group along the dimension DeepSpeed's metadata names. Collective over the TP group."""
    from deepspeed.module_inject.layers import DS_AUTOTP_UC_META
    from deepspeed.utils import groups

    meta = getattr(p, DS_AUTOTP_UC_META, None)
    if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
        return local
    dim, sizes = meta["partition_dim"], meta["partition_sizes"]
    shape = list(local.shape)
    shape[dim] = max(sizes)
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    pieces = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(pieces, padded, group=groups.get_tensor_model_parallel_group())
    return torch.cat([t.narrow(dim, 0, n) for t, n in zip(pieces, sizes)], dim=dim)


def assert_autotp(trainer, tp_size: int) -> None:
    """DeepSpeed AutoTP really sharded the model: its linears are AutoTP layers holding less than the full
    weight, split over a tensor-parallel group of `tp_size`."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    layers = [m for m in trainer.model_wrapped.module.modules() if isinstance(m, TensorParallel_Layer)]
    assert layers, "no AutoTP layers"
    for layer in layers:
        assert layer.tp_world_size == tp_size and layer.weight.numel() < math.prod(layer._orig_weight_shape), layer


def _gather_sharded(t) -> torch.Tensor:
    """A ShardedTensor (FSDP1) gathered on every rank; plain tensors as they are. Collective."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(t, ShardedTensor):
        return t
    out = torch.empty(tuple(t.size()), dtype=t.dtype) if torch.distributed.get_rank() == 0 else None
    t.gather(dst=0, out=out)
    box = [out]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else _gather_sharded(t)


def optimizer_state(trainer) -> dict[str, torch.Tensor]:
    """Optimizer state (and fp32 master weights under DeepSpeed) keyed by name, as full tensors on every rank.
    Collective under DeepSpeed: all ranks call it."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return _deepspeed_full_state(trainer)
    if getattr(trainer, "is_fsdp_enabled", False) or _has_dtensors(trainer.model_wrapped):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(trainer.model_wrapped, trainer.optimizer,
                                       options=StateDictOptions(full_state_dict=False))
        return {f"{name}/{key}": _full(value).detach().clone() for name, per in osd["state"].items()
                for key, value in per.items() if key != "step"}
    from hf_unified_ckpt.engines.replicated import ReplicatedEngine

    engine = ReplicatedEngine(trainer.model_wrapped, trainer.optimizer)
    names = [s.name for s in engine.specs("optimizer")]
    return {n: t.detach().clone() for n, t in engine.tensors("optimizer", names).items()}


def _deepspeed_full_state(trainer) -> dict[str, torch.Tensor]:
    """Independent of the library: DeepSpeed's own public accessors, for every trainable parameter."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = trainer.model_wrapped.optimizer
    if hasattr(zero, "_hp_optimizer_states_linked"):  # DeepSpeed 0.19 links only the first group after step 1
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in trainer.model_wrapped.module.named_parameters():
        if p.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}/{key}"] = _autotp_full(p, safe_get_full_optimizer_state(p, key).detach().cpu().clone())
            out[f"{name}/master"] = _autotp_full(p, safe_get_full_fp32_param(p).detach().cpu().clone())
    return out


def record(trainer, losses) -> dict:
    """What a resume-equivalence test compares: per-step losses, final weights, final optimizer state (and the
    best checkpoint, for load_best_model_at_end)."""
    return {"losses": losses, "state": final_state(trainer), "optim": optimizer_state(trainer),
            "global_step": trainer.state.global_step, "best": trainer.state.best_model_checkpoint,
            "best_global_step": trainer.state.best_global_step}


def spec_of(kinds: dict, tmp, kind: str, tag: str, resume: tuple[str, int] | None = None, **overrides) -> dict:
    """The run spec of a `kind` (its fields in `kinds`) writing into `tmp/tag` and its record into `tmp/tag.pt`,
    resumed from `tmp/<resume[0]>/checkpoint-<resume[1]>`, with extra TrainingArguments `overrides`."""
    spec = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kinds[kind].items()}
    spec["overrides"] = {**spec.get("overrides", {}), **overrides}
    spec.update(output_dir=str(tmp / tag), result=str(tmp / f"{tag}.pt"))
    if resume:
        spec["resume"] = str(tmp / resume[0] / f"checkpoint-{resume[1]}")
    return spec


def hop_tag(hop) -> str:
    """The tag of a resume hop (saved by, resumed as, world size)."""
    return f"{hop[0]}-to-{hop[1]}-at{hop[2]}"


def run_spec(run: dict, world_size: int) -> dict:
    """Execute one run described as a dict (the format the torchrun worker reads). "zero": N runs DeepSpeed
    ZeRO stage N; "slow_snapshot": seconds an async save's snapshot sleeps before it copies."""
    if run.get("slow_snapshot"):
        with slow_snapshot(run["slow_snapshot"]):
            return run_spec({k: v for k, v in run.items() if k != "slow_snapshot"}, world_size)
    if run.get("die_at_commit"):
        with die_at_commit(*run["die_at_commit"]):
            return run_spec({k: v for k, v in run.items() if k != "die_at_commit"}, world_size)
    if run.get("die_mid_write"):
        with die_mid_write(*run["die_mid_write"]):
            return run_spec({k: v for k, v in run.items() if k != "die_mid_write"}, world_size)
    if run.get("memory_full_from"):
        with memory_full_from(run["memory_full_from"]):
            return run_spec({k: v for k, v in run.items() if k != "memory_full_from"}, world_size)
    if run.get("record_reuse"):  # how many files the saves wrote over spare files (the memory tier's reuse)
        with record_reuse() as reused:
            return {**run_spec({k: v for k, v in run.items() if k != "record_reuse"}, world_size), "reused": reused}
    if run.get("record_buffers"):  # the snapshot's host buffers: made before the first save, then reused
        with record_buffers() as buffers:
            return {**run_spec({k: v for k, v in run.items() if k != "record_buffers"}, world_size),
                    "buffers": buffers}
    if run.get("record_plans"):  # each save's collectives, how its plan was made, the rule against what is held
        from hf_unified_ckpt import dist

        with record_plans() as saves:
            result = run_spec({k: v for k, v in run.items() if k != "record_plans"}, world_size)
        torch.save(saves, f"{run['result']}.rank{dist.rank()}")  # every rank's, for the bench's counts
        return {**result, "saves": saves}
    if run.get("record_hand_overs"):  # per file, the hand-over bytes this rank received and those the plan gives it
        from hf_unified_ckpt import dist

        with record_hand_overs() as files:
            result = run_spec({k: v for k, v in run.items() if k != "record_hand_overs"}, world_size)
        torch.save(files, f"{run['result']}.rank{dist.rank()}")
        return result
    if run.get("unreadable_bytes") is not None:  # this rank cannot produce its bytes of any file of a bucket save
        with unreadable_bytes(run["unreadable_bytes"]):
            return run_spec({k: v for k, v in run.items() if k != "unreadable_bytes"}, world_size)
    if run.get("break_rule"):  # an engine whose pieces are not its declared rule's (shifted by one element)
        with broken_rule():
            return run_spec({k: v for k, v in run.items() if k != "break_rule"}, world_size)
    if run.get("record_aggregation"):  # per save, the files aggregated, this rank's cells and its buffers' peak
        with record_aggregation() as saves:
            result = run_spec({k: v for k, v in run.items() if k != "record_aggregation"}, world_size)
        from hf_unified_ckpt import dist

        torch.save(saves, f"{run['result']}.aggregation.rank{dist.rank()}")
        return result
    if run.get("aggregation_fault"):  # [fault, rank, step]: a fault in an aggregated save; each rank's outcome
        return _with_aggregation_fault(run, world_size)
    if run.get("record_pieces"):  # which tensors each save writes in place, piece by piece (no assembling)
        with record_pieces() as pieces:
            return {**run_spec({k: v for k, v in run.items() if k != "record_pieces"}, world_size), "pieces": pieces}
    if run.get("env"):  # environment variables of this run only (e.g. accelerate's MoE leaf-module classes)
        with _environ(run["env"]):
            return run_spec({k: v for k, v in run.items() if k != "env"}, world_size)
    overrides = dict(run.get("overrides", {}))
    model = run.get("model", "llama")
    if run.get("zero"):
        disable_deepspeed_jit()
        overrides["deepspeed"] = zero_config(run["zero"], **(FP16_SCALER if run.get("fp16") else {}))
    if run.get("autotp"):  # DeepSpeed AutoTP: the global batch is split over the data-parallel ranks only
        overrides["deepspeed"]["tensor_parallel"] = {"autotp_size": run["autotp"]}
        overrides["per_device_train_batch_size"] = GLOBAL_BATCH * run["autotp"] // world_size
    if run.get("fp16"):
        fp16_on_cpu()
        if run.get("forget_loss_scaler"):  # the control: a resume that leaves the scaler as configured
            from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine

            DeepSpeedEngine._restore_loss_scaler = lambda self, saved: None
    if run.get("fsdp"):
        overrides.update(fsdp_args(run["fsdp"], run.get("fsdp_state_dict_type", "SHARDED_STATE_DICT"), model))
    if run.get("eval"):  # evaluation every save, e.g. for load_best_model_at_end
        overrides["eval_dataset"] = TokenDataset(12, seed=7)
    shim = run.get("fsdp") and run.get("fsdp_shim", True)  # without it accelerate runs DDP on CPU, silently
    tp = tuple(run["tp"]) if run.get("tp") else None  # (tp_size, fsdp_size)
    with fsdp_on_cpu() if shim else tp_on_cpu() if tp else contextlib.nullcontext():
        trainer = make_trainer(run["output_dir"], model, world_size, run.get("optim", "adamw_torch"),
                               tp=tp, **overrides)
        if run.get("expect_error"):
            return _refused(trainer, run.get("resume"), run["expect_error"])
        if run.get("fused_keys"):  # what the plugin wrote before conversions were handled: the run-time names
            trainer._uc_session.conversion = None
        if run.get("plant_ties"):  # before RecordAt: what is recorded (and saved) at that step holds the ties
            PlantTies(trainer, run["plant_ties"])
        at = RecordAt(trainer, run["record_at"]) if run.get("record_at") else None
        every = RecordWeights(trainer) if run.get("record_weights") else None
        scaler = RecordLossScaler(trainer) if run.get("fp16") else None
        if run.get("stop_after_save"):
            trainer.add_callback(stop_after_save(trainer, *run["stop_after_save"]))
        revived = KillPersister(trainer, *run["kill_persister"]) if run.get("kill_persister") else None
        trainer.train(resume_from_checkpoint=run.get("resume"))
    if shim:
        assert_sharded(trainer)
    if tp:
        assert_tensor_parallel(trainer, *tp)
    if run.get("autotp"):
        assert_autotp(trainer, run["autotp"])
    if run.get("save_model"):  # the trainer's save_model after training, as a user calls it
        trainer.save_model(run["save_model"])
    session = vars(trainer).get("_uc_session")  # None: a plain Trainer
    resumed = session.resume if session is not None else None
    return {**record(trainer, losses_of(trainer)), **({"at": at.record} if at else {}),
            "resumed_from": resumed.layout.path if resumed is not None else None,
            **(scaler.result() if scaler else {}),
            **({"weights": every.record} if every else {}),
            **({"durable_while_training": revived.durable} if revived else {})}


def trainable_fp32(trainer) -> dict[str, torch.Tensor]:
    """The fp32 values the optimizer updates, by name, full, on every rank: DeepSpeed's fp32 master weights, else
    the trainable parameters. Collective under DeepSpeed and FSDP."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().cpu().clone()
                for n, p in trainer.model_wrapped.module.named_parameters() if p.requires_grad}
    from accelerate.utils import extract_model_from_parallel

    state = final_state(trainer)
    names = [n for n, p in extract_model_from_parallel(trainer.model_wrapped).named_parameters() if p.requires_grad]
    return {n: state[n].float() for n in names}


def _wait_until(ready, timeout: float) -> bool:
    """Poll `ready` every 0.1 s for up to `timeout` seconds; whether it became true."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class KillPersister:
    """Flash: SIGKILL the run's persister when step `kill_at` begins (rank 0; the kernel releases its lock, and the
    next save that commits finds it free), then, when step `check_at` begins, wait up to 60 s for checkpoint `name` to be durable in output_dir (`durable`: True
    if it was, while training still runs; a killed persister is otherwise only replaced when train() ends)."""

    def __init__(self, trainer, kill_at: int, check_at: int, name: str):
        import signal
        import subprocess

        import torch.distributed as dist
        from transformers import TrainerCallback

        from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

        self.durable = None
        outer = self

        def kill() -> None:
            run = trainer._uc_session.flash.run
            found = subprocess.run(["pgrep", "-f", f"hf_unified_ckpt.flash.persister {run}"], capture_output=True,
                                   text=True).stdout.split()
            assert found, "no persister to kill"
            for pid in found:
                os.kill(int(pid), signal.SIGKILL)

        def durable() -> bool:
            folder = os.path.join(trainer.args.output_dir, name)
            return os.path.isdir(folder) and detect_layout(folder).committed

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if dist.get_rank() != 0:
                    return
                if state.global_step + 1 == kill_at:
                    kill()
                if state.global_step + 1 == check_at:
                    outer.durable = _wait_until(durable, 60)

        trainer.add_callback(_Callback())


class RecordWeights:
    """Records `trainable_fp32` after every optimizer step, by step (what an EMA averages)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.record = {}
        outer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer.record[state.global_step] = trainable_fp32(trainer)

        trainer.add_callback(_Callback())


class RecordLossScaler:
    """DeepSpeed fp16: the loss scaler's state (and skipped steps) after every step, when training begins (what a
    resume loaded), and at the end."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        from hf_unified_ckpt.engines.deepspeed import SCALER_FIELDS

        self.at, self.start, outer = {}, None, self

        def state():
            engine = trainer.model_wrapped
            scaler = engine.optimizer.loss_scaler
            return {**{k: getattr(scaler, k) for k in SCALER_FIELDS}, "skipped_steps": engine.skipped_steps}

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, st, control, **kwargs):
                outer.start = state()

            def on_step_end(self, args, st, control, **kwargs):
                outer.at[st.global_step] = state()

        self.state = state
        trainer.add_callback(_Callback())

    def result(self) -> dict:
        return {"scaler_at": self.at, "scaler_at_start": self.start, "loss_scaler": self.state()}


class PlantTies:
    """DeepSpeed bf16: at the end of step `step`, makes every `every`-th fp32 master element whose bf16 weight has
    an even last bit a tie that rounds down to that weight (`bf16_bits << 16 | 0x8000`), through DeepSpeed's own
    `safe_set_full_fp32_param`: the bf16 weights stay their master's rounding, and the bf16 residual must list
    these elements as ties (rounded down, they are one more than int16 holds). Natural ties are about one value in
    130,000: the tests' small models have none. Collective (callbacks run on every rank)."""

    def __init__(self, trainer, step: int, every: int = 37):
        from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
        from transformers import TrainerCallback

        def plant(p) -> None:
            master = safe_get_full_fp32_param(p).detach().cpu().reshape(-1)
            high = master.to(torch.bfloat16).view(torch.int16).to(torch.int32)
            chosen = torch.zeros_like(master, dtype=torch.bool)
            chosen[::every] = (high[::every] & 1) == 0
            bits = torch.where(chosen, (high << 16) | 0x8000, master.view(torch.int32))
            safe_set_full_fp32_param(p, bits.view(torch.float32).view(p.ds_shape if hasattr(p, "ds_id") else p.shape))

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    for p in trainer.model_wrapped.module.parameters():
                        if p.requires_grad:
                            plant(p)

        trainer.add_callback(_Callback())


class RecordAt:
    """Records weights and optimizer state at step `step`: at the end of that step (what the save at that step
    writes), or when training begins there (what a resume from that step loaded). On every rank (a collective under
    DeepSpeed and FSDP: callbacks run on all ranks)."""

    def __init__(self, trainer, step: int):
        from transformers import TrainerCallback

        self.record = None
        outer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    outer.record = {"state": final_state(trainer), "optim": optimizer_state(trainer)}

            on_train_begin = on_step_end

        trainer.add_callback(_Callback())


def resign(ckpt, name: str) -> None:
    """What anyone crafting a file does (a CRC-32 is a checksum, not a signature): record file `name`'s new size and
    CRC-32 in the checkpoint's manifest, so that its checksums match again."""
    import json

    from hf_unified_ckpt.checkpoint.folder.files import file_crc32

    path = os.path.join(str(ckpt), "unified_checkpoint.json")
    with open(path) as f:
        manifest = json.load(f)
    file = os.path.join(str(ckpt), name)
    manifest["files"][name] = {"size": os.path.getsize(file), "crc32": file_crc32(file)}
    with open(path, "w") as f:
        json.dump(manifest, f)


def rewrite_tensor(ckpt, stem: str, key: str, change) -> str:
    """Replace tensor `key` of component `stem` by `change(tensor)` in the safetensors file holding it, and re-sign
    that file (`resign`). Returns the file's name."""
    import json

    from safetensors.torch import load_file, save_file

    with open(os.path.join(str(ckpt), f"{stem}.safetensors.index.json")) as f:
        name = json.load(f)["weight_map"][key]
    path = os.path.join(str(ckpt), name)
    tensors = load_file(path)
    tensors[key] = change(tensors[key]).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    resign(ckpt, name)
    return name


def _refused(trainer, resume, expected: str) -> dict:
    """A run that must be refused: its error, and how many steps it trained first."""
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        assert expected in str(e), f"expected {expected!r} in: {e}"
        return {"error": f"{type(e).__name__}: {e}", "global_step": trainer.state.global_step}
    raise AssertionError(f"the run was expected to fail with {expected!r}")


@contextlib.contextmanager
def slow_snapshot(seconds: float):
    """An async save's snapshot sleeps before it copies: a training step that did not wait for the copy would
    change the weights or optimizer state first, and the resume from that checkpoint would not be exact."""
    from hf_unified_ckpt.checkpoint.save.snapshot import Snapshots

    original = Snapshots.take

    def late(self, *args):
        time.sleep(seconds)
        return original(self, *args)

    Snapshots.take = late
    try:
        yield
    finally:
        Snapshots.take = original


def die_at_commit(when: str, nth: int):
    """This process dies as under kill -9 (no cleanup, no exception) at its `nth` folder commit (the store's
    `publish` of a `checkpoint-N` folder), "before" or "after" the rename that commits its folder."""
    from faulty_store import die, injected, on
    from faulty_store import nth as nth_call
    from hf_unified_ckpt.store import name_of

    def dying(call):
        if when == "before":
            die()
        call.proceed()
        die()

    return injected(on("publish", nth_call(nth, lambda call: re.fullmatch(r"checkpoint-\d+", name_of(call.args[1]))),
                       dying))


def memory_full_from(step: int):
    """Writes into the memory tier's checkpoints of `step` and later fail with ENOSPC (a full tmpfs), on every
    rank: what a full `/dev/shm` does, without filling the real one (it is RAM)."""
    from faulty_store import fail_with, injected, no_space, on

    def full(call) -> bool:
        match = re.search(r"/hf_unified_ckpt/.*checkpoint-(\d+)", call.ref)
        return match is not None and int(match.group(1)) >= step

    return injected(on(("write_whole", "write_at", "map_writable"), full, fail_with(no_space)))


def stop_after_save(trainer, step: int, marker: str, mode: str):
    """A callback: once the save of `step` has committed (its background write waited for, on every rank), rank 0
    writes `marker`, then every rank either holds (sleeps until killed: "hold") or dies as under kill -9 ("exit";
    only in the first attempt of a torchrun with --max-restarts, so the restarted workers train on)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    class StopAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
                return
            trainer._uc_session.saver.wait()
            if dist.is_initialized():
                dist.barrier()
            if not dist.is_initialized() or dist.get_rank() == 0:
                with open(marker, "w") as f:
                    f.write(str(step))
            if mode == "hold":
                time.sleep(3600)
            os._exit(9)

    return StopAfterSave()


@contextlib.contextmanager
def record_reuse():
    """Record what this rank's saves did with the memory tier's files: how many files were written over a spare
    file (`writer.reuse_spare`), written (`SharedFileWriter.write`), of them placed by the snapshot's copy straight
    into the file (`SharedFileWriter.place`), copied into through a mapping made earlier; and the bytes of the
    snapshot's host buffers after each save's snapshot."""
    from hf_unified_ckpt.checkpoint.write import writer
    from hf_unified_ckpt.checkpoint.save.snapshot import Snapshots
    from hf_unified_ckpt.store import WritableMaps

    originals = writer.reuse_spare, writer.SharedFileWriter.write, WritableMaps.view, Snapshots.take
    record = {"spare": 0, "written": 0, "placed": 0, "mapped_before": 0, "host_buffer_bytes": []}
    seen = []

    def reuse(spare, ref):
        used = originals[0](spare, ref)
        record["spare"] += used
        return used

    def write(self, folder, file, tensors):
        record["written"] += 1
        record["placed"] += isinstance(tensors, writer.Placed)
        return originals[1](self, folder, file, tensors)

    def view(self, path, size):
        mapped = originals[2](self, path, size)
        record["mapped_before"] += any(mapped.obj is old for old in seen)
        seen.append(mapped.obj)
        return mapped

    def stage(self, *args):
        job = originals[3](self, *args)
        record["host_buffer_bytes"].append(self.buffers.nbytes())
        return job

    writer.reuse_spare, writer.SharedFileWriter.write, WritableMaps.view, Snapshots.take = reuse, write, view, stage
    try:
        yield record
    finally:
        writer.reuse_spare, writer.SharedFileWriter.write, WritableMaps.view, Snapshots.take = originals


@contextlib.contextmanager
def record_buffers():
    """Record, on this rank, the host buffers the snapshot had made before each background save started
    (`AsyncSaver.start`; key -> buffer id, the background preparation joined first) and the buffers each save's
    copies went into (`HostBuffers.copy`; key -> the set of buffer ids)."""
    from hf_unified_ckpt.checkpoint.save.async_save import AsyncSaver
    from hf_unified_ckpt.checkpoint.save.snapshot import HostBuffers

    originals = AsyncSaver.start, HostBuffers.copy
    record = {"ready_at_start": [], "used": {}}

    def start(self, *args, **kwargs):
        buffers = self._snapshots.buffers
        buffers._join()
        record["ready_at_start"].append({key: id(b) for key, (b, _) in buffers._buffers.items()})
        return originals[0](self, *args, **kwargs)

    def copy(self, key, tensor, *args, **kwargs):
        out = originals[1](self, key, tensor, *args, **kwargs)
        record["used"].setdefault(key, set()).add(id(out))
        return out

    AsyncSaver.start, HostBuffers.copy = start, copy
    try:
        yield record
    finally:
        AsyncSaver.start, HostBuffers.copy = originals


@contextlib.contextmanager
def record_pieces():
    """Record, per component, the tensors the last save planned held in pieces by the ranks (each rank writes its
    piece in place; nothing of them is assembled on one rank): from the partition rule or the census of pieces."""
    from hf_unified_ckpt.checkpoint.save import saving as save

    original, recorded = save.plan_save, {}

    def plan_save(engine, request, *args, **kwargs):
        out = original(engine, request, *args, **kwargs)
        if out.pieces:
            recorded.clear()
            recorded.update({component: sorted(tensors) for component, tensors in out.pieces.items()})
        return out

    save.plan_save = plan_save
    try:
        yield recorded
    finally:
        save.plan_save = original


@contextlib.contextmanager
def record_aggregation():
    """Record, per save of this rank: the files its write strategy aggregated, the cells it wrote, the bytes it
    received from other ranks and sent, the peak of its cell buffers (`AggregatingWriter.peak_buffer_bytes`), and how
    many sharded tensors the engines assembled whole so far (DeepSpeed's `_assemble`, FSDP's `_full_on`). A save
    written by the writer process (`unified_checkpoint_async_executor="process"`) is recorded from the writer its
    outcome brings back from that process (`process`: True): its plans, and the peak its cells' writes left there."""
    from hf_unified_ckpt.checkpoint.save import executors
    from hf_unified_ckpt.checkpoint.write import aggregating
    from hf_unified_ckpt.engines import deepspeed, fsdp

    original, saves = aggregating.AggregatingWriter.write, []
    assembled = {"count": 0}  # sharded tensors the engines assembled whole (their own collectives)
    assemble, full_on = deepspeed.DeepSpeedEngine._assemble, fsdp._full_on

    def counted(fn):
        def wrapper(*args, **kwargs):
            assembled["count"] += 1
            return fn(*args, **kwargs)
        return wrapper

    serial = itertools.count()

    def save_of(writer, process: bool = False) -> dict:
        return {"writer": next(serial), "files": sorted(writer.plans), "cells": [], "received": 0, "sent": 0,
                "peak": 0, "buffer": writer.options.buffer_bytes, "process": process}

    def add_file(save: dict, writer, name: str) -> None:
        plan = writer.plans[name]
        save["cells"] += [(name, a, b) for a, b in plan.cells_of(writer.rank)]
        save["received"] += sum(h.end - h.start for h in plan.received_by(writer.rank))
        save["sent"] += sum(h.end - h.start for h in plan.sent_by(writer.rank))

    def write(self, folder, file, tensors):
        if not saves or saves[-1]["writer"] != vars(self).get("_recorded_as"):  # not id(): a freed id is reused
            saves.append(save_of(self))
            self._recorded_as = saves[-1]["writer"]
        if file.name in self.plans:
            add_file(saves[-1], self, file.name)
        out = original(self, folder, file, tensors)
        saves[-1]["peak"], saves[-1]["assembled"] = self.peak_buffer_bytes, assembled["count"]
        return out

    def finished(self, started, staged, fallback):  # the writer as it ended in the writer process (pickled back)
        outcome = finish(self, started, staged, fallback)
        writer = outcome.writer
        if isinstance(writer, aggregating.AggregatingWriter) and staged[0]:
            saves.append(save_of(writer, process=True))
            for name in writer.plans:
                add_file(saves[-1], writer, name)
            saves[-1]["peak"] = writer.peak_buffer_bytes  # set by its cells' writes only: 0 unless it aggregated
        return outcome

    finish = executors.ProcessExecutor.finish
    aggregating.AggregatingWriter.write, executors.ProcessExecutor.finish = write, finished
    deepspeed.DeepSpeedEngine._assemble, fsdp._full_on = counted(assemble), counted(full_on)
    try:
        yield saves
    finally:
        aggregating.AggregatingWriter.write, executors.ProcessExecutor.finish = original, finish
        deepspeed.DeepSpeedEngine._assemble, fsdp._full_on = assemble, full_on


def _with_aggregation_fault(run: dict, world_size: int) -> dict:
    """`run` with `aggregation_fault` (and "default_timeout": the default group's timeout, seconds, where the group
    exists already); every rank saves what it saw to `<result>.fault.rank<r>`: the file the fault hit, the
    timeouts of the default and `aggregate` groups, when this rank's `train()` raised (time.time()) and what, and for
    kills the SIGTERM the launcher sent it (recorded and ignored: a survivor must fail on its own; the launcher's
    SIGKILL follows 5 s later)."""
    import signal

    from hf_unified_ckpt import dist

    fault, rank, step = run["aggregation_fault"]
    if run.get("default_timeout") and dist.is_distributed():  # as init_process_group(timeout=...) sets it
        import datetime

        import torch.distributed.distributed_c10d as c10d

        c10d._set_pg_timeout(datetime.timedelta(seconds=run["default_timeout"]))
    seen = {"fault": fault, "rank": rank, "sigterm": None, "error": None, "failed_at": None}
    out = f"{run['result']}.fault.rank"

    def keep():
        torch.save(seen, f"{out}{dist.rank()}")

    if fault.startswith("kill"):
        signal.signal(signal.SIGTERM, lambda *_: seen.update(sigterm=time.time()))
    rest = {k: v for k, v in run.items() if k not in ("aggregation_fault", "default_timeout")}
    try:
        with aggregation_fault(fault, rank, step, seen, keep):
            result = run_spec(rest, world_size)
    except Exception as e:  # noqa: BLE001 - what each rank raised is what the tests check
        seen.update(error=f"{type(e).__name__}: {e}", failed_at=time.time())
        keep()
        if fault.startswith("kill"):
            raise
        return {"error": seen["error"]}
    keep()
    return result


@contextlib.contextmanager
def aggregation_fault(fault: str, rank: int, step: int, seen: dict, keep=lambda: None):
    """A fault on rank `rank` in the aggregated save of `step` (`AggregatingWriter`), into the first file it
    aggregates (it writes cells of it) or, for "kill_sender" and "encode", the first it sends pieces of:
    "kill_aggregator" dies as under kill -9 once its first cell of that file is written ("died" in `seen`: when,
    saved by `keep` first);
    "kill_sender" dies before it sends any piece of a file it does not aggregate; "enospc": its cell writes into
    that file fail with ENOSPC (the store's `write_at`; "fired": when first); "slow": every cell write of that save
    sleeps 0.1 s ("slow_until": when the last ended); "encode": encoding its pieces of that file raises ("fired");
    "fail_aggregator": its first cell of the first file where bytes are announced to it (`unknown_bytes`) fails
    before any is received (`copy_held`; "fired"). On rank 0, "committed":
    when the save's folder was committed (the store's `publish`). The cell writes and the commit are faulted
    through the store (`faulty_store`), the rest by rebinding the aggregating writer's own functions."""
    from faulty_store import injected, no_space
    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.write import aggregating
    from hf_unified_ckpt.format.planning import FilePlan

    originals = (aggregating.AggregatingWriter.write, FilePlan.encoded, aggregating.copy_held)
    armed = {}  # the file the fault hits, once chosen

    def write(self, folder, file, tensors):
        plan = self.plans.get(file.name)
        if plan is not None and "timeouts" not in seen:  # the default group's and the `aggregate` group's, seconds
            seen["timeouts"] = [_timeout_s(g) for g in (dist.cpu_group(), dist.gloo_group(aggregating.GROUP))]
        if dist.rank() == rank and f".checkpoint-{step}." in str(folder) and plan is not None and not armed:
            sends = bool(plan.sent_by(rank))
            if fault in ("kill_aggregator", "enospc", "slow") and plan.aggregates(rank) or (
                    fault == "encode" and sends) or (fault == "kill_sender" and sends and not plan.aggregates(rank)) or (
                    fault == "fail_aggregator" and any(plan.unknown_bytes(a, b) for a, b in plan.cells_of(rank))):
                armed.update(name=file.name, folder=str(folder))
                seen["file"] = file.name
                armed["writing"] = fault == "fail_aggregator"  # its first cell of that file fails (`copy_held`)
                if fault == "kill_sender":
                    _die(seen, keep)
        return originals[0](self, folder, file, tensors)

    def write_at(call):
        ref = call.ref
        hit = armed and ref.startswith(armed["folder"]) and (fault == "slow" or ref.endswith(armed["name"]))
        if hit and fault == "enospc":
            seen.setdefault("fired", time.time())
            raise no_space(ref)
        if hit and fault == "slow":
            time.sleep(0.1)
        written = call.proceed()
        if hit and fault == "slow":
            seen["slow_until"], seen["slow_writes"] = time.time(), seen.get("slow_writes", 0) + 1
        if hit and fault == "kill_aggregator":
            _die(seen, keep)
        return written

    def copy_held(buffer, start, held):
        if fault == "fail_aggregator" and armed and armed.get("writing"):
            armed["writing"] = False
            seen.setdefault("fired", time.time())
            raise RuntimeError(f"injected: aggregating {armed['name']} failed on rank {rank}")
        return originals[2](buffer, start, held)

    def encoded(self, tensors, r):
        if fault == "encode" and armed and self.name == armed["name"] and r == rank:
            seen.setdefault("fired", time.time())
            raise RuntimeError(f"injected: encoding {self.name} failed on rank {r}")
        return originals[1](self, tensors, r)

    def committed(call):
        call.proceed()
        if f"checkpoint-{step}" in str(call.args[1]):
            seen["committed"] = time.time()

    def store_faults(call):
        return {"write_at": write_at, "publish": committed}.get(call.method, lambda c: c.proceed())(call)

    aggregating.AggregatingWriter.write, FilePlan.encoded, aggregating.copy_held = write, encoded, copy_held
    try:
        with injected(store_faults):
            yield
    finally:
        aggregating.AggregatingWriter.write, FilePlan.encoded, aggregating.copy_held = originals


def _timeout_s(group) -> float:
    """A gloo group's timeout (None: the default group), seconds."""
    import torch.distributed.distributed_c10d as c10d

    group = group if group is not None else c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _die(seen: dict, keep) -> None:
    """Record when, then die as under kill -9 (no clean-up)."""
    seen["died"] = time.time()
    keep()
    os._exit(9)


#: The functions of `hf_unified_ckpt.dist` a save communicates through, counted by `record_plans`.
COUNTED = ("all_gather_object", "broadcast_object", "all_reduce_ints", "exchange_tensors", "recv_bytes")


def received_bytes(kind: str, result, args) -> int:
    """What one call received, counted as bench/bench_scale_sim.py counts it: an all-gather of objects N x (8 + the
    largest pickle), a broadcast 8 + the pickle (0 on its source), an all-reduce twice its vector, a message its
    bytes (8 more for its length)."""
    import pickle

    from hf_unified_ckpt import dist

    if kind == "all_gather_object":
        return len(result) * (8 + max(len(pickle.dumps(x)) for x in result))
    if kind == "broadcast_object":
        src = args[1] if len(args) > 1 else 0
        return 0 if dist.rank() == src else 8 + len(pickle.dumps(result))
    if kind == "all_reduce_ints":
        return 16 * len(args[0])
    if kind == "exchange_tensors":
        return sum(t.numel() * t.element_size() for t in result.values())
    return 8 + len(result)


@contextlib.contextmanager
def record_plans():
    """Per save: every collective and message this rank took part in through `hf_unified_ckpt.dist` ((kind, the
    function that called it, bytes received: `received_bytes`)), how the plan was made ("rule", "cached" or
    "census"), and, where the rule was used, whether its pieces are exactly every rank's held pieces (checked by one
    more gather of every rank's (first, count), left out of the count), with the number of tensors compared and of
    those whose pieces are uneven."""
    import sys

    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.save import rule_plan, saving as save

    saves, paused = [], [False]
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counted(name):
        def call(*args, **kwargs):
            result = originals[name](*args, **kwargs)
            if saves and not paused[0]:
                saves[-1]["calls"].append((name, sys._getframe(1).f_code.co_name, received_bytes(name, result, args)))
            return result
        return call

    def open_staging(*args, **kwargs):
        saves.append({"calls": [], "plan": None})
        return original_staging(*args, **kwargs)

    def plan_save(*args, **kwargs):
        plan = original_plan(*args, **kwargs)
        if saves:
            saves[-1]["files"] = plan.files
        return plan

    def agree(engine, components, request, shared):
        rule = original_agree(engine, components, request, shared)
        saves[-1]["plan"] = "census" if rule is None else "cached" if rule.cached is not None else "rule"
        if rule is not None:
            paused[0] = True
            try:
                saves[-1].update(_rule_against_held(engine, rule))
            finally:
                paused[0] = False
        return rule

    original_staging, original_agree, original_plan = save.open_staging, rule_plan.agree, save.plan_save
    for name in COUNTED:
        setattr(dist, name, counted(name))
    save.open_staging, rule_plan.agree, save.plan_save = open_staging, agree, plan_save
    try:
        yield saves
    finally:
        for name, f in originals.items():
            setattr(dist, name, f)
        save.open_staging, rule_plan.agree, save.plan_save = original_staging, original_agree, original_plan


def _rule_against_held(engine, rule) -> dict:
    """Every rank's held (first, count) of every tensor of every component, gathered, against the rule's for that
    rank. Collective."""
    from hf_unified_ckpt import dist

    held = {c: {n: (f.start, f.values.numel()) for n, f in engine.fragments(c).items()} for c in rule.pieces}
    everyone = dist.all_gather_object(held)
    compared = uneven = 0
    same = True
    for component, tensors in rule.pieces.items():
        for name, pieces in tensors.items():
            compared += 1
            counts = set()
            for rank, share in enumerate(everyone):
                first, count = share[component].get(name, (0, 0))
                expected = pieces.of(rank)
                counts.add(count)
                same &= count == expected[1] and (not count or first == expected[0])
            uneven += len(counts - {0}) > 1 or 0 in counts
        for rank, share in enumerate(everyone):
            same &= all(not count or name in tensors for name, (_, count) in share[component].items())
    return {"rule_equals_held": same, "compared": compared, "uneven": uneven}


@contextlib.contextmanager
def broken_rule():
    """DeepSpeed's declared partition rule off by one element (its ZeRO-1/2 offsets, ZeRO-3's piece size), as an
    engine whose real layout is not the one it declares: the save must see it and take the census."""
    from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine
    from hf_unified_ckpt.format.planning import Strided

    original = DeepSpeedEngine._strided

    def strided(self, name):
        s = original(self, name)
        return Strided(s.numel, s.size + 1, s.shift) if self.stage == 3 else Strided(s.numel, s.size, s.shift + 1)

    DeepSpeedEngine._strided = strided
    try:
        yield
    finally:
        DeepSpeedEngine._strided = original


@contextlib.contextmanager
def record_hand_overs():
    """Per file of every bucket save (`MultipartWriter.write`), [the bytes of other ranks this rank received on the
    hand-overs' gloo group, the bytes its plan hands over to it]: received point to point (`dist.irecv`) or by an
    all-gather of every rank's hand-overs (the others' bytes counted)."""
    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.write import multipart
    from hf_unified_ckpt.store import join

    originals = multipart.MultipartWriter.write, getattr(dist, "irecv", None), dist.all_gather_object
    files, current = {}, [None]

    def write(self, folder, file, tensors):
        plan = self.part_plan(file, join(folder, file.name))
        current[0] = files[file.name] = [0, sum(h.end - h.start for h in plan.received_by(self.rank))]
        try:
            return originals[0](self, folder, file, tensors)
        finally:
            current[0] = None

    def irecv(tensor, src, *args, **kwargs):
        if current[0] is not None:
            current[0][0] += tensor.nbytes
        return originals[1](tensor, src, *args, **kwargs)

    def all_gather_object(obj, group=None):
        out = originals[2](obj, group=group)
        if current[0] is not None and group is dist.gloo_group(multipart.GROUP):
            current[0][0] += sum(len(data) for r, sent in enumerate(out) if r != dist.rank() and sent
                                 for data in sent.values())
        return out

    multipart.MultipartWriter.write, dist.all_gather_object = write, all_gather_object
    if originals[1] is not None:
        dist.irecv = irecv
    try:
        yield files
    finally:
        multipart.MultipartWriter.write, dist.all_gather_object = originals[0], originals[2]
        if originals[1] is not None:
            dist.irecv = originals[1]


@contextlib.contextmanager
def unreadable_bytes(rank: int):
    """On rank `rank`, a bucket save cannot produce its bytes of any file (as a failed device-to-host copy): the
    ranks it hands bytes over to must not wait for them, and the save must fail on every rank."""
    from hf_unified_ckpt import dist
    from hf_unified_ckpt.checkpoint.write import multipart

    original = multipart.rank_ranges

    def failing(file, r, tensors):
        if r == rank == dist.rank():
            raise OSError(f"injected: rank {rank} could not read its bytes of {file.name}")
        return original(file, r, tensors)

    multipart.rank_ranges = failing
    try:
        yield
    finally:
        multipart.rank_ranges = original


@contextlib.contextmanager
def die_mid_write(rank: int, step: int):
    """Rank `rank` dies as under kill -9 in the middle of its first in-place write into a file that several ranks
    write, in the save of `step`: the file exists (at its final size, if the header rank got there first) with half
    of this rank's ranges written; the other ranks are stopped by the launcher."""
    import dataclasses

    import hf_unified_ckpt.checkpoint.write.writer as writer

    original = writer.write_ranges

    def dying(path, file, r, tensors, **kwargs):
        if r == rank and f".checkpoint-{step}." in str(path) and len(file.writers) > 1:
            mine = file.items_of(r)
            kept = {item.name for item in mine[: max(1, len(mine) // 2)]}  # its first half (the layout's own order)
            half = tuple(e for e in file.layout if e[0] in kept)
            original(path, dataclasses.replace(file, layout=half), r, tensors, **kwargs)
            os._exit(9)
        return original(path, file, r, tensors, **kwargs)

    writer.write_ranges = dying
    try:
        yield
    finally:
        writer.write_ranges = original


#: The decoder layer class of each test model: one FSDP unit each.
LAYER_CLASS = {"llama": "LlamaDecoderLayer", "lora": "LlamaDecoderLayer", "gpt2": "GPT2Block",
               "llama_tp": "LlamaDecoderLayer", "llama_tp_tied": "LlamaDecoderLayer", "llama_s3": "LlamaDecoderLayer",
               "qwen3_moe": "Qwen3MoeDecoderLayer", "qwen3_moe_square": "Qwen3MoeDecoderLayer",
               "mixtral": "MixtralDecoderLayer", "deepseek_v3": "DeepseekV3DecoderLayer",
               "lora_moe": "Qwen3MoeDecoderLayer", "qwen3_moe_pretrained": "Qwen3MoeDecoderLayer",
               "qwen3_moe_tied": "Qwen3MoeDecoderLayer"}


def fsdp_args(version: int = 2, state_dict_type: str = "SHARDED_STATE_DICT", model: str = "llama") -> dict:
    """TrainingArguments for FSDP through the Trainer (full shard, one unit per decoder layer)."""
    config = {"version": version, "transformer_layer_cls_to_wrap": [LAYER_CLASS[model]],
              "state_dict_type": state_dict_type}
    if version == 2:
        config["reshard_after_forward"] = True
    else:
        config["sync_module_states"] = False  # needs an accelerator device; every rank builds the same model
    return {"fsdp": "full_shard auto_wrap", "fsdp_config": config}


class fsdp_on_cpu:
    """Test-only shim: accelerate applies FSDP only on GPU device types and silently wraps the model in DDP on
    CPU. While active, an AcceleratorState built with an FSDP plugin keeps it (distributed type FSDP, device
    cpu). Tests that use it assert the parameters really are sharded, so a silent fallback fails them."""

    def __enter__(self):
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType

        self._original = original = AcceleratorState.__init__

        def init(state, *args, fsdp_plugin=None, **kwargs):
            original(state, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            if fsdp_plugin is not None and state.distributed_type != DistributedType.FSDP:
                state.distributed_type = DistributedType.FSDP
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                PartialState._shared_state["device"] = state.device = torch.device("cpu")
                if state._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(state._mixed_precision)
                state.fsdp_plugin = fsdp_plugin

        AcceleratorState.__init__ = init
        return self

    def __exit__(self, *exc):
        from accelerate.state import AcceleratorState

        AcceleratorState.__init__ = self._original


class tp_on_cpu:
    """Test-only shim: the Trainer turns a tensor-parallel model (`model.tp_size > 1`) into an accelerate
    `ParallelismConfig`, which accelerate (1.15) accepts only for FSDP2, DeepSpeed or GPU-like devices and refuses
    on CPU (`ParallelismConfig._validate_accelerator`: "... but got DistributedType.MULTI_CPU"). While active, that
    one check passes for MULTI_CPU when TP is enabled (its size check is kept); accelerate then leaves the model
    unwrapped, as on GPUs. Tests that use it assert the model really is tensor-parallel (`assert_tensor_parallel`)."""

    def __enter__(self):
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DistributedType

        self._original = original = ParallelismConfig._validate_accelerator

        def validate(config, accelerator):
            if accelerator.distributed_type == DistributedType.MULTI_CPU and config.tp_enabled:
                if config.total_size != accelerator.num_processes:
                    raise ValueError(f"ParallelismConfig total_size ({config.total_size}) != num_processes "
                                     f"({accelerator.num_processes})")
                return None
            return original(config, accelerator)

        ParallelismConfig._validate_accelerator = validate
        return self

    def __exit__(self, *exc):
        from accelerate.parallelism_config import ParallelismConfig

        ParallelismConfig._validate_accelerator = self._original


def assert_resumed_matches(resumed: dict, baseline: dict, steps, exact: bool, loss_rtol: float, state_atol: float):
    """A resumed run against the uninterrupted one: losses at `steps` and final weights, `==` when `exact`,
    else within the stated tolerances (relative on losses, absolute on weights)."""
    for step in steps:
        a, b = resumed["losses"][step], baseline["losses"][step]
        assert (a == b) if exact else abs(a - b) <= loss_rtol * abs(b), (step, a, b)
    for key, ref in baseline["state"].items():
        got = resumed["state"][key]
        assert torch.equal(got, ref) if exact else torch.allclose(got.double(), ref.double(), rtol=0,
                                                                  atol=state_atol), key


#: The ordinary Trainer options around the loop: eval every 2 steps, `load_best_model_at_end` (greater_is_better on
#: eval_loss: the tiny llama's eval loss falls, so an early checkpoint is the best one and loading it visibly changes
#: the final weights; the MoE model's rises, so its best is the last, the checkpoint being saved) and
#: `save_total_limit=2` (rotation must keep the best one); `loop_spec` adds `save_model` after training. Where the
#: best lands in every combination is the native-parity harness's job (test_native_parity.py).
BEST = {"max_steps": 6, "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss", "greater_is_better": True, "save_total_limit": 2}


def loop_spec(spec: dict, model_dir) -> dict:
    """`spec` with evaluation, `load_best_model_at_end`, rotation (`BEST`) and a `save_model(model_dir)` at the end."""
    return {**spec, "eval": True, "save_model": str(model_dir), "overrides": {**spec.get("overrides", {}), **BEST}}


def assert_loop_options(run_dir, result: dict, model_dir) -> None:
    """A `loop_spec` run: the best checkpoint is the folder of the best evaluation (an earlier one kept by
    rotation, or the last), the final weights are its weights, and `from_pretrained(model_dir)` loads them."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    best = result["best"]
    assert best is not None and Path(best).name == f"checkpoint-{result['best_global_step']}", best
    kept = sorted(p.name for p in Path(run_dir).glob("checkpoint-*"))
    assert len(kept) == 2 and {"checkpoint-6", Path(best).name} <= set(kept), kept  # save_total_limit=2
    for folder in (best, model_dir):
        loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert [k for k, v in result["state"].items() if not torch.equal(loaded[k], v)] == [], folder


def assert_from_pretrained_equals(folder, state: dict, tied: bool = False) -> None:
    """`from_pretrained(folder)` gives `state` (every tensor it loads, `==`); with `tied`, lm_head is still the
    embedding."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
