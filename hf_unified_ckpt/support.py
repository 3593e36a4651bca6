"""What unified checkpoints cannot do yet, decided once: the Trainer integration refuses it in `train()` before
the first step, and the engine adapters refuse it if they are used directly. Pure."""

from __future__ import annotations

from .errors import UnsupportedCheckpointError


def refuse_unsupported(engine: str, peft: bool, fp16: bool) -> None:
    """Raise `UnsupportedCheckpointError` for a combination unified checkpoints cannot save or load.

    `engine` is "replicated" (one process or DDP), "deepspeed" or "fsdp"; `peft` says the model is a PEFT model;
    `fp16` says DeepSpeed runs fp16 with dynamic loss scaling."""
    if peft and engine in ("deepspeed", "fsdp"):
        name = "DeepSpeed" if engine == "deepspeed" else "FSDP"
        raise UnsupportedCheckpointError(
            f"unified checkpoints of PEFT/LoRA models under {name} are not supported yet (one process and DDP are). "
            f"Set unified_checkpoint=False, or train the adapter without {name}.")
    if fp16 and engine == "deepspeed":
        raise UnsupportedCheckpointError(
            "DeepSpeed fp16 (dynamic loss scaling) is not supported by unified checkpoints yet; train in bf16 or "
            "fp32, or set unified_checkpoint=False.")
