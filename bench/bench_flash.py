"""Flash (memory tier) benchmark (issue 32 item 6): what a flash save costs training, how long a checkpoint takes to
become durable, and how much faster a restart from memory is than from disk.

    python bench/bench_flash.py [--reps 5] [--size 103m] [--nproc 2] [--steps 20] [--save-every 5]
                                [--persist-every 4] [--memory-keep 2] [--resume-step 2]
                                [--only blocked,throughput,resume,lag] [--memory-dir DIR] [--out DIR] [--json]
    smoke test: python bench/bench_flash.py --size tiny --reps 1      (or --size 50m --reps 1)

Engine: plain DDP through the Trainer (`ddp_backend="gloo"`, no DeepSpeed), `torchrun --nproc_per_node N` (N =
--nproc, default 2) on CPU, fp32, AdamW (`optim="adamw_torch"`), on bench_save.py's Llama (--size: ~50M, ~103M
(default), ~200M parameters, vocab 16000; `tiny` (~4.5M) for smoke tests), a global batch of 4 (4 // N per rank),
sequences of 16 tokens. Saves are `unified_checkpoint_config="flash"` with `unified_checkpoint_persist_every` = M
(--persist-every, default 4) and `unified_checkpoint_memory_keep` = K (--memory-keep, default 2), into a memory
folder of its own (--memory-dir; default a fresh `/dev/shm/hf_unified_ckpt-bench-<uuid>`, removed at the end).
One torchrun launch per measurement; inside it the repetitions (--reps, default 5) alternate the order of the two
contenders, and each time is the slowest rank's, started after a barrier (and an `os.sync()`). Medians are
printed with the absolute figures beside every ratio:

(1) blocked time per flash save / memcpy of the rank's bytes              target <= 1.5
    A trainer trained one step; then a flash tier is opened by hand on it (`FlashTier(...).open()` and
    `.start(...)`, what `train()` does before its first step: the persister is started and the lease's heartbeat
    runs) and saves are made with `trainer._save_checkpoint(trainer.model, None)` at increasing `global_step`s.
    Blocked = that call + `trainer._uc_session.saver.wait_for_snapshot()` (the snapshot copy, straight into the
    memory files an evicted checkpoint left, through mappings kept from save to save, which the next optimizer step
    waits for), per rank after a barrier, slowest rank. Memcpy = one `torch.Tensor.copy_` of
    `trainer._uc_session.saver.snapshot_bytes` bytes (what this rank snapshots) between two preallocated, already
    touched uint8 tensors, all ranks at once, slowest rank. K + 1 untimed rounds first (the save's gloo group made;
    the tier's memory taken: a save into fresh memory waits for its fresh pages in the copy, a cost (2) counts in
    its first saves). Outside the timing, between repetitions: `trainer._uc_session.saver.wait()` (the background
    write into memory) and, when the save was an Mth one, the persister's durable copy of it, so each save starts on
    an idle machine (the persister's competition for the CPU is what (2) measures).
(2) training throughput with flash saves / without saves, steady state      target >= 0.95
    Fresh trainers, `--steps` steps each (default 20), alternating: no saves (`save_strategy="no"`, no flash) vs a
    flash save every `--save-every` steps (default 5) with M and K as above. The target is checked on the second
    half of the runs (on_step_begin of step N/2 + 1 to the end of the last step): what saving costs training once
    the run is under way, whatever the run's length. Printed beside: the whole `trainer.train()`, which INCLUDES
    the run's one-time costs (the first two saves into fresh memory, the end of train(): the last save made durable
    and waited for, then the persister freeing the memory and exiting; the persister process being started). With
    20 steps, a save every 5 and M=4, the only durable copy is that of step 20, made while nothing trains: the time
    up to the end of the last step is printed beside (and the ratio without the end). For reference, async_save
    every 20 steps measured 0.92 on this machine. The step time printed in the header is the median step
    (on_step_begin -> on_step_end, slowest rank) of the no-save runs.
(3) restart to the first step: resume from memory / resume from disk     (no target)
    A trainer trains `--resume-step` k steps (default 2, no saves), a flash tier is opened by hand on it
    (persist_every=1) and `_save_checkpoint` writes checkpoint-k into memory; the persister makes it durable at
    `output_dir/checkpoint-k` (waited for). That tier stays open (its heartbeat keeps the lease alive) while fresh
    Trainers (new model, same output_dir, flash, max_steps=k+1) are timed from `trainer.train(...)` until the first
    `on_step_begin` (a TrainerCallback's `time.perf_counter()`), slowest rank, alternating: (a) memory:
    `resume_from_checkpoint=True` (memory wins the tie with the durable copy; checked: the resumed path is the
    memory one); (b) disk: `resume_from_checkpoint=<output_dir>/checkpoint-k`, after `os.sync()` and
    `posix_fadvise(POSIX_FADV_DONTNEED)` on every file of it (its page cache dropped). Both include the whole
    resume: the flash tier's start, the checksum verification and the load. One untimed round of both first.
    Why by hand: a flash `train()` frees the memory when it ends (`CheckpointSession.make_durable` ends the lease
    and the persister removes the run's memory folder), so a checkpoint saved inside `train()` is gone by the time
    the next trainer starts. The hand-opened tier keeps it; the resuming trainers' `make_durable` is replaced by a
    no-op (each would otherwise end the lease and free the memory after its one step). At the end the saving
    trainer's `make_durable()` ends the lease as `train()` would and the persister frees the memory and exits.
(4) durability lag                                                       (no target)
    One flash training run, persist_every=1 (so every save is made durable), a save every `--save-every` steps,
    `--reps` saves (+ 2 steps after the last): a thread on rank 0 polls every 10 ms for
    `output_dir/checkpoint-N/unified_checkpoint.json` (the durable commit: the manifest is written last and the
    folder renamed into place); lag = its first sighting - the `_save_checkpoint` call's entry (a wrapper on the
    trainer). It covers the snapshot, the background write into memory, the persister's poll (0.2 s), the
    CRC-checked copy, fsync and commit, with training running beside it (except for the last save's, which
    overlaps the end of the run).

--json prints, as the last line of stdout, one JSON object with the medians, bytes, M, K, step time and every ratio
with its target and whether it is met. The CPU count is printed in the header (ranks and the persister beyond it
are oversubscribed). --out: the work folder (default a new temporary folder, removed at the end; a given --out
keeps only the *_results.json files).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_save import SIZES, bench_model, cpu_cores, folder_bytes, max_over_ranks, settle  # noqa: E402

#: bench_save.py's sizes, and a tiny one for smoke tests (~4.5M parameters, mostly embeddings).
FLASH_SIZES = {**SIZES, "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4)}
MEASUREMENTS = ("blocked", "throughput", "resume", "lag")
#: The environment variable that carries --executor to the launched workers.
EXECUTOR_ENV = "BENCH_ASYNC_EXECUTOR"


def executor_option() -> dict:
    """`unified_checkpoint_async_executor` where --executor was given (else nothing: the script also measures a
    checkout from before the option, on PYTHONPATH)."""
    return {"unified_checkpoint_async_executor": os.environ[EXECUTOR_ENV]} if os.environ.get(EXECUTOR_ENV) else {}
BLOCKED_TARGET, THROUGHPUT_TARGET = 1.5, 0.95
ASYNC_REFERENCE = 0.92  # async_save every 20 steps / no saves, measured earlier on this machine
MANIFEST = "unified_checkpoint.json"
PERSISTER = "hf_unified_ckpt.flash.persister"


# ---- building blocks (run inside the torchrun workers) ---------------------------------------------------------
def build_ddp_trainer(out: Path, world: int, size: str, memory_dir: str, flash: bool = False, max_steps: int = 1,
                      save_steps: int | None = None, persist_every: int = 4, keep: int = 2):
    """A plain Trainer (DDP on gloo when world > 1; fp32; AdamW) on bench_save.py's Llama, with unified
    checkpoints attached; `flash` adds the memory tier. `trainer._bench_params` is the parameter count."""
    from transformers import Trainer

    import hf_unified_ckpt

    model, params, dataset = bench_model(FLASH_SIZES[size])
    args = hf_unified_ckpt.UnifiedCheckpointArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4 // world,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, optim="adamw_torch",
        use_cpu=True, ddp_backend="gloo" if world > 1 else None, report_to=[], disable_tqdm=True,
        logging_steps=1000, unified_checkpoint=True, unified_checkpoint_config="flash" if flash else "",
        unified_checkpoint_memory_dir=memory_dir, unified_checkpoint_persist_every=persist_every,
        unified_checkpoint_memory_keep=keep, **executor_option())
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    hf_unified_ckpt.attach(trainer)
    trainer._bench_params = params
    return trainer


def reset_accelerate() -> None:
    """Let this process build another Trainer (several runs in one launch)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        os.environ.pop(var, None)


