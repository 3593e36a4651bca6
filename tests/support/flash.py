"""Runs of the memory tier (`flash`) launched as real jobs: their options (`FLASH`, `SPLIT`), a run's spec
(`flash_spec`), and the processes of a run (`persisters`, `kill_launcher_and_workers`)."""

from __future__ import annotations

import os
import signal
import subprocess

FLASH = {"unified_checkpoint_config": "flash", "save_steps": 2, "max_steps": 6}


def flash_spec(tmp, memory, tag, output=None, **overrides):
    """A flash run's spec: `FLASH` with the memory folder `memory` and `overrides`, its results under `tmp`."""
    return {"output_dir": str(output or tmp / tag), "result": str(tmp / f"{tag}.pt"),
            "overrides": {**FLASH, "unified_checkpoint_memory_dir": memory, **overrides}}


#: The optimizer split over both ranks in 5 files (each rank writes some; a resumed job once planned them in the
#: loaded state's order, which shrank two of them), one memory checkpoint kept, 10 steps: a job resumed at step 4
#: evicts checkpoint-4 at the save of step 6 and writes the save of step 8 over its files (issue 47).
SPLIT = {**FLASH, "max_steps": 10, "unified_checkpoint_memory_keep": 1, "unified_checkpoint_persist_every": 100,
         "unified_checkpoint_max_shard_size": 40000}


def persisters(run: str) -> list[int]:
    """Processes whose command line names `run` (its persisters)."""
    out = subprocess.run(["pgrep", "-f", f"hf_unified_ckpt.flash.persister {run}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def kill_launcher_and_workers(launcher: int) -> list[int]:
    """SIGKILL torchrun and its workers (its children), not their children: the persister outlives them."""
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True,
                                              text=True).stdout.split()]
    for pid in [launcher] + workers:
        os.kill(pid, signal.SIGKILL)
    return workers
