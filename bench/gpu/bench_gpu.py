"""The figures users will quote, on one device (issue 34, part 2.2): one process, a Llama of `--size` in bf16 mixed
precision (fp32 weights and AdamW state, bf16 autocast), trained by the plain Trainer with the plugin attached.

    python bench/gpu/bench_gpu.py --device cuda|cpu --size 1b --json FILE [--only save,blocked,throughput,resume]

Measurements (each run a fresh Trainer on the same seeded model; the device is synchronized around every timing):
- save: the time of a save (the Trainer's `_save_checkpoint`, which returns once the checkpoint is complete) after
  training steps: ours (unified) / the native Trainer save of the same state (`unified_checkpoint=False`), and / the
  native save plus an fsync of its files (ours returns with the checkpoint on disk, the native save with its bytes in
  the page cache);
- blocked: what training waits for per save with `async_save` and with `flash` (the save call plus the extra time of
  the step after it, over the median step) / a synchronous unified save; each save first waits, untimed, for the
  previous one's writes (on a GPU a 1B model's 11 GB take longer to write than 5 steps take to train: measured
  together, the figure was the disk's, not the save's);
- throughput: the whole `train()` with an async save every `--async-every` steps (20), and with a flash save every
  `--flash-every` steps (5; persisting every 4th), / no saves, and the same to the end of the last step (a run whose
  last save falls on its last step waits for that save's write at the end: once per run, not per save); the ratio is
  bound by the write bandwidth where the saves' bytes take longer to write than the steps between them take to train;
- resume: `train(resume_from_checkpoint=...)` to the first step, from our checkpoint / from the native one.
Sizes: "tiny" (the CPU dry run), "100m", "1b". A JSON is written after every measurement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: raw_disk, bench_flash

#: Llama shapes (vocab 32000, untied embeddings): ~8.5M, 134M, 953M parameters (measured).
SIZES = {"tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),
         "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
         "300m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16),
         "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16)}
#: `--executor`: where background saves write ("thread", "process"; None: the default).
EXECUTOR: str | None = None
MEASUREMENTS = ("save", "blocked", "throughput", "resume", "restart", "lag")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build(size: str, device: str, out: Path, steps: int, every: int | None, mode: str, batch: int, seq: int,
          memory_dir: str | None = None, persist_every: int = 4):
    """A Trainer on the seeded Llama of `size`: `mode` is "native" (no plugin), "unified", "async" or "flash"; flash
    saves go to `memory_dir` (default: a fresh folder under /dev/shm) and every `persist_every`th is made durable."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    import hf_unified_ckpt

    torch.manual_seed(0)
    shape = SIZES[size]
    config = LlamaConfig(vocab_size=32000, num_key_value_heads=shape["num_attention_heads"],
                         max_position_embeddings=seq, tie_word_embeddings=False, **shape)
    with torch.device(device):  # initialized where it trains: seconds for 1B parameters on a GPU, not minutes
        model = LlamaForCausalLM(config)
    data = torch.randint(0, 32000, (max(64, batch * (steps + 1)), seq))
    words = {"async": "async_save", "flash": "flash"}.get(mode, "")
    args = hf_unified_ckpt.UnifiedCheckpointArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, optim="adamw_torch",
        save_strategy="steps" if every else "no", save_steps=every or 500, use_cpu=device == "cpu",
        bf16=device == "cuda", report_to=[], disable_tqdm=True, logging_steps=10**6, save_only_model=False,
        save_total_limit=1,  # a 1B checkpoint is ~13 GB: the disk holds a few
        unified_checkpoint=mode != "native", unified_checkpoint_config=words,
        unified_checkpoint_memory_dir=memory_dir or f"/dev/shm/hf_uc_bench_gpu_{uuid.uuid4().hex[:8]}",
        unified_checkpoint_persist_every=persist_every, unified_checkpoint_memory_keep=2,
        **({"unified_checkpoint_async_executor": EXECUTOR} if EXECUTOR else {}))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in data])
    if mode != "native":
        hf_unified_ckpt.attach(trainer)
    trainer._bench_native = mode == "native"
    trainer._bench_params = sum(p.numel() for p in model.parameters())
    return trainer


