"""S3 resume at a changed world size (issue 31): ranged reads vs download-then-load, and bytes fetched per rank.

    python bench/bench_s3_reshard.py [--reps 5] [--size 50m] [--nproc 2] [--json] [--out PATH]

LOOPBACK FIGURES against SeaweedFS on this machine (client and server share its CPU cores), not a per-node S3
figure. This script starts the server (tests/support/s3_server.py), saves a checkpoint of a plain stack of nn.Linear layers
(odd sizes, fp32, `--size` parameters) and AdamW after one step from ONE process into the bucket, then launches
`torchrun --nproc_per_node N` (gloo, CPU) where every rank builds the same model, shards it with FSDP2
(`fully_shard` per layer and at the root) and, per repetition, contenders alternating (each after a barrier and
`os.sync()`; time = the slowest rank, between barriers):

- direct: verify as a resume from a bucket does (`checked_on_read=True`: sizes, headers, small files' CRCs; tensor
  blocks checked as they are read) + `load_checkpoint` into the FSDP2 model and optimizer, straight from the
  bucket; every rank's fetched bytes counted (`S3Store.read` wrapped) against the bytes of its own shards
  (model parameters and optimizer state it holds after the load);
- download: rank 0 downloads the folder with s3fs (`get`, recursive, 16 MiB chunks, 4 in flight) into a local
  folder every rank sees, then every rank verifies (full, as a local resume does) and loads from it.

Prints (medians):  direct time / download-then-load time (expected < 1), the largest rank's bytes fetched / bytes
it holds (target <= 1.1), and the per-rank figures. The first load of each kind is checked against the saved
state (each rank's shards equal the saved tensors' rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

SIZES = {"20m": 5, "50m": 12, "100m": 24}  # layers of 2047 x 2039


def build(layers: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    dims = [2039 if i % 2 == 0 else 2047 for i in range(layers + 1)]
    model = torch.nn.Sequential(*[torch.nn.Linear(dims[i], dims[i + 1]) for i in range(layers)])
    return model


def one_step(model, opt):
    import torch

    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7))
    opt.step()
    opt.zero_grad()


def parent(args) -> dict:
    import torch

    from support.s3_server import SeaweedS3

    from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint
    from hf_unified_ckpt.engines.replicated import ReplicatedEngine
    from hf_unified_ckpt.options import parse_options

    with tempfile.TemporaryDirectory(prefix="bench-s3-reshard-") as tmp:
        server = SeaweedS3(Path(tmp) / "weed").start()
        try:
            os.environ.update(server.environment())
            bucket = server.make_bucket("reshard")
            model = build(SIZES[args.size])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            one_step(model, opt)
            final = f"{bucket}/run/checkpoint-1"
            save_checkpoint(ReplicatedEngine(model, opt), SaveRequest(final, 1, parse_options(unified_checkpoint=True),
                                                                     show_progress=False), {"trainer_state.json": b"{}"})
            torch.save(model.state_dict(), Path(tmp) / "expected.pt")
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   str(Path(__file__).resolve()), "--worker", "--size", args.size, "--reps", str(args.reps),
                   "--ckpt", final, "--tmp", tmp, "--out", str(out)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"worker launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
            return json.loads(out.read_text())
        finally:
            server.stop()


def worker(args) -> None:
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hf_unified_ckpt.checkpoint.load.loading import load_checkpoint, verify_checkpoint
    from hf_unified_ckpt.engines.fsdp import FSDPEngine
    from hf_unified_ckpt.options import parse_options
    from support.faulty_store import injected
    from hf_unified_ckpt.store import store_for

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    options = parse_options(unified_checkpoint=True)
    fetched = [0]

    def counting(call):  # a store hook (tests/support/faulty_store.py): every byte read from the bucket, counted
        data = call.proceed()
        if call.method == "read":
            fetched[0] += len(data)
        return data

    expected = torch.load(Path(args.tmp) / "expected.pt", weights_only=True)

    def fresh():
        model = build(SIZES[args.size], seed=99)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt

    def held(model, opt) -> int:
        local = sum(p.to_local().nbytes for p in model.parameters())
        for state in opt.state.values():
            local += sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                         for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return local

    def check(model) -> None:
        for name, p in model.state_dict().items():
            local, full = p.to_local(), expected[name]
            rows = local.shape[0]
            start = sum(-(-full.shape[0] // world) for _ in range(rank))  # FSDP2: even chunks along dim 0
            assert torch.equal(local, full[start:start + rows]), name

    local_dir = str(Path(args.tmp) / "download" / "checkpoint-1")
    times = {"direct": [], "download": []}
    per_rank = {"fetched": [], "held": []}
    with injected(counting, ref=args.ckpt):
        for rep in range(args.reps + 1):  # the first round is a warm-up (not counted)
            order = ["direct", "download"] if rep % 2 == 0 else ["download", "direct"]
            for who in order:
                model, opt = fresh()
                if rank == 0 and os.path.exists(os.path.dirname(local_dir)):
                    shutil.rmtree(os.path.dirname(local_dir))
                os.sync()
                dist.barrier()
                fetched[0] = 0
                start = time.perf_counter()
                if who == "direct":
                    manifest = verify_checkpoint(args.ckpt, checked_on_read=True)
                    load_checkpoint(args.ckpt, FSDPEngine(model, opt), manifest, options)
                else:
                    if rank == 0:
                        store = store_for(args.ckpt)
                        store.fs.get(store._key(args.ckpt) + "/", local_dir + "/", recursive=True,
                                     chunksize=16 * 2**20, max_concurrency=4)
                    dist.barrier()
                    manifest = verify_checkpoint(local_dir)
                    load_checkpoint(local_dir, FSDPEngine(model, opt), manifest, options)
                dist.barrier()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep == 0:
                    check(model)
                if rep > 0:
                    times[who].append(float(elapsed))
                    if who == "direct":
                        counts = [None] * world
                        dist.all_gather_object(counts, (fetched[0], held(model, opt)))
                        per_rank["fetched"].append([c[0] for c in counts])
                        per_rank["held"].append([c[1] for c in counts])
    if rank == 0:
        fetched_last, held_last = per_rank["fetched"][-1], per_rank["held"][-1]
        ratios = [f / h for f, h in zip(fetched_last, held_last)]
        result = {"bench": "s3_reshard", "loopback": True, "size": args.size, "nproc": world, "reps": args.reps,
                  "saved_by_world_size": 1, "engine": "fsdp2",
                  "medians_s": {k: statistics.median(v) for k, v in times.items()}, "raw_s": times,
                  "per_rank_bytes": {"fetched": fetched_last, "held": held_last},
                  "fetched_over_held": {"per_rank": ratios, "max": max(ratios), "target": 1.1,
                                        "met": max(ratios) <= 1.1}}
        result["direct_over_download"] = result["medians_s"]["direct"] / result["medians_s"]["download"]
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", choices=sorted(SIZES), default="50m")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--ckpt")
    parser.add_argument("--tmp")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    result = parent(args)
    print(f"LOOPBACK figures (SeaweedFS on this machine, {os.cpu_count()} CPU cores shared with the server), not a "
          f"per-node S3 figure. {args.size} fp32 + AdamW saved by 1 process, resumed by FSDP2 x {args.nproc}; "
          f"medians of {args.reps} alternating repetitions:")
    m = result["medians_s"]
    print(f"  resume straight from the bucket / download then resume locally = {result['direct_over_download']:.2f}"
          f"   ({m['direct']:.2f} s vs {m['download']:.2f} s)   expected < 1")
    f = result["fetched_over_held"]
    print(f"  bytes fetched / bytes held, per rank = {', '.join(f'{r:.3f}' for r in f['per_rank'])} (max "
          f"{f['max']:.3f})   target <= 1.1  {'met' if f['met'] else 'MISSED'}   (fetched "
          f"{[round(b / 1e6, 1) for b in result['per_rank_bytes']['fetched']]} MB, held "
          f"{[round(b / 1e6, 1) for b in result['per_rank_bytes']['held']]} MB)")
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
