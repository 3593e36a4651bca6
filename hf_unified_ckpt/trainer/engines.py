"""The training engines the Trainer integration knows, each described once (`Engine`): how to tell it runs, the
engine adapter to build, what it refuses before the first step, how its optimizer step waits for an async snapshot,
and what a legacy folder must match to be loaded natively. Nothing else in `trainer/` tests an engine's name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import dist
from ..engines.replicated import ReplicatedEngine

_NATIVE_TP_REFUSAL = (
    "{path} was written by the Trainer's own save, and this run's model is sharded at load time (tensor "
    "parallelism). For such a model transformers saves only the weights (save_only_model=True: its optimizer state "
    "cannot be gathered; a forced optimizer.pt holds rank 0's shards only), so training cannot resume from it "
    "exactly. Start a new run from its weights: from_pretrained('{path}', tp_plan='auto'). Checkpoints this run "
    "saves are unified and resume at any TP degree or engine.")


def master_policy(options) -> str:
    """How the DeepSpeed adapter treats fp32 master weights under these options."""
    if options.remove_master_weight:
        return "remove"
    return "as_model" if options.skip_save_model_weight else "save"


def _no_topology(trainer) -> None:
    return None


def _nothing_refused(trainer) -> str | None:
    return None


def _callback_waits(trainer, wait) -> None:
    """The optimizer step runs outside backward: `UnifiedCheckpointCallback.on_pre_optimizer_step` waits."""


@dataclass(frozen=True)
class Engine:
    """What the integration needs to know about one training engine, answered from the Trainer. Registered in
    `ENGINES` (the first that matches is the one running); no other code of the integration branches on engines."""

    name: str
    matches: Callable[[object], bool]
    build: Callable[[object], object]  # the EngineAdapter for this trainer's prepared engine
    #: How a warning names it to a user ("DeepSpeed", ...).
    label: Callable[[], str]
    topology: Callable[[object], dict | None] = _no_topology  # what a legacy folder must match to load natively
    step_barrier: Callable[[object, Callable[[], None]], None] = _callback_waits  # async snapshot vs optimizer step
    refusal: Callable[[object], str | None] = _nothing_refused  # why this run cannot be checkpointed, checked in train()
    #: `Trainer.save_model` already writes what `from_pretrained` loads (the plugin leaves it alone).
    native_save_model: bool = False
    #: Is FSDP (the engine a request for FSDP expects).
    fsdp: bool = False
    #: Why the Trainer's own (non-unified) checkpoint folder cannot be resumed by this engine (`{path}` filled in).
    native_folder_refusal: str | None = None


def _build_deepspeed(trainer):
    from ..engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(trainer.model_wrapped, master_policy(trainer.args.unified_checkpoint_options))


def _deepspeed_topology(trainer) -> dict:
    """World size, ZeRO stage and bf16 of this DeepSpeed run (a legacy DeepSpeed folder that matches them is loaded
    by DeepSpeed itself)."""
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return {"world_size": dist.world_size(), "zero_stage": int(config.get("zero_optimization", {}).get("stage", 0)),
            "bf16": bool(trainer.args.bf16), "autotp_size": _autotp_size(config)}


def _deepspeed_step_barrier(trainer, wait) -> None:
    """DeepSpeed steps inside backward, where no callback runs: its optimizer's own step waits."""
    from ..engines.deepspeed import wait_before_steps

    wait_before_steps(trainer.model_wrapped, wait)


def _autotp_size(config: dict) -> int:
    return int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def _deepspeed_refusal(trainer) -> str | None:
    """What the DeepSpeed adapter would refuse at the first save (`engines.deepspeed.autotp_refusal`)."""
    from ..engines.deepspeed import autotp_refusal

    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return autotp_refusal(_autotp_size(config), int(config.get("zero_optimization", {}).get("stage", 0)))


def _build_fsdp(trainer):
    from ..engines.fsdp import FSDPEngine

    return FSDPEngine(trainer.model_wrapped, trainer.optimizer)


def _sharded_at_load(trainer) -> bool:
    """transformers sharded the model itself when loading it (tensor parallelism, alone or with FSDP2: `tp_plan`,
    `DistributedConfig`); the Trainer then leaves it unwrapped, with DTensor parameters."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))


def _expert_parallel_refusal(trainer) -> str | None:
    """A model transformers sharded by expert parallelism (`DistributedConfig(ep_size=N)`: its expert tensors are
    DTensors on a mesh dimension `ep`, each rank holding some whole experts)."""
    for name, param in trainer.model.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "ep" in names and mesh.size(names.index("ep")) > 1:
            return (f"{type(trainer.model).__name__.removeprefix('FSDP')} is sharded by expert parallelism ({name} is split over an 'ep' "
                    f"mesh dimension of {mesh.size(names.index('ep'))} ranks: from_pretrained(..., distributed_config="
                    "DistributedConfig(ep_size=...))); unified checkpoints do not save expert-parallel models yet. "
                    "Shard the experts with FSDP2 or DeepSpeed ZeRO instead (their checkpoints are saved per expert "
                    "and resume at any world size), or set unified_checkpoint=False.")
    return None


def _build_tensor_parallel(trainer):
    from ..engines.fsdp import FSDPEngine

    return FSDPEngine(trainer.model_wrapped, trainer.optimizer, kind="tensor_parallel")


ENGINES = (
    Engine("deepspeed", lambda t: getattr(t, "is_deepspeed_enabled", False), _build_deepspeed, lambda: "DeepSpeed",
           topology=_deepspeed_topology, step_barrier=_deepspeed_step_barrier, refusal=_deepspeed_refusal),
    Engine("fsdp", lambda t: getattr(t, "is_fsdp_enabled", False), _build_fsdp, lambda: "FSDP", fsdp=True),
    Engine("tensor_parallel", _sharded_at_load, _build_tensor_parallel, lambda: "tensor parallelism",
           native_folder_refusal=_NATIVE_TP_REFUSAL, refusal=_expert_parallel_refusal),
    Engine("replicated", lambda t: True, lambda t: ReplicatedEngine(t.model_wrapped, t.optimizer),
           lambda: "DDP" if dist.world_size() > 1 else "one process", native_save_model=True),
)


def engine_of(trainer) -> Engine:
    """The registered engine `trainer` runs."""
    return next(engine for engine in ENGINES if engine.matches(trainer))
