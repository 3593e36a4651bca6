"""Checkpoint compression benchmark: bytes per parameter and loss effect of O0/O1/O2 x master-weight modes, on real
checkpoints of a real (small) training run.

    python bench/bench_compression.py [--json PATH] [--out DIR] [--keep]

Launches itself under `torchrun --standalone --nproc_per_node 2` (DeepSpeed ZeRO-2, bf16 mixed precision, CPU,
gloo; DeepSpeed's JIT op build off; 1 intra-op thread per rank so runs are deterministic and comparable) and runs
every Trainer run in that one launch. The model is a ~4M-parameter Llama built from a LlamaConfig (no downloads);
the data are sequences of a fixed random Markov chain whose token frequencies follow a Zipf law and whose rows are
Zipf-weighted over a few preferred successors, so the loss really falls; the eval set is held-out sequences of the
same chain. AdamW (betas 0.9/0.95, lr 1e-3, 10 warm-up steps then cosine decay over 300 steps, weight decay 0.01),
global batch 16 (8 per rank), sequence length 64, 300 steps.

For each of the 9 configurations (ckpt_quant_stage O0/O1/O2 x master weights kept / `residual_master_weight` /
`remove_master_weight`): train with the 300-step schedule, save at step 150 only and stop, then resume from
checkpoint-150 with the same options to step 300 (a save at 300), logging the training loss at every step and
evaluating at 300. Then, for O0/O1/O2 with master weights kept, a lineage of five restores in a row (150, 180, 210,
240, 270: each hop a separate `trainer.train(resume_from_checkpoint=...)` that saves at the next 30-step mark and
stops) to 300. Prints one table, the targets and PASS/FAIL:

  (1) bytes per parameter (model + master + optimizer files of checkpoint-150, from `hf-unified-ckpt info`)
        O1+kept <= 8.1, O1+residual <= 6.1, O2+residual <= 5.1, O2+removed <= 3.1
  (2) loss effect of one restore vs the O0+kept resume (largest relative deviation of the training loss over
      steps 151-300; relative deviation of the final eval loss)
        O0+residual bit-exact vs O0+kept (losses, eval loss, checkpoint-300 model files, fp32 master weights and
        Adam moments); O1 final eval loss within 0.1%; O2 within 0.5%
  (3) lineage: five restores vs one; the O0 lineage must be bit-exact with the single O0 resume, and the O1/O2
      lineages must stay within the same eval-loss targets (the error does not compound)

Total runtime about 13 minutes on a 2-core CPU machine (measured: 793 s alone, 1000 s beside the test suite). The scratch folder (default: a new one
under /tmp, about 1.5 GB of checkpoints) is removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

STAGES = ("O0", "O1", "O2")
MASTER_MODES = {"kept": "", "residual": "residual_master_weight", "removed": "remove_master_weight"}
CONFIGS = [(s, m) for s in STAGES for m in MASTER_MODES]

# Model, data and optimisation (the module docstring describes them).
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 2048, 256, 688, 4, 4, 2
SEQ_LEN, GLOBAL_BATCH, WORLD = 64, 16, 2
LR, WARMUP, WEIGHT_DECAY, BETAS = 1e-3, 10, 0.01, (0.9, 0.95)
N_EVAL = 256
ZIPF_UNIGRAM, ZIPF_SUCCESSORS, SUCCESSORS, FOLLOW = 1.1, 1.0, 16, 0.7
LINEAGE_HOPS = 5

BYTES_TARGETS = {("O1", "kept"): 8.1, ("O1", "residual"): 6.1, ("O2", "residual"): 5.1, ("O2", "removed"): 3.1}
EVAL_TARGETS = {"O1": 1e-3, "O2": 5e-3}  # relative deviation of the final eval loss vs the O0 resume


# ----------------------------------------------------------------------------------------------------------------
# Worker side (runs under torchrun, 2 ranks)
# ----------------------------------------------------------------------------------------------------------------

def pin_threads() -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def reset_accelerate_state() -> None:
    """Several Trainer runs in one process (DESIGN.md section 5)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    pin_threads()
    AcceleratorState._reset_state(reset_partial_state=False)
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        os.environ.pop(var, None)
    unset_hf_deepspeed_config()


def zero2_config() -> dict:
    return {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}


