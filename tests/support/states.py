"""What a finished run holds, full on every rank (weights, optimizer state, fp32 masters), and the comparisons
the tests make between runs.
"""

from __future__ import annotations

import math

import torch


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
