"""Resume from a checkpoint spread over machine-local folders vs. the same checkpoint in one shared folder.

    python bench/bench_multi_machine.py [--reps 5] [--out DIR]

Simulates 2 machines on this host (one torchrun per machine, static rendezvous on 127.0.0.1, 1 process each),
DeepSpeed ZeRO-2, fp32, the ~103M Llama of bench_save.py. One unified save with a local folder per machine
(each machine holds its own share of the tensor files), then a copy of the union into a folder both machines
see. Then, alternating per repetition, the whole unified resume path from each (union check across machines,
copy of the small files, verification of every file, load into the DeepSpeed engine). Prints medians:

  resume time, machine-local folders / one shared folder
  bytes a rank read from the other machine / bytes of the checkpoint
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_save import build_trainer, folder_bytes, max_over_ranks, timed  # noqa: E402


def worker(out: Path, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from hf_unified_ckpt.checkpoint.load import file_service
    from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine
    from hf_unified_ckpt.checkpoint.load.loading import fetch_small_files, load_checkpoint, verify_checkpoint
    from hf_unified_ckpt.checkpoint.load.placement import judge_path, placement_of

    machine = int(os.environ["GROUP_RANK"])
    trainer = build_trainer(out / f"machine{machine}", "fp32", 2)
    trainer._save_checkpoint(trainer.model, None)
    local = out / f"machine{machine}" / "checkpoint-1"
    shared = out / "shared" / "checkpoint-1"
    dist.barrier()
    if dist.get_rank() == 0:
        for k in range(2):
            shutil.copytree(out / f"machine{k}" / "checkpoint-1", shared, dirs_exist_ok=True)
        print(f"machine 0 holds {folder_bytes(out / 'machine0' / 'checkpoint-1') / 1e6:.0f} MB, machine 1 "
              f"{folder_bytes(out / 'machine1' / 'checkpoint-1') / 1e6:.0f} MB, the union "
              f"{folder_bytes(shared) / 1e6:.0f} MB", flush=True)
    dist.barrier()

    received = [0]
    ask = file_service.FileService._ask

    def counting_ask(self, file, request):
        reply, data = ask(self, file, request)
        received[0] += 0 if data is None else data.numel()
        return reply, data

    file_service.FileService._ask = counting_ask
    options = trainer.args.unified_checkpoint_options

    def resume(path: Path) -> None:
        verdict = judge_path(path)
        placement = fetch_small_files(path, verdict.manifest, placement_of(verdict))
        manifest = verify_checkpoint(path, placement=placement)
        load_checkpoint(path, DeepSpeedEngine(trainer.model_wrapped, "save"), manifest, options, placement=placement)

    times = {"local folders": [], "shared folder": []}
    for rep in range(reps):
        order = [("local folders", local), ("shared folder", shared)]
        for name, path in (order if rep % 2 == 0 else order[::-1]):
            received[0] = 0
            seconds, _ = timed(lambda: resume(path))
            times[name].append(max_over_ranks(seconds))
            if name == "local folders":
                remote = max_over_ranks(received[0])
    total = folder_bytes(shared)
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"resume, ZeRO-2 x 2 machines x 1 process, ~103M Llama fp32, medians of {reps} alternating repetitions:")
        print(f"  machine-local folders / shared folder = {med['local folders'] / med['shared folder']:.2f}   "
              f"({med['local folders']:.2f} s vs {med['shared folder']:.2f} s)")
        print(f"  bytes the busiest rank read from the other machine / checkpoint bytes = {remote / total:.2f}   "
              f"({remote / 1e6:.0f} MB of {total / 1e6:.0f} MB)")
        print(f"  raw figures: {times}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="scratch folder (default: a new one under /tmp), removed after")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out or f"/tmp/hf_unified_ckpt_bench_mm_{os.getpid()}")
    if args.worker:
        return worker(out, args.reps)
    out.mkdir(parents=True, exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={k}",
                                   "--nproc_per_node=1", "--rdzv_backend=static", "--master_addr=127.0.0.1",
                                   f"--master_port={port}", str(Path(__file__).resolve()), "--worker",
                                   "--reps", str(args.reps), "--out", str(out)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k in range(2)]
        outputs = [p.communicate() for p in procs]
        if any(p.returncode for p in procs):
            sys.exit("benchmark launch failed:\n" + "\n".join(o[0][-3000:] + o[1][-5000:] for o in outputs))
        print("\n".join(line for line in outputs[0][0].splitlines() if not line.startswith("{")))
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