def markov_chain(seed: int = 1234):
    """Transition matrix (VOCAB x VOCAB) of a fixed random Markov chain: from each token, with probability FOLLOW one
    of SUCCESSORS preferred next tokens (drawn by unigram frequency, Zipf-weighted), else a token of the global Zipf
    unigram law. Token id = frequency rank. Returns (transition matrix, unigram law)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    unigram = torch.arange(1, VOCAB + 1, dtype=torch.float64) ** -ZIPF_UNIGRAM
    unigram /= unigram.sum()
    successors = torch.multinomial(unigram.expand(VOCAB, VOCAB), SUCCESSORS, replacement=False, generator=g)
    weights = torch.arange(1, SUCCESSORS + 1, dtype=torch.float64) ** -ZIPF_SUCCESSORS
    weights /= weights.sum()
    preferred = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    preferred.scatter_(1, successors, weights.expand(VOCAB, SUCCESSORS).contiguous())
    return FOLLOW * preferred + (1 - FOLLOW) * unigram, unigram


def entropy_rate(transition, unigram) -> float:
    """Nats per token of the chain in its stationary law: the lowest loss a model can reach (for reference)."""
    pi = unigram.clone()
    for _ in range(200):
        pi = pi @ transition
    row_entropy = -(transition * transition.clamp_min(1e-300).log()).sum(1)
    return float(pi @ row_entropy)


def sample_sequences(transition, unigram, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, SEQ_LEN, dtype=torch.long)
    out[:, 0] = torch.multinomial(unigram, n, replacement=True, generator=g)
    for t in range(1, SEQ_LEN):
        out[:, t] = torch.multinomial(transition[out[:, t - 1]], 1, generator=g).squeeze(1)
    return out


class TokenDataset:
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        import torch

        return {"input_ids": self.data[i], "labels": self.data[i].clone(),
                "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long)}


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def stop_after_save(step: int):
    """A TrainerCallback that has the Trainer save at step `step` and stop training right after that save."""
    from transformers import TrainerCallback

    class _StopAfterSave(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_save = True  # the Trainer saves first, then leaves the loop
                control.should_training_stop = True

    return _StopAfterSave()


def make_trainer(output_dir: Path, stage: str, mode: str, steps: int, save_steps: int, train_ds, eval_ds):
    import deepspeed
    import torch
    from transformers import Trainer

    import hf_unified_ckpt

    reset_accelerate_state()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build (DESIGN.md section 5)
    args = hf_unified_ckpt.UnifiedCheckpointArguments(
        output_dir=str(output_dir), per_device_train_batch_size=GLOBAL_BATCH // WORLD, per_device_eval_batch_size=32,
        gradient_accumulation_steps=1, max_steps=steps, save_strategy="steps", save_steps=save_steps,
        logging_steps=1, learning_rate=LR, warmup_steps=WARMUP, lr_scheduler_type="cosine",
        weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1], optim="adamw_torch", bf16=True,
        deepspeed=zero2_config(), use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0, save_only_model=False, unified_checkpoint=True,
        unified_checkpoint_config=MASTER_MODES[mode], ckpt_quant_stage=stage)
    trainer = Trainer(model=build_model(), args=args, train_dataset=train_ds, eval_dataset=eval_ds)
    hf_unified_ckpt.attach(trainer)
    assert torch.get_num_threads() == 1, "something changed the thread count"
    return trainer


def losses_of(trainer) -> dict[int, float]:
    return {int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h}


def fp32_state_digest(trainer) -> str:
    """sha256 of the full fp32 master weights and Adam moments of every parameter, by DeepSpeed's own accessors.
    Collective (all ranks call it); the same digest on every rank."""
    from accelerate.utils import extract_model_from_parallel
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = trainer.model_wrapped.optimizer
    if hasattr(zero, "_hp_optimizer_states_linked"):  # DeepSpeed 0.19 links only the first group after step 1
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    h = hashlib.sha256()
    for name, p in extract_model_from_parallel(trainer.model_wrapped).named_parameters():
        if not p.requires_grad:
            continue
        tensors = [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in ("exp_avg",
                                                                                                "exp_avg_sq")]
        h.update(name.encode())
        for t in tensors:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_files_digest(folder: Path) -> str:
    """sha256 of the tensors (by name) of a checkpoint's model*.safetensors files."""
    import torch
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def saved_stage(folder: Path) -> str:
    manifest = json.loads((folder / "unified_checkpoint.json").read_text())
    return manifest.get("options", {}).get("ckpt_quant_stage", "?")


