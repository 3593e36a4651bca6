"""Mixture-of-Experts save vs dense save of a model of the same size (issue 33 item 4): what saving per expert costs.

    python bench/bench_moe.py [--engine zero3|zero2|fsdp2] [--nproc 2] [--reps 6] [--json]

One `torchrun --nproc_per_node N` launch (CPU, gloo; DeepSpeed or FSDP2 through the Trainer). It alternates two
models of about 50M parameters, each trained one step then saved `--reps` times (unified, durable when it returns;
blocks of reps / 2, in the order dense, MoE, dense, MoE, each block on a new Trainer):

- dense: the bench Llama of bench_save.py's 50m size (hidden 512, 10 layers, intermediate 1536, vocab 16000);
- MoE: Qwen3-MoE of the same width and vocab, 5 layers of 7 experts of intermediate 512 (transformers 5 holds
  them fused, the checkpoint writes them per expert: 70 tensors per layer and component instead of 2).

Each time is the slowest rank's, between barriers (bench_save.timed: sync(2) first; peak extra RSS sampled every
2 ms). Prints medians and

  (a) MoE save time per byte / dense save time per byte      target <= 1.1
  (b) MoE peak extra RSS / dense peak extra RSS during the save (reported)

--json prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_save import SIZES, bench_model, folder_bytes, max_over_ranks, timed  # noqa: E402

TARGET = 1.1
MOE = dict(hidden_size=512, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
           intermediate_size=1536, moe_intermediate_size=512, num_experts=7, num_experts_per_tok=2)


def moe_model():
    """The bench Qwen3-MoE (seeded), its parameter count and the bench data."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=16000, max_position_embeddings=64,
                                               tie_word_embeddings=False, **MOE))
    data = torch.randint(0, 16000, (64, 16))
    return model, sum(p.numel() for p in model.parameters()), [{"input_ids": x, "labels": x} for x in data]


def trainer_for(kind: str, out: Path, engine: str, world: int):
    """A Trainer (unified checkpoints attached) on the `kind` model, after one step."""
    import contextlib

    import deepspeed
    from transformers import Trainer

    import hf_unified_ckpt

    sys.path.insert(0, str(HERE.parent / "tests"))
    from support.env import fsdp_on_cpu, reset_accelerate_state
    from support.trainers import fsdp_args

    reset_accelerate_state()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model, params, data = bench_model(SIZES["50m"]) if kind == "dense" else moe_model()
    if engine == "fsdp2":
        engine_args = fsdp_args(2, model="llama" if kind == "dense" else "qwen3_moe")
    else:
        engine_args = {"deepspeed": {"zero_optimization": {"stage": int(engine[-1])},
                                     "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                                     "gradient_accumulation_steps": "auto"}}
    args = hf_unified_ckpt.UnifiedCheckpointArguments(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=4 // world, save_strategy="no",
        use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, unified_checkpoint=True,
        logging_steps=1000, **engine_args)
    with fsdp_on_cpu() if engine == "fsdp2" else contextlib.nullcontext():
        trainer = Trainer(model=model, args=args, train_dataset=data)
    hf_unified_ckpt.attach(trainer)
    trainer.train()
    return trainer, params


def worker(out: Path, reps: int, engine: str) -> None:
    """Runs under torchrun: blocks of saves, dense and MoE alternating."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    results = {kind: {"seconds": [], "rss": [], "bytes": 0, "params": 0} for kind in ("dense", "moe")}
    block = max(1, reps // 2)
    for kind in ("dense", "moe", "dense", "moe"):
        trainer, params = trainer_for(kind, out / kind, engine, world)
        results[kind]["params"] = params
        for rep in range(-1, block):  # -1: untimed (the first large write of a process is slower here)
            trainer.args.output_dir = str(out / f"{kind}-{rep}")
            seconds, extra = timed(lambda: trainer._save_checkpoint(trainer.model_wrapped, None))
            folder = out / f"{kind}-{rep}"
            if dist.get_rank() == 0:
                results[kind]["bytes"] = folder_bytes(folder)
                shutil.rmtree(folder)
            if rep >= 0:
                results[kind]["seconds"].append(max_over_ranks(seconds))
                results[kind]["rss"].append(max_over_ranks(extra))
            dist.barrier()
        trainer = None  # freed before the next block builds its own
    if dist.get_rank() == 0:
        (out / "moe_results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def report(out: Path, engine: str, nproc: int) -> dict:
    r = json.loads((out / "moe_results.json").read_text())
    med = {k: statistics.median(v["seconds"]) for k, v in r.items()}
    per_byte = {k: med[k] / r[k]["bytes"] for k in r}
    rss = {k: statistics.median(v["rss"]) for k, v in r.items()}
    ratio, rss_ratio = per_byte["moe"] / per_byte["dense"], rss["moe"] / max(rss["dense"], 1)
    print(f"engine {engine}, {nproc} ranks, {len(r['moe']['seconds'])} saves each, {os.cpu_count()} CPUs")
    for k in ("dense", "moe"):
        print(f"  {k:5s}: {r[k]['params'] / 1e6:.1f}M parameters, {r[k]['bytes'] / 1e6:.0f} MB, median save "
              f"{med[k]:.2f} s ({r[k]['bytes'] / med[k] / 1e6:.0f} MB/s), peak extra RSS {rss[k] / 1e6:.0f} MB")
    print(f"(a) MoE save time per byte / dense: {ratio:.2f}  target <= {TARGET}  {'met' if ratio <= TARGET else 'NOT met'}")
    print(f"(b) MoE peak extra RSS / dense: {rss_ratio:.2f}")
    return {"engine": engine, "nproc": nproc, "results": r, "median_seconds": med,
            "time_per_byte_ratio": {"value": ratio, "target": TARGET, "met": ratio <= TARGET},
            "peak_extra_rss_ratio": rss_ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["zero3", "zero2", "fsdp2"], default="zero3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker[0]), args.reps, args.worker[1])
    with tempfile.TemporaryDirectory(dir=HERE.parent) as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                        __file__, "--reps", str(args.reps), "--worker", tmp, args.engine], check=True, env=env)
        result = report(Path(tmp), args.engine, args.nproc)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