def timed_train(trainer, device: str, resume: str | None = None, isolate: bool = False) -> dict:
    """Train; return the total, the time to the first step, every step's time and every save call's time. With
    `isolate`, each save first waits (untimed, recorded apart) for the previous background save to finish writing, so
    that a save call's time is what it blocks by itself, not the wait for the disk behind an earlier one."""
    from transformers import TrainerCallback

    steps, saves, synced, waited, marks = [], [], [], [], {}
    probe = _GilProbe()

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync(device)
            marks.setdefault("first", time.perf_counter())
            marks["step"] = time.perf_counter()
            probe.mark()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            marks["last"] = time.perf_counter()
            steps.append(marks["last"] - marks["step"])
            probe.step_ended()

    trainer.add_callback(Steps())
    save = trainer._save_checkpoint

    def timed_save(*args, **kwargs):
        _sync(device)
        session = vars(trainer).get("_uc_session")  # None: the native Trainer
        saver = session.saver if session is not None else None
        if isolate and saver is not None:
            started = time.perf_counter()
            saver.wait()
            waited.append(time.perf_counter() - started)
        started = time.perf_counter()
        save(*args, **kwargs)
        _sync(device)
        saves.append(time.perf_counter() - started)
        if trainer._bench_native:  # native: what making its files durable adds (ours fsyncs)
            synced.append(saves[-1] + _fsync_tree(trainer.args.output_dir))
        tier = session.flash if session is not None else None
        marks["flash_active"] = tier is not None and tier.active  # False: saves fell back to durable storage

    trainer._save_checkpoint = timed_save
    started = time.perf_counter()
    probe.start()
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        probe.stop()
    _sync(device)
    return {"total_s": time.perf_counter() - started, "to_first_step_s": marks["first"] - started,
            "to_last_step_s": marks["last"] - started, "steps_s": steps,
            "saves_s": saves, "saves_synced_s": synced, "waited_for_previous_s": waited,
            "flash_active": marks.get("flash_active"), "gil_wait_ms": probe.per_step}


class _GilProbe:
    """How long a Python thread waits for the GIL, per training step: a thread that sleeps 1 ms at a time and adds
    up how late it wakes (waking needs the GIL). Training holds it too; what a background save adds over a run
    without saves is the background threads' share (issue 49: is the per-save loss the GIL?)."""

    def __init__(self):
        import threading

        self._stop, self._late, self.per_step = threading.Event(), 0.0, []
        self._thread = threading.Thread(target=self._run, daemon=True, name="gil-probe")

    def _run(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self._late += max(0.0, time.perf_counter() - t - 0.001)

    def start(self):
        self._thread.start()

    def mark(self):
        self._late = 0.0

    def step_ended(self):
        self.per_step.append(round(self._late * 1000, 2))

    def stop(self):
        self._stop.set()
        self._thread.join()


def _fsync_tree(folder: str) -> float:
    """Seconds to fsync every file under `folder` (the native save returns with its bytes in the page cache)."""
    import os

    from hf_unified_ckpt.store.local_io import fsync_file

    started = time.perf_counter()
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_file(os.path.join(root, name))
    return time.perf_counter() - started


def run(size, device, work: Path, mode, steps, every, batch, seq, resume=None, keep=False, isolate=False) -> dict:
    out = work / f"{mode}-{uuid.uuid4().hex[:6]}"
    trainer = build(size, device, out, steps, every, mode, batch, seq)
    result = {**timed_train(trainer, device, resume, isolate), "params": trainer._bench_params, "output_dir": str(out)}
    result["checkpoint_bytes"] = _newest_checkpoint_bytes(out)
    memory = trainer.args.unified_checkpoint_memory_dir  # the run's own folder: empty once train() returned
    del trainer
    shutil.rmtree(memory, ignore_errors=True)
    _free(device)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    if mode == "flash" and result["saves_s"] and not result["flash_active"]:  # memory too small: saves went to disk
        raise RuntimeError("flash fell back to durable saves (see the warning above): /dev/shm cannot hold them")
    return result


def _newest_checkpoint_bytes(out: Path) -> int:
    """Bytes of the newest `checkpoint-N` under `out` (0 where none)."""
    folders = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]) if p.name.rsplit(
        "-", 1)[1].isdigit() else -1)
    return sum(p.stat().st_size for p in folders[-1].rglob("*") if p.is_file()) if folders else 0


