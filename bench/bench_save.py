"""Save/resume benchmark: unified checkpoint vs the plain Trainer's native DeepSpeed checkpoint.

    python bench/bench_save.py [--engine zero2|fsdp2] [--reps 5] [--dtype fp32|bf16] [--out DIR]
    python bench/bench_save.py --quant [--reps 5] [--dtype fp32|bf16]     O1/O2 save and load time vs O0
    python bench/bench_save.py --ema [--reps 4] [--engine zero2|fsdp2]    step time with an EMA vs without
    any of these with --chart PATH: also draw the ratios it printed as a bar chart PNG

Launches `torchrun --nproc_per_node 2` (DeepSpeed ZeRO-2, or FSDP2 through the Trainer with the tests' CPU
shim; CPU, gloo) on a ~103M-parameter Llama-style model and, in the same launch, alternates per repetition:
our unified save, the native `Trainer._save_checkpoint` (DeepSpeed: weights file + `global_step*`; FSDP: the
sharded `pytorch_model_fsdp_0/` + `optimizer_0/`; then fsync of every file it wrote, so both are timed to
durable), and a raw sequential write + fsync of as many bytes as our save wrote. For DeepSpeed it then measures
resume: the native DeepSpeed load at the same topology (2 ranks) and ours at a changed world size (a second
launch with 1 rank). Prints medians and ratios with the absolute figures beside them:

  (a) unified save time / native save time            target <= 0.5
  (b) unified bytes on disk / native bytes            target <= 0.61
  (c) unified write throughput / raw write throughput target >= 0.8
  (d) peak extra RSS during save / largest rank share target <= 1.25
  (e) unified resume at 1 rank / native resume at 2   target <= 1.0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIOS: list[tuple[str, float]] = []  # (label, value) of each ratio this process printed, for --chart


def ratio(label: str, value: float) -> float:
    """Records a ratio about to be printed (for --chart) and returns it."""
    RATIOS.append((label, value))
    return value


def dump_ratios(out: Path) -> None:
    """A worker's ratios, for the launching process (which draws the chart) to read back."""
    (out / "ratios.json").write_text(json.dumps(RATIOS))


def draw_chart(path: Path, ratios: list[tuple[str, float]], title: str) -> None:
    """One horizontal bar per ratio, its value beside it, a dashed line at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = zip(*ratios)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 1.6 + 0.45 * len(values))), dpi=120)
    bars = ax.barh(range(len(values)), values, color="tab:blue")
    ax.set_yticks(range(len(values)), labels)
    ax.invert_yaxis()  # first printed on top
    ax.axvline(1.0, color="gray", ls="--", lw=1)
    ax.bar_label(bars, fmt="%.3g", padding=3, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    ax.set_xlim(0, max(*values, 1.0) * 1.15)
    ax.set(xlabel="ratio (dashed: 1.0)", title=title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS every 2 ms while active; `extra` is the peak above the starting value."""

    def __enter__(self):
        self.start, self.peak, self._stop = rss_bytes(), rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.extra = max(0, self.peak - self.start)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path, rank: int, world: int) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    for p in files[rank::world]:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def raw_write(path: Path, nbytes: int) -> None:
    block = os.urandom(64 * 2**20)
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(memoryview(block)[:n])
            left -= n
        os.fsync(f.fileno())


def build_trainer(out: Path, dtype: str, world: int, engine: str = "zero2", ckpt_config: str = "",
                  max_steps: int = 1, save_steps: int | None = None, train: bool = True):
    import contextlib

    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    import hf_unified_ckpt

    sys.path.insert(0, str(HERE.parent / "tests"))
    from _runs import fsdp_args, fsdp_on_cpu

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=11,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    data = torch.randint(0, 16000, (64, 16))
    dataset = [{"input_ids": x, "labels": x} for x in data]
    ds_config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                 "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}
    engine_args = {"deepspeed": ds_config} if engine == "zero2" else fsdp_args(2)
    args = hf_unified_ckpt.UnifiedCheckpointArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4 // world,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, bf16=(dtype == "bf16"),
        unified_checkpoint=True, unified_checkpoint_config=ckpt_config, logging_steps=1000, **engine_args)
    with fsdp_on_cpu() if engine == "fsdp2" else contextlib.nullcontext():
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
    hf_unified_ckpt.attach(trainer)
    if train:
        trainer.train()
    return trainer