def open_flash(trainer):
    """Open a flash tier on an already trained `trainer` by hand, as `train()` does before its first step (the
    machines found, the memory checked, the persister started or reused, the lease's heartbeat running).
    Collective. Close it with `trainer._uc_session.make_durable()` (what `train()` runs at its end)."""
    from hf_unified_ckpt.flash.tier import FlashTier, checkpoint_bytes
    from hf_unified_ckpt.trainer.storage import checkpoint_root

    flash = FlashTier(trainer.args.unified_checkpoint_options.flash, checkpoint_root(trainer))
    trainer._uc_session.flash = flash
    flash.open()
    size = checkpoint_bytes(trainer._uc_session.engine(), include_optimizer=not trainer.args.save_only_model)
    if not flash.start(size):
        raise SystemExit("flash: the memory folder cannot hold a checkpoint (see the warning above); nothing to "
                         "measure.")
    return flash


def wait_durable(flash, steps, timeout: float = 1200.0) -> None:
    """On the machine's leader: wait until the persister marked every step of `steps` durable (or failed, raised).
    Then a barrier. Collective."""
    import torch.distributed as dist

    from hf_unified_ckpt.flash.layout import DURABLE, FAILED, checkpoint_name

    if flash.is_machine_leader:
        deadline = time.monotonic() + timeout
        for step in steps:
            name = checkpoint_name(step)
            while not os.path.isfile(os.path.join(flash.run, DURABLE, name)):
                failed = os.path.join(flash.run, FAILED, name)
                if os.path.isfile(failed):
                    raise RuntimeError(f"the persister failed on {name}: {Path(failed).read_text()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} was not made durable within {timeout:.0f} s")
                time.sleep(0.01)
    dist.barrier()


