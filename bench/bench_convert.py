"""Offline converter vs DeepSpeed's own `zero_to_fp32` on the same legacy ZeRO checkpoint (issue 15, item 4).

    python bench/bench_convert.py [--stages 2 3] [--dtypes fp32 bf16] [--reps 3] [--json] [--chart PATH] [--out DIR]
                                  [--ours-args="--max-shard-size 100MB"]     (extra arguments of our convert)

For each ZeRO stage and dtype, one `torchrun --nproc_per_node 2` launch (DeepSpeed, CPU, gloo) trains the ~103M
Llama of bench_save.py for one step with the plain Trainer (no unified checkpoint), which writes a legacy
`checkpoint-1/global_step1/` with the ZeRO partitions. Then, alternating the order per repetition, each in a fresh
subprocess on that folder:

  ours:   python -m hf_unified_ckpt convert CKPT OUT --quiet        model + optimizer (+ fp32 master under bf16),
                                                                    durable (direct I/O + fsync), CRC-32 of every
                                                                    byte written, then checked complete (sizes)
  theirs: python -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization   fp32 model weights only, no fsync

and prints medians of wall time and peak RSS (the child's ru_maxrss from os.wait4, imports included):

  time ours / zero_to_fp32       target <= 1.0
  peak RSS ours / zero_to_fp32   target <= 0.5

plus the bytes each wrote (and bytes / wall time), the fsync time of theirs (not in their figure), the import-only
floor of each command, and whether our weights (fp32: the model files; bf16: the fp32 master weights) equal
zero_to_fp32's tensors ("weights equal: True/False").
The page cache cannot be dropped without root: the legacy folder is hot for both, hence the alternation.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_save import draw_chart, folder_bytes  # noqa: E402

#: The ~103M Llama of bench_save.build_trainer, with its data and DeepSpeed config.
LLAMA = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=11, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=64, tie_word_embeddings=False)
MiB = 2**20


# ---- the legacy checkpoint (torchrun worker) ----------------------------------------------------------------------
def train_worker(out: Path, stage: int, dtype: str) -> None:
    """Runs under torchrun with 2 ranks: one training step with the plain Trainer, saved as a legacy checkpoint."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    dataset = [{"input_ids": x, "labels": x} for x in torch.randint(0, LLAMA["vocab_size"], (64, 16))]
    ds_config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                 "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}
    args = TrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=2, save_strategy="steps",
                             save_steps=1, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True,
                             bf16=(dtype == "bf16"), logging_steps=1000, deepspeed=ds_config)
    Trainer(model=model, args=args, train_dataset=dataset).train()
    dist.barrier()
    dist.destroy_process_group()


