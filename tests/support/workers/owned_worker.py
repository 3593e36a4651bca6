"""torchrun worker (issue 47): after a resume's load, nothing training keeps lies in a checkpoint file.

    torchrun --standalone --nproc_per_node 2 tests/support/workers/owned_worker.py ROOT CASE [CASE ...]

Per case (an engine and its options, `CASES`): train 2 steps saving checkpoint-2 into ROOT/CASE, then resume from
it with a callback that, once the load is done (`on_train_begin`), truncates every tensor file of checkpoint-2 to
zero bytes (rank 0, the others waiting) and lists the live tensors of each rank that lie in a file mapping
(`mapped_files.tensors_in_files`) into ROOT/CASE.rank<r>.json; then train one step. A tensor left in a mapping of
one of those files dies with SIGBUS at that step (or fails the listing's assertion first).
"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))  # tests/: `import support.x`

import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from support.env import disable_deepspeed_jit, free_process_group_users, freeze_imports, fsdp_on_cpu  # noqa: E402
from support.trainers import fsdp_args, make_trainer, zero_config  # noqa: E402
from support.mapped_files import tensors_in_files  # noqa: E402

#: case -> (TrainingArguments overrides, whether it needs the FSDP shim on CPU)
CASES = {
    "ddp-ema": (lambda: {"unified_checkpoint_config": "ema"}, False),
    "zero3-bf16": (lambda: {"deepspeed": zero_config(3), "bf16": True}, False),
    "fsdp2": (lambda: fsdp_args(2), True),
}


class TruncateAfterLoad(TrainerCallback):
    def __init__(self, checkpoint: str, report: str):
        self.checkpoint, self.report = checkpoint, report

    def on_train_begin(self, args, state, control, **kwargs):
        if dist.get_rank() == 0:
            for name in os.listdir(self.checkpoint):
                path = os.path.join(self.checkpoint, name)
                if name.endswith(".safetensors"):  # the tensor files (the RNG states are read at the first step)
                    os.truncate(path, 0)
        dist.barrier()
        found = tensors_in_files()
        with open(self.report, "w") as f:
            json.dump([[list(shape), path] for shape, path in found], f)
        assert not found, f"rank {dist.get_rank()}: {len(found)} live tensors in file mappings, e.g. {found[:3]}"


def run_case(root: str, case: str) -> None:
    overrides, shim = CASES[case]
    out = os.path.join(root, case)
    if "deepspeed" in overrides():
        disable_deepspeed_jit()
    with fsdp_on_cpu() if shim else contextlib.nullcontext():
        make_trainer(out, world_size=2, max_steps=2, save_steps=2, **overrides()).train()
    with fsdp_on_cpu() if shim else contextlib.nullcontext():
        trainer = make_trainer(out, world_size=2, max_steps=3, save_steps=100, **overrides())
        trainer.add_callback(TruncateAfterLoad(os.path.join(out, "checkpoint-2"),
                                               os.path.join(root, f"{case}.rank{dist.get_rank()}.json")))
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        assert trainer.state.global_step == 3


def main(root: str, cases: list[str]) -> None:
    freeze_imports()
    for case in cases:
        run_case(root, case)
    free_process_group_users()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