def worker(out: Path, steps: int) -> None:
    import torch.distributed as dist

    from hf_unified_ckpt.tools.cli import _info

    pin_threads()
    half, hop = steps // 2, steps // 10
    transition, unigram = markov_chain()
    train_ds = TokenDataset(sample_sequences(transition, unigram, steps * GLOBAL_BATCH, seed=1))
    eval_ds = TokenDataset(sample_sequences(transition, unigram, N_EVAL, seed=2))
    results = {"steps": steps, "entropy_rate": entropy_rate(transition, unigram), "runs": {}, "lineage": {},
               "timings": {}}
    t_all = time.perf_counter()
    rank = None

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[bench] {time.perf_counter() - t_all:7.1f}s {msg}", flush=True)

    # (1)+(2): each configuration saves at `half` and stops, then resumes to `steps`.
    for stage, mode in CONFIGS:
        name = f"{stage}-{mode}"
        folder = out / name
        t0 = time.perf_counter()
        trainer = make_trainer(folder, stage, mode, steps, half, train_ds, eval_ds)
        rank = dist.get_rank()
        trainer.add_callback(stop_after_save(half))
        trainer.train()
        first = losses_of(trainer)
        t1 = time.perf_counter()
        trainer = make_trainer(folder, stage, mode, steps, half, train_ds, eval_ds)
        trainer.train(resume_from_checkpoint=str(folder / f"checkpoint-{half}"))
        assert trainer.state.global_step == steps, trainer.state.global_step
        eval_loss = trainer.evaluate()["eval_loss"]
        digest = fp32_state_digest(trainer)
        t2 = time.perf_counter()
        if rank == 0:
            ckpt = folder / f"checkpoint-{half}"
            info = _info(str(ckpt))
            results["runs"][name] = {
                "stage": stage, "mode": mode, "first_half_losses": first, "losses": losses_of(trainer),
                "eval_loss": eval_loss, "fp32_digest": digest,
                "model_digest_final": model_files_digest(folder / f"checkpoint-{steps}"),
                "saved_stage": saved_stage(ckpt), "parameters": info["parameters"],
                "bytes_per_parameter": info["bytes_per_parameter"],
                "components": {k: {"bytes": v["bytes"], "files": v["files"], "codec": v.get("codec")}
                               for k, v in info["components"].items()},
                "seconds_first": t1 - t0, "seconds_resume": t2 - t1}
            log(f"{name}: eval loss {eval_loss:.6f}, {info['bytes_per_parameter']['all']:.3f} B/param, "
                f"{t2 - t0:.0f}s")
        dist.barrier()

    # (3): lineages of five restores, from the kept-master checkpoint at `half` of each stage.
    for stage in STAGES:
        name = f"{stage}-kept"
        folder = out / f"lineage-{stage}"
        t0 = time.perf_counter()
        resume = out / name / f"checkpoint-{half}"
        losses, hops = {}, []
        for k in range(LINEAGE_HOPS):
            start = half + k * hop
            trainer = make_trainer(folder, stage, "kept", steps, hop, train_ds, eval_ds)
            if k < LINEAGE_HOPS - 1:
                trainer.add_callback(stop_after_save(start + hop))
            trainer.train(resume_from_checkpoint=str(resume))
            end = trainer.state.global_step
            assert end == (start + hop if k < LINEAGE_HOPS - 1 else steps), (k, end)
            losses.update({s: v for s, v in losses_of(trainer).items() if s > start})
            if rank == 0:
                hops.append({"restored_at": start, "restored_stage": saved_stage(resume), "trained_to": end})
            resume = folder / f"checkpoint-{end}"
        eval_loss = trainer.evaluate()["eval_loss"]
        digest = fp32_state_digest(trainer)
        if rank == 0:
            results["lineage"][stage] = {"losses": losses, "eval_loss": eval_loss, "fp32_digest": digest,
                                         "model_digest_final": model_files_digest(folder / f"checkpoint-{steps}"),
                                         "hops": hops, "final_saved_stage": saved_stage(folder / f"checkpoint-{steps}"),
                                         "seconds": time.perf_counter() - t0}
            log(f"lineage {stage}: eval loss {eval_loss:.6f}, restores from "
                f"{[(h['restored_at'], h['restored_stage']) for h in hops]}, {time.perf_counter() - t0:.0f}s")
        dist.barrier()

    if rank == 0:
        results["timings"]["worker_seconds"] = time.perf_counter() - t_all
        (out / "raw_results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Launcher side: figures, table, JSON
# ----------------------------------------------------------------------------------------------------------------

def rel_dev(losses: dict, ref: dict, lo: int, hi: int) -> float:
    return max(abs(losses[str(s)] - ref[str(s)]) / abs(ref[str(s)]) for s in range(lo, hi + 1))


def figures(raw: dict) -> dict:
    steps = raw["steps"]
    half = steps // 2
    runs, lineage = raw["runs"], raw["lineage"]
    ref = runs["O0-kept"]
    first_ref = ref["first_half_losses"]
    table = {}
    for stage, mode in CONFIGS:
        r = runs[f"{stage}-{mode}"]
        bpp = r["bytes_per_parameter"]
        parts = {k: bpp.get(k, 0.0) for k in ("model", "master_weights", "optimizer")}
        same_stage_kept = runs[f"{stage}-kept"]
        table[f"{stage}-{mode}"] = {
            "stage": stage, "mode": mode, "saved_stage_at_half": r["saved_stage"],
            "bytes_per_parameter": {**parts, "total": sum(parts.values())},
            "max_rel_dev_train_loss": rel_dev(r["losses"], ref["losses"], half + 1, steps),
            "rel_dev_eval_loss": abs(r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"],
            "eval_loss": r["eval_loss"],
            "first_half_identical_to_O0_kept": all(r["first_half_losses"][str(s)] == first_ref[str(s)]
                                                   for s in range(1, half + 1)),
            "bit_exact_vs_O0_kept": _bit_exact(r, ref, half, steps),
            "bit_exact_vs_same_stage_kept": _bit_exact(r, same_stage_kept, half, steps),
        }
    lin = {}
    for stage, r in lineage.items():
        single = runs[f"{stage}-kept"]
        lin[stage] = {
            "restores": [(h["restored_at"], h["restored_stage"]) for h in r["hops"]],
            "final_saved_stage": r["final_saved_stage"],
            "max_rel_dev_train_loss": rel_dev(r["losses"], ref["losses"], half + 1, steps),
            "rel_dev_eval_loss": abs(r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"],
            "single_restore_max_rel_dev_train_loss": table[f"{stage}-kept"]["max_rel_dev_train_loss"],
            "single_restore_rel_dev_eval_loss": table[f"{stage}-kept"]["rel_dev_eval_loss"],
            "eval_loss": r["eval_loss"],
            "bit_exact_vs_single_restore": _bit_exact(r, single, half, steps),
        }
    checks = []
    for (stage, mode), target in BYTES_TARGETS.items():
        value = table[f"{stage}-{mode}"]["bytes_per_parameter"]["total"]
        checks.append({"what": f"bytes/param {stage}+{mode}", "value": value, "target": f"<= {target}",
                       "pass": value <= target})
    exact = table["O0-residual"]["bit_exact_vs_O0_kept"]
    checks.append({"what": "O0+residual resume bit-exact vs O0+kept", "value": exact, "target": "bit-exact",
                   "pass": exact})
    for stage, target in EVAL_TARGETS.items():
        for mode in MASTER_MODES:
            value = table[f"{stage}-{mode}"]["rel_dev_eval_loss"]
            checks.append({"what": f"final eval loss {stage}+{mode} vs O0+kept", "value": value,
                           "target": f"<= {target:.1%}", "pass": value <= target})
    checks.append({"what": "O0 lineage (5 restores) bit-exact vs single O0 resume",
                   "value": lin["O0"]["bit_exact_vs_single_restore"], "target": "bit-exact",
                   "pass": lin["O0"]["bit_exact_vs_single_restore"]})
    for stage, target in EVAL_TARGETS.items():
        value = lin[stage]["rel_dev_eval_loss"]
        checks.append({"what": f"final eval loss {stage} lineage (5 restores) vs O0+kept", "value": value,
                       "target": f"<= {target:.1%}", "pass": value <= target})
    losses = ref["first_half_losses"] | ref["losses"]
    return {"steps": steps, "parameters": ref["parameters"], "entropy_rate": raw["entropy_rate"],
            "loss_start": losses["1"], "loss_end": losses[str(steps)], "eval_loss_O0": ref["eval_loss"],
            "configs": table, "lineage": lin, "checks": checks,
            "all_pass": all(c["pass"] for c in checks)}


def _bit_exact(a: dict, b: dict, half: int, steps: int) -> bool:
    return (all(a["losses"][str(s)] == b["losses"][str(s)] for s in range(half + 1, steps + 1))
            and a["eval_loss"] == b["eval_loss"] and a["fp32_digest"] == b["fp32_digest"]
            and a["model_digest_final"] == b["model_digest_final"])


def print_table(f: dict, command: str, seconds: float) -> None:
    steps, half = f["steps"], f["steps"] // 2
    yn = {True: "yes", False: "no"}
    print(f"\nCheckpoint compression, DeepSpeed ZeRO-2 bf16 x 2 ranks (CPU, gloo, 1 thread/rank), Llama "
          f"{f['parameters'] / 1e6:.2f}M params, AdamW betas {BETAS}, lr {LR} warmup {WARMUP} + cosine, "
          f"{steps} steps, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens")
    print(f"training loss {f['loss_start']:.3f} (step 1) -> {f['loss_end']:.3f} (step {steps}); eval loss at "
          f"{steps} (O0+kept) {f['eval_loss_O0']:.4f}; entropy rate of the data {f['entropy_rate']:.3f} nats")
    print(f"\n(1)+(2) one restore at step {half} (checkpoint-{half}), resumed to {steps}; deviations vs the "
          f"O0+kept resume")
    print(f"{'config':<14}{'saved':>6}{'model':>8}{'master':>8}{'optim':>8}{'total B/p':>11}"
          f"{'max rel dev train loss':>24}{'rel dev eval':>14}{'eval loss':>11}{'bit-exact vs O0':>17}"
          f"{'vs same-stage kept':>20}")
    for name, c in f["configs"].items():
        b = c["bytes_per_parameter"]
        print(f"{c['stage'] + '+' + c['mode']:<14}{c['saved_stage_at_half']:>6}{b['model']:>8.3f}"
              f"{b['master_weights']:>8.3f}{b['optimizer']:>8.3f}{b['total']:>11.3f}"
              f"{c['max_rel_dev_train_loss']:>24.2e}{c['rel_dev_eval_loss']:>14.2e}{c['eval_loss']:>11.6f}"
              f"{yn[c['bit_exact_vs_O0_kept']]:>17}{yn[c['bit_exact_vs_same_stage_kept']]:>20}")
    ident = all(c["first_half_identical_to_O0_kept"] for c in f["configs"].values())
    print(f"steps 1-{half} identical in all 9 runs (saving does not change training): {yn[ident]}")
    print(f"\n(3) lineage, master kept: restores (step, stage of the checkpoint restored) vs one restore at {half}")
    print(f"{'stage':<7}{'restores':<48}{'max rel dev train loss (5 / 1)':>32}{'rel dev eval (5 / 1)':>24}"
          f"{'bit-exact vs 1 restore':>24}")
    for stage, c in f["lineage"].items():
        restores = " ".join(f"{s}:{st}" for s, st in c["restores"])
        print(f"{stage:<7}{restores:<48}{c['max_rel_dev_train_loss']:>15.2e} / "
              f"{c['single_restore_max_rel_dev_train_loss']:<14.2e}{c['rel_dev_eval_loss']:>11.2e} / "
              f"{c['single_restore_rel_dev_eval_loss']:<10.2e}{yn[c['bit_exact_vs_single_restore']]:>24}")
    o0res = f["configs"]["O0-residual"]["bit_exact_vs_O0_kept"]
    print(f"\nbit-exact: {yn[o0res]} (O0+residual resume vs O0+kept resume: losses {half + 1}-{steps}, eval loss, "
          f"checkpoint-{steps} model files, fp32 master weights and Adam moments)")
    print("\ntargets")
    for c in f["checks"]:
        v = c["value"]
        shown = yn[v] if isinstance(v, bool) else (f"{v:.3f}" if "bytes" in c["what"] else f"{v:.2e} ({v:.4%})")
        print(f"  {c['what']:<58}{shown:>20}   target {c['target']:<10} {'PASS' if c['pass'] else 'FAIL'}")
    print(f"\nall targets: {'PASS' if f['all_pass'] else 'FAIL'}; total runtime {seconds:.0f} s")
    print(f"command: {command}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the figures, targets and PASS/FAIL to this file")
    parser.add_argument("--out", default=None, help="scratch folder (default: a new one under /tmp), removed after")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (checkpoints, raw results)")
    parser.add_argument("--steps", type=int, default=300,
                        help="training steps (default 300; the targets assume 300, smaller is for a smoke test only; "
                             "a multiple of 20)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps % 20:
        parser.error("--steps must be a multiple of 20")
    out = Path(args.out or f"/tmp/hf_unified_ckpt_bench_compression_{os.getpid()}")
    if args.worker:
        return worker(out, args.steps)
    command = shlex.join([sys.executable, *sys.argv])
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--steps", str(args.steps)]
        tail: deque[str] = deque(maxlen=200)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            tail.append(line)
            if line.startswith("[bench]"):
                print(line, end="", flush=True)
        if proc.wait() != 0:
            sys.exit(f"benchmark launch failed (rc {proc.returncode}):\n{''.join(tail)}")
        seconds = time.perf_counter() - start
        f = figures(json.loads((out / "raw_results.json").read_text()))
        f.update({"command": command, "runtime_seconds": seconds, "targets_assume_steps": 300})
        print_table(f, command, seconds)
        if args.json:
            Path(args.json).write_text(json.dumps(f, indent=1))
    finally:
        if args.keep:
            print(f"kept {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
