"""Per-step times around saves: where a background save's cost lands in training (a diagnostic, no target).

    torchrun --standalone --nproc_per_node 2 bench/step_profile.py none|async|flash [--steps 30] [--every 5]
                                                                   [--size 103m] [--keep K] [--persist-every M]

Trains bench_save.py's Llama under DDP (gloo, CPU, fp32, AdamW) for `--steps` steps: without saves (`none`), with an
`async_save` to output_dir every `--every` steps (`async`), or with a `flash` save into a fresh /dev/shm folder
(`flash`). Rank 0 prints the total time and every step's time (on_step_begin -> on_step_end, this rank), with each
`_save_checkpoint` call's own time in line, as JSON. Found with it (issue 32 note, session 16): async and flash saves
cost alike on this 2-core machine, the first step after a save about +2 s and the next three +0.3 to +0.7 s each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    import dataclasses

    import torch.distributed as dist
    from transformers import TrainerCallback

    from bench_flash import build_ddp_trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("none", "async", "flash"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--size", default="103m")
    parser.add_argument("--keep", type=int, default=2, help="flash: memory checkpoints kept (K)")
    parser.add_argument("--persist-every", type=int, default=4, help="flash: every Mth save made durable")
    a = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = Path(tempfile.gettempdir()) / f"step-profile-{a.mode}"
    # one folder for every rank of the launch (torchrun gives its workers one run id)
    memory = f"/dev/shm/hf_unified_ckpt-step-profile-{os.environ.get('TORCHELASTIC_RUN_ID', uuid.uuid4().hex)[:12]}"
    trainer = build_ddp_trainer(out, world, a.size, memory, flash=a.mode == "flash", max_steps=a.steps,
                                save_steps=None if a.mode == "none" else a.every,
                                persist_every=a.persist_every, keep=a.keep)
    if a.mode == "async":
        options = trainer.args.unified_checkpoint_options
        trainer.args._unified_checkpoint_options = dataclasses.replace(options, async_save=True)
    times: list = []

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append((state.global_step, round(time.perf_counter() - self.began, 3)))

    trainer.add_callback(Steps())
    save = trainer._save_checkpoint

    def timed_save(*args, **kwargs):
        started = time.perf_counter()
        save(*args, **kwargs)
        times.append(("save", round(time.perf_counter() - started, 3)))

    trainer._save_checkpoint = timed_save
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    if dist.get_rank() == 0:
        print(json.dumps({"mode": a.mode, "total_s": round(total, 2), "steps": times}))
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
