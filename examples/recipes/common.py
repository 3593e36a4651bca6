"""What every recipe does around its Trainer: start DeepSpeed on CPU, read `resume_from_checkpoint`, end the
processes."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist


def prepare_deepspeed_on_cpu(args) -> None:
    """DeepSpeed (`--deepspeed ds.json` or an accelerate DeepSpeed config) on CPU: call before building the model.

    - DeepSpeed JIT-compiles a shared-memory allreduce op at start (about 30 s); gloo does the same job without it.
    - On GPUs accelerate starts DeepSpeed's communication; on CPU it starts a plain gloo process group, so ZeRO-3's
      partitioning as the model is built (`from_config` / `from_pretrained`) would see one process and fail on the
      batch size. Starting DeepSpeed's communication here (over gloo) gives both the same group."""
    use_deepspeed = args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if not use_deepspeed or not (args.use_cpu or not torch.cuda.is_available()):
        return
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "WORLD_SIZE" in os.environ:  # launched by torchrun, deepspeed or accelerate launch
        deepspeed.init_distributed(dist_backend=args.ddp_backend or "gloo")


def resume_value(value):
    """`resume_from_checkpoint` as YAML or the command line give it: true (the newest complete checkpoint in
    output_dir), false / none (start fresh), or a checkpoint path."""
    text = "" if value is None else str(value).strip().lower()
    return True if text == "true" else None if text in ("", "false", "none") else value


def end_processes() -> None:
    """Every rank waits for the others, then leaves the process group (ranks that exit without this abort). Call it
    once the Trainer is out of scope: the garbage collection here frees it and its model while the interpreter is
    alive (an FSDP2 model keeps the group's gloo work alive; freed during interpreter exit it can abort the process,
    pytorch#179291)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