def _raw(work: Path, nbytes: int) -> dict:
    """A raw direct write of `nbytes` random bytes under `work` (bench/raw_disk.py): the disk's yardstick."""
    from raw_disk import raw_write

    work.mkdir(parents=True, exist_ok=True)
    return raw_write(work, nbytes)


def _free(device: str) -> None:
    import gc

    import torch
    from accelerate.state import AcceleratorState

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    AcceleratorState._reset_state(reset_partial_state=False)


def _per_save_loss(run: dict, none: dict) -> dict:
    """Where a save's cost lands: the extra seconds (over the run without saves' median step) and the extra GIL wait
    of the step after each save and of the next four together, averaged over the saves after the first."""
    base, gil = statistics.median(none["steps_s"]), statistics.median(none["gil_wait_ms"])
    steps, waits, after, next4, gil_next4 = run["steps_s"], run["gil_wait_ms"], [], [], []
    for k, step in enumerate(run["saves_after_step"][1:]):
        if step + 5 <= len(steps):
            after.append(steps[step] - base)
            next4.append(sum(steps[step + 1:step + 5]) - 4 * base)
            gil_next4.append((sum(waits[step:step + 5]) - 5 * gil) / 1000)
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
    return {"step_after_s": mean(after), "next_four_s": mean(next4), "gil_wait_5_steps_s": mean(gil_next4)}


def _after_save_cost(r: dict, every: int) -> tuple[float, float]:
    """Each save call plus the extra time of the step after it over the median step: (the mean over the saves after
    the first, the steady state where host buffers are reused; the first save's)."""
    median, steps = statistics.median(r["steps_s"]), r["steps_s"]
    costs = [save + (steps[(k + 1) * every] - median if (k + 1) * every < len(steps) else 0.0)
             for k, save in enumerate(r["saves_s"])]
    return statistics.mean(costs[1:] or costs), costs[0]


MANIFEST = "unified_checkpoint.json"


def _open_flash(trainer):
    """A flash tier opened by hand on a trained `trainer`, as `train()` opens one (bench_flash.py's `open_flash`, one
    process). Closed by `trainer._uc_session.make_durable()`."""
    from hf_unified_ckpt.flash.tier import FlashTier, checkpoint_bytes
    from hf_unified_ckpt.trainer.storage import checkpoint_root

    flash = FlashTier(trainer.args.unified_checkpoint_options.flash, checkpoint_root(trainer))
    trainer._uc_session.flash = flash
    flash.open()
    if not flash.start(checkpoint_bytes(trainer._uc_session.engine())):
        raise RuntimeError("flash: the memory folder cannot hold a checkpoint (see the warning above)")
    return flash


def _wait_durable(flash, step: int, timeout: float = 300.0) -> None:
    from hf_unified_ckpt.flash.layout import DURABLE, FAILED, checkpoint_name

    name, deadline = checkpoint_name(step), time.monotonic() + timeout
    while not Path(flash.run, DURABLE, name).is_file():
        if Path(flash.run, FAILED, name).is_file():
            raise RuntimeError(f"the persister failed on {name}: {Path(flash.run, FAILED, name).read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} was not made durable within {timeout:.0f} s")
        time.sleep(0.01)


