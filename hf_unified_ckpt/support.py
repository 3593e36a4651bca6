"""What unified checkpoints cannot do yet, decided once: the Trainer integration refuses it in `train()` before
the first step, and the engine adapters refuse it if they are used directly. Pure."""

from __future__ import annotations

from .errors import UnsupportedCheckpointError


def refuse_unsupported(engine: str, fp16: bool) -> None:
    """Raise `UnsupportedCheckpointError` for a combination unified checkpoints cannot save or load.

    `engine` is "replicated" (one process or DDP), "deepspeed" or "fsdp"; `fp16` says DeepSpeed runs fp16 with
    dynamic loss scaling."""
    if fp16 and engine == "deepspeed":
        raise UnsupportedCheckpointError(
            "DeepSpeed fp16 (dynamic loss scaling) is not supported by unified checkpoints yet; train in bf16 or "
            "fp32, or set unified_checkpoint=False.")
