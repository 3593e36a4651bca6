"""Preemption benchmark (issue 30 item 6): what a preemption costs, DDP x 2 on CPU (gloo).

    python bench/bench_preemption.py [--reps 5] [--size tiny|50m] [--blocks 16] [--block-steps 60] [--json]

(a) Time from SIGTERM (sent to the torchrun launcher, which forwards it, as Kubernetes and spot VMs do) to the
    launcher's exit, against a plain save of the same state: a launch that trains to the same step, saves there
    (the Trainer's periodic save, unified) and exits; timed from the save's start to the launcher's exit. Launches
    alternate (preempted, plain, preempted, ...), `--reps` of each; medians. Both include the processes' exit.
(b) The per-step cost of the agreement: in one launch, one training run whose preemption handling is switched on
    and off every `--block-steps` steps (`--blocks` blocks, the first of each kind dropped as warm-up); throughput
    with it on / throughput with it off, from the mean step time of each block (median over blocks).
    Target >= 0.99. (The ranks vote every step unless votes would cost more than 0.5 %: then every few steps.)

Prints the figures and, with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

#: --size: the tests' tiny Llama (steps of milliseconds: the agreement's cost is most visible), or a ~50M one.
SIZES = {"tiny": None,
         "50m": dict(vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)}
PREEMPT_AT = 3  # the step reached before the signal is sent (and the plain save's step)


# ---- worker (under torchrun) --------------------------------------------------------------------------------------
def worker(mode: str, out: Path, size: str, blocks: int, block_steps: int) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from support import trainers  # make_trainer builds its model with trainers.build_model

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if dist.get_rank() == 0:
                if state.global_step == PREEMPT_AT:
                    (out / "save_start").write_text(repr(time.time()))  # the plain run's save follows at once
                (out / "step").write_text(str(state.global_step))

    class Toggle(TrainerCallback):
        """Switches the trainer's preemption handling on and off every `block_steps` steps (every rank at the same
        step; switching off takes the vote in flight first) and records each block's step times, measured from one
        step's begin to the next one's, so across the step boundary where the vote is."""

        def __init__(self):
            self.blocks: list[dict] = []
            self.began = None
            self.run = None

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.began is not None and self.blocks:
                self.blocks[-1]["steps"].append(now - self.began)
            if state.global_step % block_steps == 0:
                on = (state.global_step // block_steps) % 2 == 0
                session = trainer._uc_session
                run = session.preemption
                if not on and run is not None:
                    run.watch.vote(now=True)  # the vote in flight, taken; the same watch goes back on later
                    self.run, session.preemption = run, None
                elif on and run is None:
                    session.preemption = self.run
                self.blocks.append({"on": on, "steps": []})
            self.began = time.perf_counter()

    if SIZES[size] is not None:
        trainers.build_model = lambda kind="llama", seed=0: LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    steps = {"preempt": 10**6, "plain": PREEMPT_AT, "toggle": blocks * block_steps}[mode]
    trainer = trainers.make_trainer(out / "run", world_size=dist_world(), max_steps=steps,
                                    save_steps=PREEMPT_AT if mode == "plain" else 10**6, logging_steps=10**6,
                                    save_strategy="no" if mode == "toggle" else "steps")
    trainer.add_callback(Marks())
    if mode == "toggle":
        toggle = Toggle()
        trainer.add_callback(toggle)
    trainer.train()
    if mode == "toggle" and dist.get_rank() == 0:
        watch = (trainer._uc_session.preemption or toggle.run).watch
        (out / "blocks.json").write_text(json.dumps({"blocks": toggle.blocks,
                                                     "every": watch.agreement.every}))
    dist.barrier()
    dist.destroy_process_group()


def dist_world() -> int:
    return int(os.environ["WORLD_SIZE"])


# ---- driver -------------------------------------------------------------------------------------------------------
def launch(mode: str, out: Path, args) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", mode, "--out", str(out), "--size", args.size, "--blocks", str(args.blocks),
           "--block-steps", str(args.block_steps)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, step: int, proc: subprocess.Popen) -> None:
    while not (path.is_file() and int(path.read_text() or 0) >= step):
        if proc.poll() is not None:
            sys.exit(f"the launch ended early:\n{proc.communicate()[0][-6000:]}")
        time.sleep(0.01)


def preempted(out: Path, args) -> float:
    proc = launch("preempt", out, args)
    wait_for(out / "step", PREEMPT_AT, proc)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate()[0]
    took = time.time() - sent
    if "Training preempted by SIGTERM" not in text:
        (out / "launch.log").write_text(text)
        sys.exit(f"the run was not preempted (its output: {out / 'launch.log'}):\n{text[-6000:]}")
    return took


def plain(out: Path, args) -> float:
    proc = launch("plain", out, args)
    text = proc.communicate()[0]
    if proc.returncode != 0:
        sys.exit(f"the plain launch failed:\n{text[-6000:]}")
    return time.time() - float((out / "save_start").read_text())


def throughput(out: Path, args) -> dict:
    proc = launch("toggle", out, args)
    text = proc.communicate()[0]
    if proc.returncode != 0:
        sys.exit(f"the toggle launch failed:\n{text[-6000:]}")
    record = json.loads((out / "blocks.json").read_text())
    blocks = record["blocks"]
    per = {True: [], False: []}
    for block in blocks[2:]:  # the first block of each kind is warm-up
        if block["steps"]:
            steps = block["steps"][2:]  # the block's first steps carry the switch itself
            per[block["on"]].append(statistics.fmean(steps))  # a mean: votes may be every few steps
    on, off = statistics.median(per[True]), statistics.median(per[False])
    return {"step_s_on": on, "step_s_off": off, "ratio": off / on, "blocks": len(blocks),
            "every": record["every"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["preempt", "plain", "toggle"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--block-steps", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out, args.size, args.blocks, args.block_steps)
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="bench-preemption-"))
    times = {"preempted": [], "plain": []}
    for rep in range(args.reps):
        times["preempted"].append(preempted(root / f"preempt-{rep}", args))
        times["plain"].append(plain(root / f"plain-{rep}", args))
        print(f"rep {rep}: signal -> exit {times['preempted'][-1]:.2f} s; plain save -> exit {times['plain'][-1]:.2f} s",
              flush=True)
    a = {k: statistics.median(v) for k, v in times.items()}
    b = throughput(root / "toggle", args)
    result = {"size": args.size, "nproc": 2, "cpus": os.cpu_count(), "reps": args.reps,
              "signal_to_exit_s": a["preempted"], "plain_save_to_exit_s": a["plain"],
              "exit_ratio": a["preempted"] / a["plain"], "times": times, "throughput": b,
              "throughput_target": 0.99, "throughput_met": b["ratio"] >= 0.99}
    print(f"\nDDP x 2, --size {args.size}, {os.cpu_count()} CPU cores, medians of {args.reps} alternating launches:")
    print(f"  (a) SIGTERM -> exit {a['preempted']:.2f} s / plain save -> exit {a['plain']:.2f} s = "
          f"{result['exit_ratio']:.2f}")
    print(f"  (b) throughput with preemption handling on / off = {b['ratio']:.4f} (target >= 0.99; mean step "
          f"{b['step_s_on'] * 1e3:.2f} ms on, {b['step_s_off'] * 1e3:.2f} ms off, {b['blocks']} blocks of "
          f"{args.block_steps} steps; the ranks voted every {b['every']} step(s) in the end)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