def _restart(a, work: Path, note) -> dict:
    """Restart to the first step: `train(resume_from_checkpoint=True)` finding the checkpoint of step 2 in the memory
    tier, vs resuming the same checkpoint from disk with its page cache dropped. The checkpoint is written once by a
    flash save (persist_every=1: made durable too) on a tier opened by hand; the resuming trainers keep it (their
    `make_durable` is a no-op), the owner frees it at the end (bench_flash.py's `resume` measurement, one process)."""
    from bench_flash import drop_page_cache  # bench/: the page cache dropped as bench_flash.py drops it

    memory = f"/dev/shm/hf_uc_bench_gpu_{uuid.uuid4().hex[:8]}"
    out = work / f"restart-{uuid.uuid4().hex[:6]}"
    common = dict(batch=a.batch, seq=a.seq, memory_dir=memory, persist_every=1)
    owner = build(a.size, a.device, out, 2, None, "flash", **common)
    owner.train()  # 2 steps, no saves
    flash = _open_flash(owner)
    figures = {"params": owner._bench_params}
    try:
        owner._save_checkpoint(owner.model, None)
        owner._uc_session.saver.wait()
        _wait_durable(flash, 2)
        durable, in_memory = out / "checkpoint-2", Path(flash.final_dir(2))
        figures["bytes"] = sum(p.stat().st_size for p in durable.rglob("*") if p.is_file())
        for kind in ("memory", "disk"):
            _free(a.device)
            trainer = build(a.size, a.device, out, 3, None, "flash", **common)
            trainer._uc_session.make_durable = lambda: None  # keep the memory checkpoint for the next resume
            if kind == "disk":
                drop_page_cache(durable)
            r = timed_train(trainer, a.device, resume=True if kind == "memory" else str(durable))
            resumed = Path(str(trainer._uc_session.resume.layout.path)).resolve()
            expected = (in_memory if kind == "memory" else durable).resolve()
            if resumed != expected:
                raise RuntimeError(f"restart {kind}: resumed from {resumed}, expected {expected}")
            figures[f"{kind}_to_first_step_s"] = r["to_first_step_s"]
            note(f"{kind}_to_first_step_s", r["to_first_step_s"])
            del trainer
    finally:
        owner._uc_session.make_durable()  # ends the lease: the persister frees the memory and exits
        del owner
        _free(a.device)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return {**figures, "memory_over_disk": figures["memory_to_first_step_s"] / figures["disk_to_first_step_s"],
            "target": 0.3}


def _save_at(step: int):
    from transformers import TrainerCallback

    class SaveAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step == step
            return control

    return SaveAt()


def _lag(a, work: Path, note) -> dict:
    """Durability lag: the save call of step `--lag-at` -> its manifest on disk (the commit), while training goes on
    for `--lag-steps` more steps; async, and flash made durable at once (persist_every=1). Against a synchronous save
    of the same state (the `save` measurement)."""
    import threading

    figures = {}
    for mode in ("async", "flash"):
        out = work / f"lag-{mode}-{uuid.uuid4().hex[:6]}"
        trainer = build(a.size, a.device, out, a.lag_at + a.lag_steps, 10**6, mode, a.batch, a.seq, persist_every=1)
        trainer.add_callback(_save_at(a.lag_at))  # one save: save_steps=lag_at would save every lag_at steps
        marks, stop = {}, threading.Event()
        manifest = out / f"checkpoint-{a.lag_at}" / MANIFEST
        save = trainer._save_checkpoint

        def entered(*args, save=save, marks=marks, **kwargs):
            marks.setdefault("called", time.perf_counter())
            marks["saves"] = marks.get("saves", 0) + 1
            return save(*args, **kwargs)

        def poll(manifest=manifest, marks=marks, stop=stop):
            while not stop.wait(0.01):
                if manifest.is_file():
                    marks["committed"] = time.perf_counter()
                    return

        trainer._save_checkpoint = entered
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        memory = trainer.args.unified_checkpoint_memory_dir
        trainer.train()
        stop.set()
        poller.join()
        del trainer
        _free(a.device)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
        if marks.get("saves") != 1:
            raise RuntimeError(f"lag {mode}: {marks.get('saves', 0)} saves, not the one of step {a.lag_at}")
        if "committed" not in marks:
            raise RuntimeError(f"lag {mode}: no commit of checkpoint-{a.lag_at} seen")
        figures[f"{mode}_lag_s"] = marks["committed"] - marks["called"]
        note(f"{mode}_lag_s", figures[f"{mode}_lag_s"])
    return {**figures, "lag_at": a.lag_at, "steps_after": a.lag_steps, "target_over_sync_save": 2.0}


