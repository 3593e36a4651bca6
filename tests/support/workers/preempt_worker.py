"""torchrun worker for the preemption tests: the runs of a JSON spec, one after another in this launch.

    torchrun --standalone --nproc_per_node N tests/support/workers/preempt_worker.py spec.json

A run is {"output_dir", "phase", "signal_ranks", "signals", "resume", "zero", "overrides", "result", "exit",
"slow_steps", "progress", "vote_every"} (the ranks' voting interval, fixed: 1 by default, 0 for the measured one). `phase` says where the test sends the signals to this process (a real `os.kill`, caught
by the plugin's real handler): before_first_step, mid_step (step `at`), sync_save, async_save, eval, resume_load,
after_training. A run the plugin ends raises `TrainingPreempted`: recorded and caught, or with "exit" left uncaught,
so the process ends as a user's would. After every run the worker checks that nothing of the plugin outlived
`train()` (its gloo groups, its threads, the signal handlers). Rank 0 writes each run's record to "result".
"""

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))  # tests/: `import support.x`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import hf_unified_ckpt.checkpoint.save.persist as persist  # noqa: E402
import hf_unified_ckpt.preemption.watch as preemption  # noqa: E402
import hf_unified_ckpt.dist as plugin_dist  # noqa: E402
import hf_unified_ckpt.trainer.session as session  # noqa: E402
from support.env import disable_deepspeed_jit, free_process_group_users, freeze_imports  # noqa: E402
from support.models import TokenDataset  # noqa: E402
from support.states import record  # noqa: E402
from support.trainers import losses_of, make_trainer, zero_config  # noqa: E402
from hf_unified_ckpt import TrainingPreempted  # noqa: E402


def send(run: dict) -> None:
    """Send this run's signals to this process, if its rank is one of the signalled ones."""
    if dist.get_rank() in run.get("signal_ranks", [0, 1]):
        for name in run.get("signals", ["SIGTERM"]):
            os.kill(os.getpid(), getattr(signal, name))


class Phase(TrainerCallback):
    """Sends the signals from a Trainer event: before the first step, in the middle of step `at` (after its
    backward, before its optimizer step), during the first evaluation, after training."""

    def __init__(self, run: dict):
        self.run, self.sent = run, False

    def fire(self, phase: str, ok: bool = True) -> None:
        if self.run.get("phase") == phase and ok and not self.sent:
            self.sent = True
            send(self.run)

    def on_train_begin(self, args, state, control, **kwargs):
        self.fire("before_first_step")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.fire("mid_step", state.global_step + 1 == self.run.get("at"))

    def on_prediction_step(self, args, state, control, **kwargs):
        self.fire("eval")

    def on_train_end(self, args, state, control, **kwargs):
        self.fire("after_training")


class Progress(TrainerCallback):
    """Rank 0 writes the step reached to a file after each step (the test waits for it before it signals from
    outside); `slow` seconds of sleep per step give it the time to."""

    def __init__(self, path: str, slow: float):
        self.path, self.slow = path, slow

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.slow)
        if dist.get_rank() == 0:
            with open(self.path + ".tmp", "w") as f:
                f.write(str(state.global_step))
            os.replace(self.path + ".tmp", self.path)


def patched(module, name: str, run: dict, phase: str):
    """`module.name` wrapped to send the signals on its first call, when the run's phase is `phase`."""
    original = getattr(module, name)
    if run.get("phase") != phase:
        return original, original
    sent = []

    def wrapper(*args, **kwargs):
        if not sent:
            sent.append(True)
            send(run)
        return original(*args, **kwargs)
    return original, wrapper


def run_one(run: dict, world: int) -> dict:
    overrides = dict(run.get("overrides", {}))
    if run.get("zero"):
        disable_deepspeed_jit()
        overrides["deepspeed"] = zero_config(run["zero"])
    if run.get("eval"):
        overrides["eval_dataset"] = TokenDataset(12, seed=7)
    trainer = make_trainer(run["output_dir"], world_size=world, **overrides)
    trainer.callback_handler.callbacks.insert(0, Phase(run))  # before the plugin's own on_train_begin
    if run.get("progress"):
        trainer.add_callback(Progress(run["progress"], run.get("slow_steps", 0.0)))
    hooks = [(session, "save_checkpoint", "sync_save"), (session, "load_checkpoint", "resume_load"),
             (persist.PersistJob, "run", "async_save")]
    saved = [(m, n, *patched(m, n, run, p)) for m, n, p in hooks]
    if run.get("vote_every", 1):  # the voting interval the ranks want, fixed so that the step a signal is honoured
        wanted = preemption.Agreement.wanted_every  # at is known (0: measured from step times, as in a user's run)
        saved.append((preemption.Agreement, "wanted_every", wanted, lambda self: run.get("vote_every", 1)))
    for module, name, _, wrapper in saved:
        setattr(module, name, wrapper)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    groups = set(dist.distributed_c10d._world.pg_map)
    outcome = {}
    try:
        trainer.train(resume_from_checkpoint=run.get("resume"))
    except TrainingPreempted as e:
        outcome = {"code": e.code, "step": e.step, "checkpoint": e.checkpoint, "saved": e.saved, "message": str(e)}
        if run.get("exit"):
            raise
    finally:
        for module, name, original, _ in saved:
            setattr(module, name, original)
    left = {
        "plugin_groups": len(plugin_dist._GROUPS),
        "new_groups": len(set(dist.distributed_c10d._world.pg_map) - groups),
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("hf_unified_ckpt")],
        "handlers_restored": all(signal.getsignal(s) == h for s, h in handlers.items()),
    }
    folders = sorted(int(n.split("-")[1]) for n in os.listdir(run["output_dir"]) if n.startswith("checkpoint-")) \
        if os.path.isdir(run["output_dir"]) else []
    return {**record(trainer, losses_of(trainer)), "preempted": outcome, "left": left, "checkpoints": folders}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(os.environ["WORLD_SIZE"])
    freeze_imports()
    with open(os.path.join(os.path.dirname(spec_path), f"pid-{spec['name']}-{dist_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    for run in spec["runs"]:
        result = run_one(run, world)
        if dist.get_rank() == 0 and run.get("result"):
            torch.save(result, run["result"])
    free_process_group_users()
    dist.barrier()
    dist.destroy_process_group()


def dist_rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except SystemExit as e:  # TrainingPreempted left uncaught: the status the process ends with, for the test
        spec_name = json.load(open(sys.argv[1]))["name"]
        with open(os.path.join(os.path.dirname(sys.argv[1]), f"exit-{spec_name}-{dist_rank()}"), "w") as f:
            f.write(str(e.code))
        raise