def make_legacy(out: Path, stage: int, dtype: str) -> Path:
    """Launches train_worker; returns its `checkpoint-1` folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(Path(__file__)),
           "--worker", "--stage", str(stage), "--dtype", dtype, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    ckpt = out / "checkpoint-1"
    if proc.returncode != 0 or not (ckpt / "global_step1").is_dir():
        sys.exit(f"training launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return ckpt


# ---- measuring a subprocess -----------------------------------------------------------------------------------------
#: Forks and execs the command, then reports the child's wall time and ru_maxrss (os.wait4). A small launcher,
#: not this process: Linux carries the pre-exec memory of the forking process into the child's ru_maxrss.
LAUNCHER = ("import json, os, sys, time\n"
            "start = time.perf_counter()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.execv(sys.argv[2], sys.argv[2:])\n"
            "_, status, usage = os.wait4(pid, 0)\n"
            "seconds = time.perf_counter() - start\n"
            "open(sys.argv[1], 'w').write(json.dumps([os.waitstatus_to_exitcode(status), seconds, usage.ru_maxrss]))\n")


def measured(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `cmd` run in a fresh process, imports included."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "usage.json"
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(report), *cmd], env=env, capture_output=True,
                              text=True)
        code, seconds, maxrss_kib = json.loads(report.read_text()) if report.is_file() else (proc.returncode, 0, 0)
    if code != 0 or proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return seconds, maxrss_kib * 1024  # Linux reports KiB


def ours_cmd(ckpt: Path, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "hf_unified_ckpt", "convert", str(ckpt), str(out), "--quiet", *extra]


def theirs_cmd(ckpt: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out), "--safe_serialization"]


def fsync_seconds(folder: Path) -> float:
    """Time to fsync every file zero_to_fp32 wrote (our figure includes fsync, theirs does not)."""
    start = time.perf_counter()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - start


def import_floor() -> dict[str, tuple[float, int]]:
    """(seconds, peak RSS) of a fresh interpreter that only imports what each command imports."""
    py = sys.executable
    return {"ours": measured([py, "-c", "import hf_unified_ckpt.tools.cli, hf_unified_ckpt.tools.convert"]),
            "theirs": measured([py, "-c", "import deepspeed.utils.zero_to_fp32, safetensors.torch"])}


# ---- one configuration ----------------------------------------------------------------------------------------------
def bench_config(ckpt: Path, scratch: Path, reps: int, ours_args: tuple[str, ...] = ()) -> dict:
    """Alternates ours / theirs `reps` times on `ckpt`; the last outputs are kept for the weight comparison."""
    r = {"ours": [], "theirs": [], "ours_rss": [], "theirs_rss": [], "theirs_fsync": []}
    cmds = {"ours": lambda c, d: ours_cmd(c, d, ours_args), "theirs": theirs_cmd}
    for rep in range(reps):
        for kind in (("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours")):
            dest = scratch / f"{kind}-{rep}"
            seconds, rss = measured(cmds[kind](ckpt, dest))
            r[kind].append(seconds)
            r[f"{kind}_rss"].append(rss)
            r[f"{kind}_bytes"] = folder_bytes(dest)
            if kind == "theirs":
                r["theirs_fsync"].append(fsync_seconds(dest))
            if rep < reps - 1:
                shutil.rmtree(dest)
    r["weights_equal"], r["compared"] = weights_equal(scratch / f"ours-{reps - 1}", scratch / f"theirs-{reps - 1}")
    return r


def weights_equal(ours: Path, theirs: Path) -> tuple[bool, str]:
    """torch.equal of every tensor: our fp32 model files (or fp32 master weights under bf16) vs zero_to_fp32's."""
    from safetensors.torch import load_file

    stem = "master_weights" if any(ours.glob("master_weights*.safetensors")) else "model"
    a, b = {}, {}
    for f in ours.glob(f"{stem}*.safetensors"):
        a.update(load_file(str(f)))
    for f in theirs.glob("model*.safetensors"):
        b.update(load_file(str(f)))
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b), stem


# ---- report ---------------------------------------------------------------------------------------------------------
def summarize(name: str, r: dict) -> dict:
    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
    return {"config": name, "time_ratio": med["ours"] / med["theirs"], "rss_ratio": med["ours_rss"] / med["theirs_rss"],
            "ours_s": med["ours"], "theirs_s": med["theirs"], "theirs_fsync_s": med["theirs_fsync"],
            "ours_rss_mib": med["ours_rss"] / MiB, "theirs_rss_mib": med["theirs_rss"] / MiB,
            "ours_bytes": r["ours_bytes"], "theirs_bytes": r["theirs_bytes"], "weights_equal": r["weights_equal"],
            "compared": r["compared"], "raw": {k: [round(x, 3) for x in r[k]] for k in ("ours", "theirs")}}


#: Table columns: (heading, width, value of a summarized row).
COLUMNS = [
    ("config", 12, lambda x: x["config"]),
    ("ours s", 8, lambda x: f"{x['ours_s']:.2f}"),
    ("z2fp32 s", 10, lambda x: f"{x['theirs_s']:.2f}"),
    ("time ratio", 12, lambda x: f"{x['time_ratio']:.2f}"),
    ("ours MiB", 10, lambda x: f"{x['ours_rss_mib']:.0f}"),
    ("z2fp32 MiB", 12, lambda x: f"{x['theirs_rss_mib']:.0f}"),
    ("RSS ratio", 11, lambda x: f"{x['rss_ratio']:.2f}"),
    ("ours GB", 9, lambda x: f"{x['ours_bytes'] / 1e9:.2f}"),
    ("z2fp32 GB", 11, lambda x: f"{x['theirs_bytes'] / 1e9:.2f}"),
    ("ours GB/s", 11, lambda x: f"{x['ours_bytes'] / 1e9 / x['ours_s']:.2f}"),
    ("z2fp32 GB/s", 13, lambda x: f"{x['theirs_bytes'] / 1e9 / x['theirs_s']:.2f}"),
    ("+fsync s", 10, lambda x: f"{x['theirs_fsync_s']:.2f}"),
]