def measure(name: str, a, work: Path, note=lambda key, value: None) -> dict:
    """One measurement's figures; `note(key, value)` records each run's figure as it comes (a step cut off at its
    limit keeps them)."""
    args = (a.size, a.device, work)
    common = dict(batch=a.batch, seq=a.seq)
    if name == "save":  # a save after 2 steps, then 1 more step; the save call is the whole save
        ours = run(*args, "unified", 3, 2, keep=True, **common)
        shutil.rmtree(ours["output_dir"], ignore_errors=True)
        figures = {"ours_s": ours["saves_s"][0], "bytes": ours["checkpoint_bytes"], "params": ours["params"],
                   "ours_gb_s": ours["checkpoint_bytes"] / ours["saves_s"][0] / 1e9}
        figures["s_per_gb"] = ours["saves_s"][0] / (ours["checkpoint_bytes"] / 1e9)
        note("ours_s", figures["ours_s"])
        if "raw" in a.versus:  # the same bytes, random, written raw with O_DIRECT in 16 MiB blocks, then fsync
            raw = _raw(work, ours["checkpoint_bytes"])
            figures.update(raw_s=raw["seconds"], raw_gb_s=raw["gb_s"], raw_direct=raw["direct"],
                           ratio_to_raw=figures["ours_gb_s"] / raw["gb_s"], target_to_raw=0.85)
            note("ratio_to_raw", figures["ratio_to_raw"])
        if "native" in a.versus:
            native = run(*args, "native", 3, 2, **common)
            figures.update(native_s=native["saves_s"][0], ratio=ours["saves_s"][0] / native["saves_s"][0],
                           native_then_fsync_s=native["saves_synced_s"][0],
                           ratio_to_durable_native=ours["saves_s"][0] / native["saves_synced_s"][0])
        return figures
    if name == "blocked":
        every, steps = 5, 5 * a.saves + 1
        out, firsts = {}, {}
        for mode in a.blocked_modes.split(","):
            r = run(*args, mode, steps, every, isolate=True, **common)
            out[mode], firsts[mode] = _after_save_cost(r, every)  # the first allocates host buffers (pinned on a GPU)
            note(f"{mode}_s", out[mode])
            note(f"{mode}_first_save_s", firsts[mode])
        figures = {**{f"{m}_s": v for m, v in out.items()}, **{f"{m}_first_save_s": v for m, v in firsts.items()},
                   **{f"{m}_first_over_later": firsts[m] / out[m] for m in out}, "saves": a.saves,
                   "target_first_over_later": 2.0}
        if "unified" in out:
            figures.update({f"{m}_over_sync": out[m] / out["unified"] for m in ("async", "flash") if m in out})
        return figures
    if name == "throughput":  # the whole train(), and to the end of its last step (before the last save's wait)
        runs, last_bytes, profile = {}, 0, {}
        for mode, every in (("none", None), ("async", a.async_every), ("flash", a.flash_every)):
            r = run(*args, mode, a.steps, every, **common)
            runs[mode] = (r["total_s"], r["to_last_step_s"])
            profile[mode] = {"steps_s": [round(x, 4) for x in r["steps_s"]], "gil_wait_ms": r["gil_wait_ms"],
                             "saves_after_step": [every * (k + 1) for k in range(len(r["saves_s"]))] if every else [],
                             # each save call's own time: what a save blocks, beside the steps' time (issue 59)
                             "saves_s": [round(x, 4) for x in r["saves_s"]]}
            note("profile", profile)
            last_bytes = r["checkpoint_bytes"] if mode == "async" else last_bytes
            note(f"{mode}_s", r["total_s"])
            note(f"{mode}_to_last_step_s", r["to_last_step_s"])
        (none, none_last), ratios = runs["none"], {}
        for mode in ("async", "flash"):
            ratios[f"{mode}_ratio"] = none / runs[mode][0]
            ratios[f"{mode}_ratio_to_last_step"] = none_last / runs[mode][1]
        # the end of train() with async saves: the wait for the last save's write (plus the end's own costs), against
        # a raw write of that save's bytes
        end_wait = (runs["async"][0] - runs["async"][1]) - (none - none_last)
        raw = _raw(work, last_bytes) if last_bytes else {"seconds": float("nan")}
        return {**{f"{m}_s": t for m, (t, _) in runs.items()},
                **{f"{m}_to_last_step_s": t for m, (_, t) in runs.items()}, **ratios, "steps": a.steps,
                "async_every": a.async_every, "flash_every": a.flash_every, "step_s": none / a.steps,
                "target_to_last_step": {"async": 0.98, "flash": 0.97},
                "async_end_wait_s": end_wait, "last_save_bytes": last_bytes, "raw_last_save_s": raw["seconds"],
                "async_end_wait_over_raw": end_wait / raw["seconds"], "target_end_wait_over_raw": 1.2,
                "per_save_loss_s": {m: _per_save_loss(profile[m], profile["none"]) for m in ("async", "flash")},
                "profile": profile}
    if name == "restart":
        return _restart(a, work, note)
    if name == "lag":
        return _lag(a, work, note)
    if name == "resume":  # to the first step, from a checkpoint of step 2 written by each
        out = {}
        for mode in ("unified", "native"):
            saved = run(*args, mode, 2, 2, keep=True, **common)
            resumed = run(*args, mode, 3, None, resume=f"{saved['output_dir']}/checkpoint-2", **common)
            shutil.rmtree(saved["output_dir"], ignore_errors=True)
            out[f"{mode}_to_first_step_s"] = resumed["to_first_step_s"]
            note(f"{mode}_to_first_step_s", out[f"{mode}_to_first_step_s"])
        return {**out, "ratio": out["unified_to_first_step_s"] / out["native_to_first_step_s"]}
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=list(SIZES), default="1b")
    parser.add_argument("--only", default=",".join(MEASUREMENTS))
    parser.add_argument("--steps", type=int, default=60, help="throughput: steps per run")
    parser.add_argument("--async-every", type=int, default=20, help="throughput: steps between async saves")
    parser.add_argument("--flash-every", type=int, default=5, help="throughput: steps between flash saves")
    parser.add_argument("--saves", type=int, default=3, help="blocked: saves per run")
    parser.add_argument("--versus", default="native", help="save: against native and/or raw (a direct write of the "
                        "same bytes), comma-separated")
    parser.add_argument("--blocked-modes", default="unified,async,flash", help="blocked: the modes measured")
    parser.add_argument("--lag-at", type=int, default=5, help="lag: the step whose save is timed")
    parser.add_argument("--lag-steps", type=int, default=100, help="lag: steps trained after it")
    parser.add_argument("--executor", choices=("thread", "process"), default=None,
                        help="unified_checkpoint_async_executor of the background saves (default: the plugin's)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_uc_bench_gpu"))
    parser.add_argument("--json", type=Path, required=True)
    a = parser.parse_args()
    global EXECUTOR
    EXECUTOR = a.executor
    import torch

    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    results = {"device": device_name, "size": a.size, "batch": a.batch, "seq": a.seq, "torch": torch.__version__,
               "dev_shm_free_gb": round(shutil.disk_usage("/dev/shm").free / 2**30, 1), "measurements": {}}
    failed = False
    for name in a.only.split(","):
        started = time.perf_counter()
        partial = results["measurements"][name] = {"partial": True}

        def note(key, value, partial=partial):
            partial[key] = value
            a.json.write_text(json.dumps(results, indent=1))

        try:
            results["measurements"][name] = measure(name, a, a.work, note)
        except Exception as e:  # recorded; the next measurement goes on
            failed = True
            results["measurements"][name] = {**partial, "error": f"{type(e).__name__}: {e}"}
        results["measurements"][name]["seconds"] = round(time.perf_counter() - started, 1)
        a.json.write_text(json.dumps(results, indent=1))
        print(name, json.dumps(results["measurements"][name]), flush=True)
    shutil.rmtree(a.work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