def per_rank_seconds(fn) -> float:
    """fn()'s seconds on this rank, started on a settled disk right after a barrier (no trailing barrier: the
    caller takes the slowest rank with `max_over_ranks`)."""
    import torch.distributed as dist

    settle()
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_page_cache(folder: Path) -> None:
    """Write back, then drop from the page cache, every file under `folder` (no root needed for clean pages)."""
    os.sync()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def step_callback():
    """A TrainerCallback recording each step's duration (on_step_begin -> on_step_end), each step's start, the first
    step's start and the last step's end (`time.perf_counter()`)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.steps, self.begins, self.begin, self.first_begin, self.last_end = [], [], None, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()
            self.begins.append(self.begin)
            if self.first_begin is None:
                self.first_begin = self.begin

        def on_step_end(self, args, state, control, **kwargs):
            self.last_end = time.perf_counter()
            self.steps.append(self.last_end - self.begin)

    return StepTimes()


def slowest(values: list[float]) -> list[float]:
    """Element-wise max over ranks of a list of equal length on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def finish_worker(out: Path, name: str, results: dict) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (out / f"{name}_results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ---- the four measurements (torchrun workers) ------------------------------------------------------------------
def blocked_worker(a: argparse.Namespace) -> None:
    """(1): blocked time of a flash save (call + snapshot wait) vs a plain copy_ of the rank's snapshot bytes."""
    import torch
    import torch.distributed as dist

    world, out = int(os.environ["WORLD_SIZE"]), Path(a.out)
    trainer = build_ddp_trainer(out / "blocked", world, a.size, a.memory_dir, flash=True, max_steps=1,
                                persist_every=a.persist_every, keep=a.memory_keep)
    trainer.train()  # one step: the optimizer has its state; this train()'s own tier is finished and freed
    flash = open_flash(trainer)
    saver, rank = trainer._uc_session.saver, dist.get_rank()
    results = {"save_call": [], "blocked": [], "background_total": [], "memcpy": [], "params": trainer._bench_params,
               "world": world}
    saved: list[int] = []
    src = dst = None
    try:
        # untimed rounds first (rep < 0): the save's gloo group made, and K + 1 sets of memory files taken, so that
        # every timed save writes over an evicted checkpoint's files, as a run's saves do once its memory is in use
        for rep in range(-(a.memory_keep + 1), a.reps):
            order = ("flash", "memcpy") if rep < 0 or rep % 2 == 0 else ("memcpy", "flash")
            for kind in order:
                if kind == "memcpy":
                    if src is None:
                        nbytes = saver.snapshot_bytes
                        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
                        dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
                        results["rank_bytes"] = [int(x) for x in dist_gather(nbytes)]
                    seconds = max_over_ranks(per_rank_seconds(lambda: dst.copy_(src)))
                    if rep >= 0:
                        results["memcpy"].append(seconds)
                    continue
                trainer.state.global_step += 1
                settle()
                dist.barrier()
                start = time.perf_counter()
                trainer._save_checkpoint(trainer.model, None)
                call = time.perf_counter() - start
                saver.wait_for_snapshot()
                blocked = time.perf_counter() - start
                saver.wait()  # the background write into memory (and its commit)
                total = time.perf_counter() - start
                call, blocked, total = slowest([call, blocked, total])
                saved.append(trainer.state.global_step)
                if rep >= 0:
                    results["save_call"].append(call)
                    results["blocked"].append(blocked)
                    results["background_total"].append(total)
                if rank == 0 and "memory_checkpoint_bytes" not in results:
                    results["memory_checkpoint_bytes"] = folder_bytes(Path(flash.final_dir(saved[-1])))
                # outside the timing: the persister's copy of an Mth save, so the next save starts on an idle CPU
                if len(saved) % a.persist_every == 0:
                    wait_durable(flash, [saved[-1]])
                dist.barrier()
    finally:
        trainer._uc_session.make_durable()  # the last save made durable; the lease ended; the persister frees memory
    finish_worker(out, "blocked", results)


def dist_gather(value) -> list:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def throughput_worker(a: argparse.Namespace) -> None:
    """(2): wall time of whole `train()` calls of --steps steps, flash saves every --save-every steps vs none."""
    import torch.distributed as dist

    world, out = int(os.environ["WORLD_SIZE"]), Path(a.out)
    results = {"no_saves": [], "flash": [], "no_saves_to_last_step": [], "flash_to_last_step": [],
               "no_saves_second_half": [], "flash_second_half": [],
               "flash_to_first_step": [], "no_saves_to_first_step": [], "step_no_saves": [], "step_flash": []}
    kinds = ("no_saves", "flash")
    for rep in range(-1, a.reps):  # rep -1: a short untimed warm-up run (first-run costs of the process)
        for kind in (("no_saves",) if rep == -1 else kinds if rep % 2 == 0 else kinds[::-1]):
            reset_accelerate()
            folder = out / f"{kind}-{rep}"
            trainer = build_ddp_trainer(folder, world, a.size, a.memory_dir, flash=kind == "flash",
                                        max_steps=2 if rep == -1 else a.steps,
                                        save_steps=a.save_every if kind == "flash" else None,
                                        persist_every=a.persist_every, keep=a.memory_keep)
            results["params"] = trainer._bench_params
            steps = step_callback()
            trainer.add_callback(steps)
            settle()
            dist.barrier()
            start = time.perf_counter()
            trainer.train()
            total = time.perf_counter() - start
            half = steps.begins[len(steps.begins) // 2]  # the second half: the memory tier's pages in use already
            total, to_last, to_first, second = slowest([total, steps.last_end - start, steps.first_begin - start,
                                                        steps.last_end - half])
            step_times = slowest(steps.steps)
            if rep >= 0:
                results[kind].append(total)
                results[f"{kind}_to_last_step"].append(to_last)
                results[f"{kind}_to_first_step"].append(to_first)
                results[f"{kind}_second_half"].append(second)
                results[f"step_{kind}"].extend(step_times[1:])  # the first step of a run left out (warm-up)
            del trainer, steps
            gc.collect()
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)
    results["world"] = world
    finish_worker(out, "throughput", results)


def resume_worker(a: argparse.Namespace) -> None:
    """(3): train() start -> first on_step_begin of fresh trainers resuming checkpoint-k from memory vs from disk
    (page cache dropped). See the module docstring for why the memory tier is opened by hand."""
    import torch.distributed as dist

    world, out, k = int(os.environ["WORLD_SIZE"]), Path(a.out), a.resume_step
    run = out / "resume"
    owner = build_ddp_trainer(run, world, a.size, a.memory_dir, flash=True, max_steps=k, persist_every=1,
                              keep=a.memory_keep)
    owner.train()  # k steps, no saves; this train()'s own tier is finished and freed
    flash = open_flash(owner)
    results = {"memory": [], "disk": [], "params": owner._bench_params, "world": world, "step": k}
    try:
        owner._save_checkpoint(owner.model, None)  # checkpoint-k into memory; persist_every=1: made durable
        owner._uc_session.saver.wait()
        wait_durable(flash, [k])
        durable = run / f"checkpoint-{k}"
        memory_ckpt = Path(flash.final_dir(k))
        if dist.get_rank() == 0:
            results["bytes"] = folder_bytes(durable)
            results["memory_bytes"] = folder_bytes(memory_ckpt)
        kinds = ("memory", "disk")
        for rep in range(-1, a.reps):  # rep -1: one untimed round of both
            for kind in (kinds if rep == -1 or rep % 2 == 0 else kinds[::-1]):
                reset_accelerate()
                trainer = build_ddp_trainer(run, world, a.size, a.memory_dir, flash=True, max_steps=k + 1,
                                            persist_every=1, keep=a.memory_keep)
                trainer._uc_session.make_durable = lambda: None  # keep the memory checkpoint (see the module docstring)
                steps = step_callback()
                trainer.add_callback(steps)
                if kind == "disk" and dist.get_rank() == 0:
                    drop_page_cache(durable)
                settle()
                dist.barrier()
                start = time.perf_counter()
                trainer.train(resume_from_checkpoint=True if kind == "memory" else str(durable))
                seconds = max_over_ranks(steps.first_begin - start)
                resumed = Path(str(trainer._uc_session.resume.layout.path)).resolve()
                expected = (memory_ckpt if kind == "memory" else durable).resolve()
                if resumed != expected:
                    raise RuntimeError(f"resume {kind}: resumed from {resumed}, expected {expected}")
                if trainer.state.global_step != k + 1:
                    raise RuntimeError(f"resume {kind}: ended at step {trainer.state.global_step}, not {k + 1}")
                if rep >= 0:
                    results[kind].append(seconds)
                del trainer, steps
                gc.collect()
                dist.barrier()
    finally:
        owner._uc_session.make_durable()  # ends the lease: the persister frees the memory and exits
    finish_worker(out, "resume", results)


def lag_worker(a: argparse.Namespace) -> None:
    """(4): save call -> durable commit of every save of one flash training run (persist_every=1)."""
    import torch.distributed as dist

    world, out = int(os.environ["WORLD_SIZE"]), Path(a.out)
    folder = out / "lag"
    expected = [a.save_every * (i + 1) for i in range(a.reps)]
    trainer = build_ddp_trainer(folder, world, a.size, a.memory_dir, flash=True, max_steps=expected[-1] + 2,
                                save_steps=a.save_every, persist_every=1, keep=a.memory_keep)
    entered: dict[int, float] = {}
    committed: dict[int, float] = {}
    original = trainer._save_checkpoint

    def save_checkpoint(model, trial):
        entered[trainer.state.global_step] = time.perf_counter()
        return original(model, trial)

    trainer._save_checkpoint = save_checkpoint
    stop = threading.Event()

    def poll():
        while not stop.wait(0.01):
            for step in expected:
                if step not in committed and (folder / f"checkpoint-{step}" / MANIFEST).is_file():
                    committed[step] = time.perf_counter()

    poller = threading.Thread(target=poll, daemon=True)
    if dist.get_rank() == 0:
        poller.start()
    steps = step_callback()
    trainer.add_callback(steps)
    trainer.train()
    results = {"lag": [], "params": trainer._bench_params, "world": world, "steps": expected,
               "step_times": slowest(steps.steps)}
    if dist.get_rank() == 0:
        time.sleep(0.05)  # one more poll: train() returned after the last commit
        stop.set()
        poller.join()
        missing = [s for s in expected if s not in committed or s not in entered]
        if missing:
            raise RuntimeError(f"lag: no durable commit or save call seen for steps {missing}")
        results["lag"] = [committed[s] - entered[s] for s in expected]
        results["bytes"] = folder_bytes(folder / f"checkpoint-{expected[0]}")
    finish_worker(out, "lag", results)


WORKERS = {"blocked": blocked_worker, "throughput": throughput_worker, "resume": resume_worker, "lag": lag_worker}


# ---- the launching process -------------------------------------------------------------------------------------
def launch(a: argparse.Namespace, worker: str) -> None:
    """One torchrun launch of `worker` (exits on failure, with the persisters' logs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           str(Path(__file__).resolve()), "--worker", worker, "--reps", str(a.reps), "--size", a.size,
           "--out", str(a.out), "--memory-dir", a.memory_dir, "--steps", str(a.steps),
           "--save-every", str(a.save_every), "--persist-every", str(a.persist_every),
           "--memory-keep", str(a.memory_keep), "--resume-step", str(a.resume_step)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        logs = "".join(f"\n--- {p}:\n{p.read_text()[-3000:]}" for p in Path(a.memory_dir).rglob("persister.log"))
        sys.exit(f"benchmark {worker} launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}{logs}")
    print(f"({worker}: {time.perf_counter() - started:.0f} s of wall time, launch included)", file=sys.stderr)


def our_persisters(memory_dir: str) -> list[int]:
    """Process ids of persisters serving a run under `memory_dir` (started by this benchmark's trainers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [x.decode(errors="replace") for x in args]
        if PERSISTER in text and any(x.startswith(memory_dir.rstrip("/") + "/") for x in text):
            pids.append(int(entry.name))
    return pids


def clean_up(a: argparse.Namespace, own_memory: bool, own_out: bool) -> list[str]:
    """Stop any persister this benchmark left (by pid), remove its memory, and the work folder. Returns what it had
    to do beyond the normal end (a persister still running, memory left behind): a sign of a failure or a bug."""
    notes = []
    pids = our_persisters(a.memory_dir)
    if pids:
        deadline = time.monotonic() + 10  # a persister freeing the memory of a run that just ended
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = our_persisters(a.memory_dir)
    for pid in pids:
        notes.append(f"persister pid {pid} still running at the end: terminated")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in pids:
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    tier = Path(a.memory_dir) / "hf_unified_ckpt"
    left = []
    if tier.is_dir():
        for run in tier.iterdir():
            record = run / "run.json"
            try:
                ours = json.loads(record.read_text())["durable_root"].startswith(str(a.out))
            except (OSError, ValueError, KeyError):
                ours = own_memory
            if ours:
                left.append(run.name)
                shutil.rmtree(run, ignore_errors=True)
    if left:
        notes.append(f"memory left behind and removed: {left}")
    if own_memory:
        shutil.rmtree(a.memory_dir, ignore_errors=True)
    elif tier.is_dir() and not any(tier.iterdir()):
        tier.rmdir()
    if own_out:
        shutil.rmtree(a.out, ignore_errors=True)
    else:
        for child in Path(a.out).iterdir():
            if not child.name.endswith("_results.json"):
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
    return notes


def _check(value: float, op: str, target: float) -> dict:
    return {"value": round(value, 4), "target": target, "op": op,
            "met": bool(value <= target if op == "<=" else value >= target)}


def _mark(check: dict) -> str:
    return "met" if check["met"] else "NOT MET"


def report(a: argparse.Namespace, notes: list[str]) -> dict:
    """Prints the summary block and returns the --json object."""
    out, med = Path(a.out), statistics.median
    r = {name: json.loads((out / f"{name}_results.json").read_text()) for name in a.only}
    any_r = next(iter(r.values()))
    gb = 1e9
    summary: dict = {"engine": "ddp", "dtype": "fp32", "optimizer": "adamw_torch", "nproc": any_r["world"],
                     "cpu_cores": cpu_cores(), "size": a.size, "params": any_r["params"], "reps": a.reps,
                     "persist_every_M": a.persist_every, "memory_keep_K": a.memory_keep, "medians_s": {},
                     "ratios": {}}
    step = None
    if "throughput" in r:
        step = med(r["throughput"]["step_no_saves"])
        summary["step_time_s"] = round(step, 4)
    print(f"\nflash tier, DDP x {any_r['world']} ranks (gloo) on {cpu_cores()} CPU cores, "
          f"{any_r['params'] / 1e6:.1f}M-parameter Llama (--size {a.size}), fp32, AdamW; M (persist_every) = "
          f"{a.persist_every}, K (memory_keep) = {a.memory_keep}; "
          + (f"step time {step:.3f} s (median, no saves); " if step is not None else "")
          + f"medians of {a.reps} alternating repetitions")
    raw = {}
    if "blocked" in r:
        b = r["blocked"]
        m = {k: med(b[k]) for k in ("save_call", "blocked", "background_total", "memcpy")}
        c = summary["ratios"]["blocked_vs_memcpy"] = _check(m["blocked"] / m["memcpy"], "<=", BLOCKED_TARGET)
        summary["medians_s"].update({f"blocked_{k}" if k != "blocked" else k: round(v, 4) for k, v in m.items()})
        summary["bytes"] = {"rank_snapshot": b["rank_bytes"], "memory_checkpoint": b.get("memory_checkpoint_bytes")}
        share = max(b["rank_bytes"])
        print(f"(1) blocked time per flash save / memcpy = {c['value']:.2f}   ({m['blocked'] * 1000:.0f} ms: "
              f"_save_checkpoint {m['save_call'] * 1000:.0f} ms + snapshot wait; vs torch copy_ of the rank's "
              f"snapshot bytes ({'/'.join(f'{x / gb:.3f}' for x in b['rank_bytes'])} GB per rank) "
              f"{m['memcpy'] * 1000:.0f} ms = {share / m['memcpy'] / gb:.2f} GB/s; background write into memory "
              f"done {m['background_total']:.2f} s after the call; memory checkpoint "
              f"{b.get('memory_checkpoint_bytes', 0) / gb:.3f} GB)   target <= {BLOCKED_TARGET}  {_mark(c)}")
        raw["blocked"] = {k: b[k] for k in m}
    if "throughput" in r:
        t = r["throughput"]
        m = {k: med(t[k]) for k in ("no_saves", "flash", "no_saves_to_last_step", "flash_to_last_step",
                                    "no_saves_to_first_step", "flash_to_first_step")}
        halves = {k: med(t[f"{k}_second_half"]) for k in ("no_saves", "flash") if t.get(f"{k}_second_half")}
        m["step_flash"] = med(t["step_flash"])
        whole = summary["ratios"]["throughput_whole"] = round(m["no_saves"] / m["flash"], 4)
        summary["medians_s"].update({f"throughput_{k}": round(v, 4) for k, v in m.items()})
        to_last = m["no_saves_to_last_step"] / m["flash_to_last_step"]
        summary["ratios"]["throughput_to_last_step"] = round(to_last, 4)
        if len(halves) == 2:  # the target is the steady state's: what a save every 5 steps costs once under way
            c = summary["ratios"]["throughput"] = _check(halves["no_saves"] / halves["flash"], ">=", THROUGHPUT_TARGET)
            print(f"(2) throughput with flash saves / without, steady state = {c['value']:.3f}   (steps "
                  f"{a.steps // 2 + 1}-{a.steps}, the memory tier's pages and the persister's in use: "
                  f"{halves['flash']:.2f} s vs {halves['no_saves']:.2f} s; a flash save every {a.save_every} steps, "
                  f"M={a.persist_every})   target >= {THROUGHPUT_TARGET}  {_mark(c)}")
        print(f"    whole train(): {whole:.3f}   ({m['flash']:.2f} s vs {m['no_saves']:.2f} s for {a.steps} steps, "
              f"INCLUDING the run's one-time costs: the first saves into fresh memory, the last save made durable "
              f"and waited for, the persister's start and exit)   (async_save every 20 steps: {ASYNC_REFERENCE})")
        print(f"    up to the end of the last step: {to_last:.3f} ({m['flash_to_last_step']:.2f} s vs "
              f"{m['no_saves_to_last_step']:.2f} s), so train()'s end cost "
              f"{m['flash'] - m['flash_to_last_step']:.2f} s with flash vs "
              f"{m['no_saves'] - m['no_saves_to_last_step']:.2f} s without; to the first step "
              f"{m['flash_to_first_step']:.2f} s vs {m['no_saves_to_first_step']:.2f} s (persister start); median "
              f"step {m['step_flash']:.3f} s with flash vs {step:.3f} s")
        raw["throughput"] = {k: t[k] for k in ("no_saves", "flash")}
    if "resume" in r:
        s = r["resume"]
        m = {k: med(s[k]) for k in ("memory", "disk")}
        value = m["memory"] / m["disk"]
        summary["ratios"]["resume_memory_vs_disk"] = round(value, 4)
        summary["medians_s"].update({f"resume_{k}": round(v, 4) for k, v in m.items()})
        summary["bytes"] = {**summary.get("bytes", {}), "durable_checkpoint": s.get("bytes")}
        print(f"(3) restart to first step, memory / disk = {value:.2f}   ({m['memory']:.2f} s resuming "
              f"checkpoint-{s['step']} from memory (resume_from_checkpoint=True) vs {m['disk']:.2f} s from disk "
              f"(explicit path, page cache dropped); {s.get('bytes', 0) / gb:.3f} GB; train() start to the first "
              f"on_step_begin, slowest rank)")
        raw["resume"] = {k: s[k] for k in ("memory", "disk")}
    if "lag" in r:
        g = r["lag"]
        m = {"median": med(g["lag"]), "max": max(g["lag"])}
        summary["medians_s"]["durability_lag"] = round(m["median"], 4)
        summary["durability_lag_max_s"] = round(m["max"], 4)
        lag_step = med(g["step_times"][1:] or g["step_times"])
        print(f"(4) durability lag (save call -> durable commit) = {m['median']:.2f} s median, {m['max']:.2f} s max "
              f"over {len(g['lag'])} saves ({g['bytes'] / gb:.3f} GB each, persist_every=1, a save every "
              f"{a.save_every} steps, persister beside training, median step {lag_step:.3f} s in that run; "
              f"= {m['median'] / lag_step:.1f} steps)")
        raw["lag"] = g["lag"]
    for note in notes:
        print(f"NOTE: {note}")
    summary["notes"] = notes
    print("raw figures: " + json.dumps(_rounded(raw)))
    return summary


def _rounded(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", choices=list(FLASH_SIZES), default="103m",
                        help="Llama size: ~50M, ~103M (default), ~200M parameters; tiny (~4.5M) for smoke tests")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (DDP)")
    parser.add_argument("--steps", type=int, default=20, help="(2): training steps per run")
    parser.add_argument("--save-every", type=int, default=5, help="(2), (4): steps between flash saves")
    parser.add_argument("--persist-every", type=int, default=4, help="M: unified_checkpoint_persist_every of (1), (2)")
    parser.add_argument("--memory-keep", type=int, default=2, help="K: unified_checkpoint_memory_keep")
    parser.add_argument("--resume-step", type=int, default=2, help="(3): the step k of the checkpoint resumed")
    parser.add_argument("--only", default=",".join(MEASUREMENTS),
                        help=f"comma-separated measurements to run, of {','.join(MEASUREMENTS)} (default: all)")
    parser.add_argument("--memory-dir", default=None,
                        help="memory folder (default: a fresh /dev/shm/hf_unified_ckpt-bench-<uuid>, removed after)")
    parser.add_argument("--out", default=None, help="work folder (default: a new temporary folder, removed after)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line, the last of stdout")
    parser.add_argument("--executor", choices=["thread", "process"], default=None,
                        help="unified_checkpoint_async_executor of the flash saves (default: the option's default)")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.executor:
        os.environ[EXECUTOR_ENV] = a.executor  # the launched workers inherit it
    if a.worker:
        return WORKERS[a.worker](a)
    a.only = [m.strip() for m in a.only.split(",") if m.strip()]
    if not a.only or any(m not in MEASUREMENTS for m in a.only):
        parser.error(f"--only takes some of {','.join(MEASUREMENTS)}")
    if a.reps < 1 or a.steps < a.save_every or min(a.save_every, a.persist_every, a.memory_keep, a.resume_step) < 1:
        parser.error("--reps, --save-every, --persist-every, --memory-keep, --resume-step must be >= 1 and "
                     "--steps >= --save-every")
    sys.stdout.reconfigure(line_buffering=True)
    own_out = a.out is None
    a.out = str(Path(a.out).resolve()) if a.out else tempfile.mkdtemp(prefix="hf_unified_ckpt_bench_flash_")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    own_memory = a.memory_dir is None
    a.memory_dir = os.path.abspath(a.memory_dir or f"/dev/shm/hf_unified_ckpt-bench-{uuid.uuid4().hex[:12]}")
    os.makedirs(a.memory_dir, exist_ok=True)
    summary, notes = None, []
    try:
        for worker in a.only:
            launch(a, worker)
            notes += [f"after {worker}: {n}" for n in clean_up_between(a)]
        summary = report(a, notes)
    finally:
        for note in clean_up(a, own_memory, own_out):
            print(f"NOTE: {note}", file=sys.stderr)
    if a.json and summary is not None:
        print(json.dumps(summary))


def clean_up_between(a: argparse.Namespace) -> list[str]:
    """After a launch: every persister of it must have freed its memory and exited (each run ended its lease)."""
    notes = []
    deadline = time.monotonic() + 10
    while our_persisters(a.memory_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    if our_persisters(a.memory_dir):
        notes.append(f"persisters {our_persisters(a.memory_dir)} still running 10 s after the launch ended")
    tier = Path(a.memory_dir) / "hf_unified_ckpt"
    if tier.is_dir() and any(tier.iterdir()):
        notes.append(f"memory not freed: {sorted(p.name for p in tier.iterdir())}")
    return notes


if __name__ == "__main__":
    main()
