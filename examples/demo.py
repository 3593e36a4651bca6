"""The demo behind `make demo`: train on 2 processes with DeepSpeed ZeRO-2 (CPU, gloo) saving unified
checkpoints, resume from the middle on 1 process without DeepSpeed, check that the loss curve continues, then
load the checkpoint with `AutoModelForCausalLM.from_pretrained` and generate; the two loss curves are drawn in
OUT_DIR/loss_curves.png.   python examples/demo.py [OUT_DIR]"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [str(ROOT / "examples" / "train_tiny.py"), "--config", str(ROOT / "configs" / "tiny_llama.yaml")]
GLOBAL_BATCH = 8
RESUME_AT = 10
TOLERANCE = 1e-5  # relative: ZeRO-2 x 2 -> 1 process reorders fp32 gradient sums (~1e-7 measured)


def run(cmd: list[str], title: str) -> None:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        sys.exit(f"demo step failed: {title}")


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    ddp, single = out / "zero2_2proc", out / "resumed_1proc"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *TRAIN,
         "--ddp_backend", "gloo", "--deepspeed", str(ROOT / "configs" / "ds_zero2.json"),
         "--per_device_train_batch_size", str(GLOBAL_BATCH // 2),
         "--output_dir", str(ddp), "--losses_file", str(out / "zero2_losses.json")],
        "1. train 30 steps on 2 processes with DeepSpeed ZeRO-2, unified checkpoint every 10 steps")
    run([sys.executable, *TRAIN, "--per_device_train_batch_size", str(GLOBAL_BATCH),
         "--output_dir", str(single), "--resume_from_checkpoint", str(ddp / f"checkpoint-{RESUME_AT}"),
         "--losses_file", str(out / "resumed_losses.json")],
        f"2. resume checkpoint-{RESUME_AT} on 1 process without DeepSpeed (same global batch {GLOBAL_BATCH})")
    chart = plot_losses(out, compare(out))
    for ckpt in (ddp / f"checkpoint-{RESUME_AT}", single / "checkpoint-30"):
        cmd = [sys.executable, "-m", "hf_unified_ckpt", "info", str(ckpt)]
        print(f"\n=== 3. inspect\n$ hf-unified-ckpt info {ckpt}")
        print(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout, end="")
    generate(single / "checkpoint-30")
    print(f"\nEverything is under {out}/:\n  {ddp}/checkpoint-{{10,20,30}}   saved by DeepSpeed ZeRO-2 on 2 processes\n"
          f"  {single}/checkpoint-{{20,30}}  saved after resuming on 1 process\n"
          f"  {out}/*_losses.json           the two loss curves\n"
          f"  {chart}  the two loss curves drawn")


def compare(out: Path) -> float:
    """Prints both curves after the resume step side by side; returns the max relative difference."""
    full = json.loads((out / "zero2_losses.json").read_text())
    resumed = json.loads((out / "resumed_losses.json").read_text())
    print("\n step   ZeRO-2 x 2     resumed on 1   rel. diff")
    worst = 0.0
    for step in range(RESUME_AT + 1, 31):
        a, b = full[str(step)], resumed[str(step)]
        worst = max(worst, abs(a - b) / abs(a))
        print(f" {step:>4}   {a:11.6f}   {b:12.6f}   {abs(a - b) / abs(a):9.2e}")
    verdict = "continues exactly" if worst <= TOLERANCE else "DIVERGED"
    print(f"loss curve after resume {verdict}: max relative difference {worst:.2e} (tolerance {TOLERANCE:.0e})")
    if worst > TOLERANCE:
        sys.exit(1)
    return worst


def plot_losses(out: Path, worst: float) -> Path:
    """Draws the uninterrupted curve and the resumed one over it into out/loss_curves.png; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(*_curve(out / "zero2_losses.json"), "-", color="tab:blue", lw=3, alpha=0.5,
            label="uninterrupted: ZeRO-2, 2 processes")
    ax.plot(*_curve(out / "resumed_losses.json", after=RESUME_AT), "o--", color="tab:orange", ms=4, lw=1.2,
            label=f"resumed at step {RESUME_AT}: 1 process")
    ax.axvline(RESUME_AT, color="gray", ls=":", label=f"resume (checkpoint-{RESUME_AT})")
    ax.set(xlabel="step", ylabel="training loss",
           title=f"ZeRO-2 x 2 -> 1 process: loss after resume, max relative difference {worst:.1e}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "loss_curves.png"
    fig.savefig(path)
    plt.close(fig)
    print(f"loss curves drawn: {path}")
    return path


def _curve(losses_file: Path, after: int = 0) -> tuple[list[int], list[float]]:
    """(steps, losses) of a {step: loss} file, steps after `after` only (the resumed run's log also holds the
    steps before its checkpoint, copied from the checkpoint's trainer state)."""
    points = sorted((int(step), loss) for step, loss in json.loads(losses_file.read_text()).items())
    return [s for s, _ in points if s > after], [loss for s, loss in points if s > after]


def generate(checkpoint: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"=== 4. AutoModelForCausalLM.from_pretrained({checkpoint})")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "t5 t7 t9 t11 t13"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    print(f"prompt:    {prompt}\ngenerated: {tok.decode(out[0, ids.shape[1]:])}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "demo_output")
