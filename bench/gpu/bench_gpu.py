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

#: Llama shapes (vocab 32000, untied embeddings): ~8.5M, 134M, 953M parameters (measured).
SIZES = {"tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),
         "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
         "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16)}
MEASUREMENTS = ("save", "blocked", "throughput", "resume")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build(size: str, device: str, out: Path, steps: int, every: int | None, mode: str, batch: int, seq: int):
    """A Trainer on the seeded Llama of `size`: `mode` is "native" (no plugin), "unified", "async" or "flash"."""
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
        unified_checkpoint_memory_dir=f"/dev/shm/hf_uc_bench_gpu_{uuid.uuid4().hex[:8]}",
        unified_checkpoint_persist_every=4, unified_checkpoint_memory_keep=2)
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

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync(device)
            marks.setdefault("first", time.perf_counter())
            marks["step"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            marks["last"] = time.perf_counter()
            steps.append(marks["last"] - marks["step"])

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
    trainer.train(resume_from_checkpoint=resume)
    _sync(device)
    return {"total_s": time.perf_counter() - started, "to_first_step_s": marks["first"] - started,
            "to_last_step_s": marks["last"] - started, "steps_s": steps,
            "saves_s": saves, "saves_synced_s": synced, "waited_for_previous_s": waited,
            "flash_active": marks.get("flash_active")}


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
    memory = trainer.args.unified_checkpoint_memory_dir  # the run's own folder: empty once train() returned
    del trainer
    shutil.rmtree(memory, ignore_errors=True)
    _free(device)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    if mode == "flash" and result["saves_s"] and not result["flash_active"]:  # memory too small: saves went to disk
        raise RuntimeError("flash fell back to durable saves (see the warning above): /dev/shm cannot hold them")
    return result


def _free(device: str) -> None:
    import gc

    import torch
    from accelerate.state import AcceleratorState

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    AcceleratorState._reset_state(reset_partial_state=False)


def _after_save_cost(r: dict, every: int) -> tuple[float, float]:
    """Each save call plus the extra time of the step after it over the median step: (the mean over the saves after
    the first, the steady state where host buffers are reused; the first save's)."""
    median, steps = statistics.median(r["steps_s"]), r["steps_s"]
    costs = [save + (steps[(k + 1) * every] - median if (k + 1) * every < len(steps) else 0.0)
             for k, save in enumerate(r["saves_s"])]
    return statistics.mean(costs[1:] or costs), costs[0]


def measure(name: str, a, work: Path, note=lambda key, value: None) -> dict:
    """One measurement's figures; `note(key, value)` records each run's figure as it comes (a step cut off at its
    limit keeps them)."""
    args = (a.size, a.device, work)
    common = dict(batch=a.batch, seq=a.seq)
    if name == "save":  # a save after 2 steps, then 1 more step; the save call is the whole save
        ours = run(*args, "unified", 3, 2, **common)
        note("ours_s", ours["saves_s"][0])
        native = run(*args, "native", 3, 2, **common)
        return {"ours_s": ours["saves_s"][0], "native_s": native["saves_s"][0],
                "ratio": ours["saves_s"][0] / native["saves_s"][0], "native_then_fsync_s": native["saves_synced_s"][0],
                "ratio_to_durable_native": ours["saves_s"][0] / native["saves_synced_s"][0], "params": ours["params"]}
    if name == "blocked":
        every, steps = 5, 5 * a.saves + 1
        out, firsts = {}, {}
        for mode in ("unified", "async", "flash"):
            r = run(*args, mode, steps, every, isolate=True, **common)
            out[mode], firsts[mode] = _after_save_cost(r, every)  # the first allocates host buffers (pinned on a GPU)
            note(f"{mode}_s", out[mode])
            note(f"{mode}_first_save_s", firsts[mode])
        return {**{f"{m}_s": v for m, v in out.items()}, **{f"{m}_first_save_s": v for m, v in firsts.items()},
                "async_over_sync": out["async"] / out["unified"],
                "flash_over_sync": out["flash"] / out["unified"], "saves": a.saves}
    if name == "throughput":  # the whole train(), and to the end of its last step (before the last save's wait)
        runs = {}
        for mode, every in (("none", None), ("async", a.async_every), ("flash", a.flash_every)):
            r = run(*args, mode, a.steps, every, **common)
            runs[mode] = (r["total_s"], r["to_last_step_s"])
            note(f"{mode}_s", r["total_s"])
            note(f"{mode}_to_last_step_s", r["to_last_step_s"])
        (none, none_last), ratios = runs["none"], {}
        for mode in ("async", "flash"):
            ratios[f"{mode}_ratio"] = none / runs[mode][0]
            ratios[f"{mode}_ratio_to_last_step"] = none_last / runs[mode][1]
        return {**{f"{m}_s": t for m, (t, _) in runs.items()},
                **{f"{m}_to_last_step_s": t for m, (_, t) in runs.items()}, **ratios, "steps": a.steps,
                "async_every": a.async_every, "flash_every": a.flash_every, "step_s": none / a.steps, "target": 0.97}
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
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_uc_bench_gpu"))
    parser.add_argument("--json", type=Path, required=True)
    a = parser.parse_args()
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