def print_table(rows: list[dict], reps: int, floor: dict, ours_args: str) -> None:
    print(f"\nhf-unified-ckpt convert --quiet {ours_args + ' ' if ours_args else ''}vs deepspeed zero_to_fp32 "
          "--safe_serialization (z2fp32), legacy DeepSpeed checkpoint\nof the ~103M Llama saved at 2 ranks, medians "
          f"of {reps} alternating repetitions, each command in a fresh process (imports included)")
    head = "".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w, _) in enumerate(COLUMNS))
    print(head + "\n" + "-" * len(head))
    for x in rows:
        print("".join(f"{f(x):<{w}}" if i == 0 else f"{f(x):>{w}}" for i, (_, w, f) in enumerate(COLUMNS)))
    for x in rows:
        print(f"weights equal: {x['weights_equal']}  ({x['config']}: our {x['compared']} files vs zero_to_fp32's "
              "model.safetensors, torch.equal per tensor)")
    print("targets: time ratio <= 1.0, RSS ratio <= 0.5. Conservative for us on time: ours writes model + optimizer "
          "state\n(+ fp32 master weights under bf16), durably (direct I/O + fsync), with the CRC-32 of every byte; "
          "zero_to_fp32 writes only\nthe fp32 weights and does not fsync (+fsync s: the fsync of its output "
          "afterwards, not in its time).")
    print(f"import-only floor (fresh interpreter): ours {floor['ours'][0]:.2f} s / {floor['ours'][1] / MiB:.0f} MiB, "
          f"zero_to_fp32 {floor['theirs'][0]:.2f} s / {floor['theirs'][1] / MiB:.0f} MiB")
    print(f"raw seconds: {json.dumps({x['config']: x['raw'] for x in rows})}")


def chart(path: Path, rows: list[dict], reps: int) -> None:
    ratios = [(f"{x['config']}: {label}", x[key]) for x in rows
              for label, key in (("time ours/zero_to_fp32 (<= 1.0)", "time_ratio"),
                                 ("peak RSS ours/zero_to_fp32 (<= 0.5)", "rss_ratio"))]
    draw_chart(path, ratios, f"bench_convert.py: convert vs zero_to_fp32\n~103M Llama, 2-rank legacy checkpoint, "
                             f"--reps {reps}")
    print(f"chart of these ratios: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", choices=[1, 2, 3], default=[2, 3])
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print the ratios as one JSON object")
    parser.add_argument("--chart", type=Path, default=None, metavar="PATH", help="also draw the ratios as a PNG")
    parser.add_argument("--out", default=None, help="scratch folder (default: a new one under /tmp), removed after")
    parser.add_argument("--ours-args", default="", metavar="ARGS",
                        help='extra arguments of our convert, e.g. --ours-args="--max-shard-size 100MB"')
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out or f"/tmp/hf_unified_ckpt_bench_convert_{os.getpid()}")
    if args.worker:
        return train_worker(out, args.stage, args.dtype)
    out.mkdir(parents=True, exist_ok=True)
    try:
        run(args, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(args: argparse.Namespace, out: Path) -> None:
    rows = []
    for stage in args.stages:
        for dtype in args.dtypes:
            name = f"zero{stage}-{dtype}"
            ckpt = make_legacy(out / name / "legacy", stage, dtype)
            print(f"{name}: legacy checkpoint {folder_bytes(ckpt) / 1e9:.2f} GB at {ckpt}", flush=True)
            rows.append(summarize(name, bench_config(ckpt, out / name, args.reps, tuple(args.ours_args.split()))))
            shutil.rmtree(out / name)
    print_table(rows, args.reps, import_floor(), args.ours_args)
    if args.json:
        print(json.dumps({x["config"]: {k: x[k] for k in ("time_ratio", "rss_ratio", "weights_equal")} for x in rows}))
    if args.chart:
        chart(args.chart, rows, args.reps)


if __name__ == "__main__":
    main()
