"""Readers of checkpoints written without this library (DeepSpeed `global_step*`, FSDP), tensor by tensor, with
the read interface of unified folders (`sources.TensorSource`)."""

from __future__ import annotations

from ..errors import UnsupportedCheckpointError


def open_legacy(layout, for_conversion: bool = False, trust_pickles: bool = False):
    """The reader for a complete legacy `layout` of kind deepspeed or fsdp, its pickles read (here, before anything
    loads) with `weights_only` and an allow-list, or whole where the user trusts the folder (`trust_pickles`). A
    folder without trainer state (a model folder written by `Trainer.save_model`) is opened only `for_conversion`:
    training cannot resume from it."""
    if not layout.trainer_state and not for_conversion:
        raise UnsupportedCheckpointError(_not_resumable(layout))
    if layout.kind == "deepspeed":
        from .deepspeed import LegacyDeepSpeedCheckpoint

        return LegacyDeepSpeedCheckpoint(layout.path, trust_pickles)
    if layout.kind == "fsdp":
        from .fsdp import LegacyFSDPCheckpoint

        return LegacyFSDPCheckpoint(layout.path, trust_pickles)
    raise UnsupportedCheckpointError(f"{layout.path} is a '{layout.kind}' folder, not a DeepSpeed or FSDP one.")


def _not_resumable(layout) -> str:
    return (f"{layout.path} cannot be resumed: it is a model folder written by Trainer.save_model (DeepSpeed ZeRO "
            "partitions, no trainer_state.json), not a Trainer checkpoint, so it holds no trainer state (step, "
            f"learning-rate schedule, data position, RNG). Convert it with `hf-unified-ckpt convert {layout.path} OUT` "
            "and load OUT with from_pretrained (to start a new run from its weights), or resume from a checkpoint-N "
            "folder.")


def legacy_components(legacy, for_loading: bool = False) -> dict:
    """The components a legacy reader holds, by name: model weights, master weights (when the engine kept a
    separate fp32 copy; for loading always, the model weights standing in for fp32 training) and optimizer."""
    from ..format.components import MASTER, MODEL, OPTIMIZER

    check_readable(legacy)
    sources = {MODEL.name: legacy.model_source()}
    if for_loading or legacy.saved_by()["master_weights"]:
        sources[MASTER.name] = legacy.master_source()
    sources[OPTIMIZER.name] = legacy.optimizer_source()
    return sources


def check_readable(legacy) -> None:
    """Refuse a legacy checkpoint whose tensors this library cannot put together offline: DeepSpeed AutoTP's, one
    mp_rank file per slice of the sharded weights."""
    tp_size = legacy.tp_size
    if tp_size > 1:
        raise UnsupportedCheckpointError(
            f"{legacy.dir} was written by DeepSpeed AutoTP ({tp_size} tensor-parallel ranks, one mp_rank_* file per "
            "slice of the sharded weights); this library does not put those slices together offline. Resume it with "
            f"the DeepSpeed config and world size that wrote it ({legacy.topology()}): DeepSpeed loads it itself, "
            "and the next save is unified, resumable anywhere.")
