"""Readers of checkpoints written without this library (DeepSpeed `global_step*`, FSDP), tensor by tensor, with
the read interface of unified folders (`sources.TensorSource`)."""

from __future__ import annotations

from ..errors import UnsupportedCheckpointError


def open_legacy(layout):
    """The reader for a complete legacy `layout` of kind deepspeed or fsdp."""
    if layout.kind == "deepspeed":
        from .deepspeed import LegacyDeepSpeedCheckpoint

        return LegacyDeepSpeedCheckpoint(layout.path)
    if layout.kind == "fsdp":
        from .fsdp import LegacyFSDPCheckpoint

        return LegacyFSDPCheckpoint(layout.path)
    raise UnsupportedCheckpointError(f"{layout.path} is a '{layout.kind}' folder, not a DeepSpeed or FSDP one.")