def timed(fn) -> tuple[float, int]:
    """(seconds, extra RSS bytes) of fn() on this rank, between barriers."""
    import torch.distributed as dist

    dist.barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    return seconds, rss.extra


def max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def save_worker(out: Path, reps: int, dtype: str, engine: str) -> None:
    """Runs under torchrun with 2 ranks: alternates ours / native / raw, then times the native resume."""
    import torch.distributed as dist
    from transformers import Trainer
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    from hf_unified_ckpt.storage.manifest import read_manifest

    world = int(os.environ["WORLD_SIZE"])
    trainer = build_trainer(out / "train", dtype, world, engine)  # initialises the process group
    rank = dist.get_rank()
    model = trainer.model_wrapped
    results = {"ours": [], "native": [], "raw": [], "ours_rss": [], "ours_bytes": 0, "native_bytes": 0,
               "largest_share": 0}

    def save(kind: str, rep: int) -> Path:
        trainer.args.output_dir = str(out / f"{kind}-{rep}")
        folder = out / f"{kind}-{rep}" / "checkpoint-1"
        if kind == "ours":
            seconds, extra = timed(lambda: trainer._save_checkpoint(model, None))
            results["ours_rss"].append(max_over_ranks(extra))
        else:
            def native():
                Trainer._save_checkpoint(trainer, model, None)
                dist.barrier()
                fsync_tree(folder, rank, world)
            seconds, _ = timed(native)
        results[kind].append(max_over_ranks(seconds))
        return folder

    keep = {}
    for rep in range(reps):
        for kind in (("ours", "native") if rep % 2 == 0 else ("native", "ours")):
            folder = save(kind, rep)
            if rank == 0:
                results[f"{kind}_bytes"] = folder_bytes(folder)
                if kind == "ours":
                    manifest = read_manifest(folder)
                    results["largest_share"] = _largest_share(manifest, world)
            dist.barrier()
            if rep == reps - 1:
                keep[kind] = folder
            elif rank == 0:
                shutil.rmtree(folder.parent)
        share = int(results["ours_bytes"] / world) if rank == 0 else 0
        share = int(max_over_ranks(share))
        raw_path = out / f"raw-{rank}"
        seconds, _ = timed(lambda: raw_write(raw_path, share))
        results["raw"].append(max_over_ranks(seconds))
        raw_path.unlink()
    native_resume = []
    for _ in range(reps if engine == "zero2" else 0):
        seconds, _ = timed(lambda: deepspeed_load_checkpoint(model, str(keep["native"])))
        native_resume.append(max_over_ranks(seconds))
    results["native_resume"] = native_resume
    results["ours_folder"] = str(keep["ours"])
    if rank == 0:
        (out / "save_results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def async_worker(out: Path, reps: int, dtype: str, engine: str) -> None:
    """Runs under torchrun with 2 ranks: training-blocked time of an async save (the `_save_checkpoint` call
    plus the wait for the snapshot before the next step) vs a synchronous save, alternating."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    sync = build_trainer(out / "sync", dtype, world, engine)
    asyn = build_trainer(out / "async", dtype, world, engine, ckpt_config="async_save")
    saver = next(c for c in asyn.callback_handler.callbacks if hasattr(c, "saver")).saver
    results = {"sync": [], "async_call": [], "async_blocked": [], "async_total": []}
    for rep in range(reps):
        for kind in (("sync", "async") if rep % 2 == 0 else ("async", "sync")):
            trainer = sync if kind == "sync" else asyn
            trainer.args.output_dir = str(out / f"{kind}-{rep}")
            if kind == "sync":
                results["sync"].append(max_over_ranks(timed(lambda: trainer._save_checkpoint(trainer.model_wrapped,
                                                                                            None))[0]))
                continue
            dist.barrier()
            start = time.perf_counter()
            trainer._save_checkpoint(trainer.model_wrapped, None)
            call = time.perf_counter() - start
            saver.wait_for_snapshot()
            blocked = time.perf_counter() - start
            saver.wait()
            total = time.perf_counter() - start
            results["async_call"].append(max_over_ranks(call))
            results["async_blocked"].append(max_over_ranks(blocked))
            results["async_total"].append(max_over_ranks(total))
        if dist.get_rank() == 0:
            for kind in ("sync", "async"):
                shutil.rmtree(out / f"{kind}-{rep}", ignore_errors=True)
    results["host_buffer_bytes"] = max_over_ranks(saver.host_buffer_bytes())
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in results.items() if isinstance(v, list)}
        hidden = ratio("(a) blocked / sync save, copy hidden  (target <= 0.05)", med["async_call"] / med["sync"])
        waited = ratio("(a) blocked / sync save, next step waits", med["async_blocked"] / med["sync"])
        print(f"async_save, {engine} x 2, ~103M Llama, {dtype}, medians of {reps}:")
        print(f"(a) training-blocked time / sync save time = {hidden:.3f} when the "
              f"snapshot copy hides behind the next forward/backward ({med['async_call'] * 1000:.0f} ms vs "
              f"{med['sync'] * 1000:.0f} ms), {waited:.3f} if the next step waits "
              f"for all of it ({med['async_blocked'] * 1000:.0f} ms); background total "
              f"{med['async_total'] * 1000:.0f} ms   target <= 0.05")
        print(f"(c) extra host memory of async save: {results['host_buffer_bytes'] / 2**20:.0f} MiB per rank "
              "(reused snapshot buffers)")
        print(f"raw figures: {json.dumps({k: [round(x, 3) for x in v] for k, v in results.items() if isinstance(v, list)})}")
        dump_ratios(out)
    dist.barrier()
    dist.destroy_process_group()


def throughput_worker(out: Path, reps: int, dtype: str, engine: str, steps: int = 20, every: int = 5) -> None:
    """Runs under torchrun with 2 ranks: wall time of `steps` training steps with an async save every `every`
    steps, with a synchronous save every `every` steps, and without saves, alternating (the end of training
    waits for the last save)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    world = int(os.environ["WORLD_SIZE"])
    times = {"no_saves": [], "async_saves": [], "sync_saves": []}
    kinds = ("no_saves", "async_saves", "sync_saves")
    for rep in range(reps):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            AcceleratorState._reset_state(reset_partial_state=False)
            os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config
            unset_hf_deepspeed_config()
            trainer = build_trainer(out / f"{kind}-{rep}", dtype, world, engine, train=False, max_steps=steps,
                                    ckpt_config="async_save" if kind == "async_saves" else "",
                                    save_steps=None if kind == "no_saves" else every)
            seconds, _ = timed(trainer.train)
            times[kind].append(max_over_ranks(seconds))
            if dist.get_rank() == 0:
                shutil.rmtree(out / f"{kind}-{rep}", ignore_errors=True)
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        with_async = ratio("(b) throughput async saves / none  (target >= 0.97)", med["no_saves"] / med["async_saves"])
        with_sync = ratio("throughput sync saves / none", med["no_saves"] / med["sync_saves"])
        print(f"async_save throughput, {engine} x 2, ~103M Llama, {dtype}, {steps} steps, a save every {every}, "
              f"medians of {reps}:")
        print(f"(b) throughput with async saves / without saves = {with_async:.3f}   "
              f"({med['async_saves']:.1f} s vs {med['no_saves']:.1f} s for {steps} steps)   target >= 0.97")
        print(f"    for reference, with synchronous saves: {with_sync:.3f} ({med['sync_saves']:.1f} s)")
        print(f"raw figures: {json.dumps({k: [round(x, 2) for x in v] for k, v in times.items()})}")
        dump_ratios(out)
    dist.barrier()
    dist.destroy_process_group()


def ema_worker(out: Path, reps: int, dtype: str, engine: str, block: int = 5) -> None:
    """Runs under torchrun with 2 ranks: one training run whose EMA (word 'ema', ema_interval=1) is switched on and
    off every `block` steps, alternating; the step times of each mode (the first step of a block, the transition,
    left out; the slowest rank counts)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    world = int(os.environ["WORLD_SIZE"])
    order = [mode for rep in range(reps) for mode in (("off", "on") if rep % 2 == 0 else ("on", "off"))]
    trainer = build_trainer(out / "ema", dtype, world, engine, ckpt_config="ema", max_steps=block * len(order),
                            train=False)
    steps: dict[str, list[float]] = {"off": [], "on": []}

    class Toggle(TrainerCallback):
        def __init__(self):
            self.last = None

        def on_step_begin(self, args, state, control, **kwargs):
            mode = order[state.global_step // block]
            trainer._uc_average.interval = 1 if mode == "on" else 10**9
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if (state.global_step - 1) % block:  # not the first step of a block
                steps[order[(state.global_step - 1) // block]].append(max_over_ranks(time.perf_counter() - self.last))

    trainer.add_callback(Toggle())
    trainer.train()
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in steps.items()}
        params = sum(p.numel() for p in trainer.model.parameters())
        print(f"EMA overhead, {engine} x 2, {params / 1e6:.0f}M Llama, {dtype}, ema_interval=1, {reps} alternating "
              f"blocks of {block} steps per mode (medians of {len(steps['on'])} steps each):")
        overhead = ratio("step time with EMA / without", med["on"] / med["off"])
        print(f"step time with EMA / without = {overhead:.3f}   ({med['on']:.3f} s vs {med['off']:.3f} s per step)")
        print(f"raw figures: {json.dumps({k: [round(x, 3) for x in v] for k, v in steps.items()})}")
        dump_ratios(out)
    dist.barrier()
    dist.destroy_process_group()


def quant_worker(out: Path, reps: int, dtype: str) -> None:
    """Runs under torchrun with 2 ranks (ZeRO-2): alternates unified saves at O0, O1 and O2, then times verify + load
    of each at the same topology; the codec must not make saving slower than the bytes it saves."""
    import dataclasses

    import torch.distributed as dist

    from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine
    from hf_unified_ckpt.integration import _master_policy
    from hf_unified_ckpt.load import load_checkpoint, verify_checkpoint

    world = int(os.environ["WORLD_SIZE"])
    trainer = build_trainer(out / "train", dtype, world)
    model, rank = trainer.model_wrapped, dist.get_rank()
    base = trainer.args.unified_checkpoint_options
    stages = ("O0", "O1", "O2")
    results = {f"save_{s}": [] for s in stages} | {f"load_{s}": [] for s in stages} | {"bytes": {}}
    for rep in range(reps):
        for stage in stages[rep % 3:] + stages[:rep % 3]:  # rotate the order: no stage always goes first
            trainer.args._unified_checkpoint_options = dataclasses.replace(base, quant_stage=stage)
            trainer.args.output_dir = str(out / f"{stage}-{rep}")
            folder = out / f"{stage}-{rep}" / "checkpoint-1"
            results[f"save_{stage}"].append(max_over_ranks(timed(lambda: trainer._save_checkpoint(model, None))[0]))
            if rank == 0:
                results["bytes"][stage] = folder_bytes(folder)

            def load():
                manifest = verify_checkpoint(folder)
                load_checkpoint(folder, DeepSpeedEngine(model, _master_policy(base)), manifest, base)
            results[f"load_{stage}"].append(max_over_ranks(timed(load)[0]))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder.parent)
    if rank == 0:
        (out / "quant_results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def quant_report(out: Path, dtype: str) -> None:
    r = json.loads((out / "quant_results.json").read_text())
    med = {k: statistics.median(v) for k, v in r.items() if k != "bytes"}
    print(f"\nDeepSpeed ZeRO-2, 2 ranks, ~103M Llama, {dtype}: O1/O2 optimizer-moment compression vs O0, medians of "
          f"{len(r['save_O0'])} rotating repetitions (save to durable storage; load = verify + load, 2 ranks)")
    for stage in ("O1", "O2"):
        save = ratio(f"{stage}: save time {stage}/O0  (target <= 1.0)", med[f"save_{stage}"] / med["save_O0"])
        load = ratio(f"{stage}: load time {stage}/O0", med[f"load_{stage}"] / med["load_O0"])
        size = ratio(f"{stage}: bytes {stage}/O0", r["bytes"][stage] / r["bytes"]["O0"])
        print(f"{stage}: save time {stage}/O0 = {save:.2f} "
              f"({med[f'save_{stage}']:.2f} s vs {med['save_O0']:.2f} s)   target <= 1.0;  "
              f"load time {stage}/O0 = {load:.2f} "
              f"({med[f'load_{stage}']:.2f} s vs {med['load_O0']:.2f} s);  "
              f"bytes {stage}/O0 = {size:.2f} "
              f"({r['bytes'][stage] / 1e9:.2f} GB vs {r['bytes']['O0'] / 1e9:.2f} GB)")
    print(f"raw figures: {json.dumps({k: [round(x, 3) for x in v] for k, v in r.items() if k != 'bytes'})}")


def _largest_share(manifest: dict, world: int) -> int:
    """Bytes the busiest rank wrote: the plan gives each rank whole files; approximate by balancing files."""
    sizes = sorted((rec["size"] for name, rec in manifest["files"].items() if name.endswith(".safetensors")),
                   reverse=True)
    loads = [0] * world
    for s in sizes:
        loads[loads.index(min(loads))] += s
    return max(loads)


def resume_worker(out: Path, reps: int, dtype: str) -> None:
    """Runs under torchrun with 1 rank: times our verify + load of the 2-rank unified folder."""
    import torch.distributed as dist

    from hf_unified_ckpt.integration import _master_policy
    from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine
    from hf_unified_ckpt.load import load_checkpoint, verify_checkpoint

    results = json.loads((out / "save_results.json").read_text())
    trainer = build_trainer(out / "train1", dtype, 1)
    folder = Path(results["ours_folder"])
    options = trainer.args.unified_checkpoint_options
    times = []
    for _ in range(reps):
        def load():
            manifest = verify_checkpoint(folder)
            load_checkpoint(folder, DeepSpeedEngine(trainer.model_wrapped, _master_policy(options)), manifest, options)
        times.append(timed(load)[0])
    results["ours_resume_1rank"] = times
    (out / "save_results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def report(out: Path, dtype: str, engine: str) -> None:
    r = json.loads((out / "save_results.json").read_text())
    med = {k: statistics.median(r[k]) for k in ("ours", "native", "raw", "ours_rss", "native_resume",
                                                 "ours_resume_1rank") if r.get(k)}
    gb = 1e9
    ours_tp = r["ours_bytes"] / med["ours"] / gb
    raw_tp = r["ours_bytes"] / med["raw"] / gb
    name = "DeepSpeed ZeRO-2" if engine == "zero2" else "FSDP2 (native: sharded state dict)"
    a = ratio("(a) save time ours/native  (target <= 0.5)", med["ours"] / med["native"])
    b = ratio("(b) bytes on disk ours/native  (target <= 0.61)", r["ours_bytes"] / r["native_bytes"])
    c = ratio("(c) write speed ours/raw  (target >= 0.8)", ours_tp / raw_tp)
    d = ratio("(d) peak extra RSS / rank share  (target <= 1.25)", med["ours_rss"] / r["largest_share"])
    print(f"\n{name}, 2 ranks, ~103M Llama, {dtype}, medians of {len(r['ours'])} alternating repetitions")
    print(f"(a) save time       ours/native  = {a:.2f}   "
          f"({med['ours']:.2f} s vs {med['native']:.2f} s, both to durable storage)          target <= 0.5")
    print(f"(b) bytes on disk   ours/native  = {b:.2f}   "
          f"({r['ours_bytes'] / gb:.2f} GB vs {r['native_bytes'] / gb:.2f} GB)                      target <= 0.61")
    print(f"(c) write speed     ours/raw     = {c:.2f}   "
          f"({ours_tp:.2f} GB/s vs raw write+fsync of the same bytes {raw_tp:.2f} GB/s)   target >= 0.8")
    print(f"(d) peak extra RSS  / rank share = {d:.2f}   "
          f"({med['ours_rss'] / 2**20:.0f} MiB vs largest rank's share {r['largest_share'] / 2**20:.0f} MiB) "
          f"target <= 1.25")
    if "native_resume" in med:
        e = ratio("(e) resume ours@1 / native@2  (target <= 1.0)", med["ours_resume_1rank"] / med["native_resume"])
        print(f"(e) resume          ours@1/native@2 = {e:.2f}   "
              f"({med['ours_resume_1rank']:.2f} s incl. checksums vs {med['native_resume']:.2f} s)   target <= 1.0")
    print(f"raw figures: {json.dumps({k: [round(x, 3) for x in r[k]] for k in med})}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--engine", choices=["zero2", "fsdp2"], default="zero2")
    parser.add_argument("--out", default=None, help="scratch folder (default: a new one under /tmp), removed after")
    parser.add_argument("--worker", choices=["save", "resume", "async", "throughput", "quant", "ema"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--ema", action="store_true",
                        help="step time with an EMA of the weights (ema_interval=1) vs without, in one run")
    parser.add_argument("--quant", action="store_true",
                        help="ZeRO-2: save and load time of O1/O2-compressed optimizer moments vs O0")
    parser.add_argument("--throughput", action="store_true",
                        help="training throughput with an async save every --save-every steps vs no saves")
    parser.add_argument("--steps", type=int, default=20, help="--throughput: training steps per run")
    parser.add_argument("--save-every", type=int, default=5, help="--throughput: steps between saves")
    parser.add_argument("--async-save", action="store_true",
                        help="measure async_save: training-blocked time vs a synchronous save")
    parser.add_argument("--chart", type=Path, default=None, metavar="PATH",
                        help="also write the ratios this run printed as a horizontal bar chart PNG here")
    args = parser.parse_args()
    out = Path(args.out or f"/tmp/hf_unified_ckpt_bench_{os.getpid()}")
    if args.worker == "save":
        return save_worker(out, args.reps, args.dtype, args.engine)
    if args.worker == "resume":
        return resume_worker(out, args.reps, args.dtype)
    if args.worker == "async":
        return async_worker(out, args.reps, args.dtype, args.engine)
    if args.worker == "throughput":
        return throughput_worker(out, args.reps, args.dtype, args.engine, args.steps, args.save_every)
    if args.worker == "quant":
        return quant_worker(out, args.reps, args.dtype)
    if args.worker == "ema":
        return ema_worker(out, args.reps, args.dtype, args.engine)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        launches = ((2, "save"), (1, "resume")) if args.engine == "zero2" else ((2, "save"),)
        if args.async_save:
            launches = ((2, "async"),)
        if args.throughput:
            launches = ((2, "throughput"),)
        if args.quant:
            launches = ((2, "quant"),)
        if args.ema:
            launches = ((2, "ema"),)
        for nproc, worker in launches:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(Path(__file__).resolve()), "--worker", worker, "--reps", str(args.reps), "--dtype", args.dtype,
                   "--engine", args.engine, "--out", str(out), "--steps", str(args.steps),
                   "--save-every", str(args.save_every)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"benchmark {worker} launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            if worker in ("async", "throughput", "ema"):
                print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("{")))
                RATIOS.extend(tuple(pair) for pair in json.loads((out / "ratios.json").read_text()))
        if args.quant:
            quant_report(out, args.dtype)
        elif not (args.async_save or args.throughput or args.ema):
            report(out, args.dtype, args.engine)
        if args.chart:
            chart(args)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def chart(args: argparse.Namespace) -> None:
    """Draws the ratios this run printed into args.chart, titled with the mode, engine and dtype."""
    mode = next((f"--{flag.replace('_', '-')}" for flag in ("ema", "quant", "throughput", "async_save")
                 if getattr(args, flag)), "(save and resume)")
    engine = "DeepSpeed ZeRO-2" if args.quant or args.engine == "zero2" else "FSDP2"
    draw_chart(args.chart, RATIOS, f"bench_save.py {mode}\n{engine} x 2 ranks, {args.dtype}, ~103M Llama, "
                                   f"--reps {args.reps}")
    print(f"chart of these ratios: {args.chart}")


if __name__ == "__main__":
    main()
