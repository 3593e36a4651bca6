"""Runs described as dicts (`run_spec`): the format the launched workers (`workers/dist_worker.py`) read, with
the faults and recordings a spec can ask for.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .callbacks import KillPersister, PlantTies, RecordAt, RecordLossScaler, RecordWeights, stop_after_save
from .env import scoped_environ, disable_deepspeed_jit, fp16_on_cpu, fsdp_on_cpu, tp_on_cpu
from .faults import aggregation_fault, broken_rule, die_at_commit, die_mid_write, memory_full_from, slow_snapshot, unreadable_bytes
from .models import GLOBAL_BATCH, TokenDataset
from .records import record_aggregation, record_buffers, record_hand_overs, record_pieces, record_plans, record_reuse
from .states import assert_autotp, assert_sharded, assert_tensor_parallel, record
from .trainers import FP16_SCALER, fsdp_args, losses_of, make_trainer, zero_config


#: Aggregation forced on the tiny test models (whose files are far below the default ranges): ranges and buffers
#: of 8 KiB.
FORCED_AGGREGATION = {"unified_checkpoint_aggregate_range": "8KiB", "unified_checkpoint_aggregate_buffer": "8KiB"}


def spec_of(kinds: dict, tmp, kind: str, tag: str, resume: tuple[str, int] | None = None, **overrides) -> dict:
    """The run spec of a `kind` (its fields in `kinds`) writing into `tmp/tag` and its record into `tmp/tag.pt`,
    resumed from `tmp/<resume[0]>/checkpoint-<resume[1]>`, with extra TrainingArguments `overrides`."""
    spec = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kinds[kind].items()}
    spec["overrides"] = {**spec.get("overrides", {}), **overrides}
    spec.update(output_dir=str(tmp / tag), result=str(tmp / f"{tag}.pt"))
    if resume:
        spec["resume"] = str(tmp / resume[0] / f"checkpoint-{resume[1]}")
    return spec


def hop_tag(hop) -> str:
    """The tag of a resume hop (saved by, resumed as, world size)."""
    return f"{hop[0]}-to-{hop[1]}-at{hop[2]}"


def run_spec(run: dict, world_size: int) -> dict:
    """Execute one run described as a dict (the format the torchrun worker reads). "zero": N runs DeepSpeed
    ZeRO stage N; "slow_snapshot": seconds an async save's snapshot sleeps before it copies."""
    if run.get("slow_snapshot"):
        with slow_snapshot(run["slow_snapshot"]):
            return run_spec({k: v for k, v in run.items() if k != "slow_snapshot"}, world_size)
    if run.get("die_at_commit"):
        with die_at_commit(*run["die_at_commit"]):
            return run_spec({k: v for k, v in run.items() if k != "die_at_commit"}, world_size)
    if run.get("die_mid_write"):
        with die_mid_write(*run["die_mid_write"]):
            return run_spec({k: v for k, v in run.items() if k != "die_mid_write"}, world_size)
    if run.get("memory_full_from"):
        with memory_full_from(run["memory_full_from"]):
            return run_spec({k: v for k, v in run.items() if k != "memory_full_from"}, world_size)
    if run.get("record_reuse"):  # how many files the saves wrote over spare files (the memory tier's reuse)
        with record_reuse() as reused:
            return {**run_spec({k: v for k, v in run.items() if k != "record_reuse"}, world_size), "reused": reused}
    if run.get("record_buffers"):  # the snapshot's host buffers: made before the first save, then reused
        with record_buffers() as buffers:
            return {**run_spec({k: v for k, v in run.items() if k != "record_buffers"}, world_size),
                    "buffers": buffers}
    if run.get("record_plans"):  # each save's collectives, how its plan was made, the rule against what is held
        from hf_unified_ckpt import dist

        with record_plans() as saves:
            result = run_spec({k: v for k, v in run.items() if k != "record_plans"}, world_size)
        torch.save(saves, f"{run['result']}.rank{dist.rank()}")  # every rank's, for the bench's counts
        return {**result, "saves": saves}
    if run.get("record_hand_overs"):  # per file, the hand-over bytes this rank received and those the plan gives it
        from hf_unified_ckpt import dist

        with record_hand_overs() as files:
            result = run_spec({k: v for k, v in run.items() if k != "record_hand_overs"}, world_size)
        torch.save(files, f"{run['result']}.rank{dist.rank()}")
        return result
    if run.get("unreadable_bytes") is not None:  # this rank cannot produce its bytes of any file of a bucket save
        with unreadable_bytes(run["unreadable_bytes"]):
            return run_spec({k: v for k, v in run.items() if k != "unreadable_bytes"}, world_size)
    if run.get("break_rule"):  # an engine whose pieces are not its declared rule's (shifted by one element)
        with broken_rule():
            return run_spec({k: v for k, v in run.items() if k != "break_rule"}, world_size)
    if run.get("record_aggregation"):  # per save, the files aggregated, this rank's cells and its buffers' peak
        with record_aggregation() as saves:
            result = run_spec({k: v for k, v in run.items() if k != "record_aggregation"}, world_size)
        from hf_unified_ckpt import dist

        torch.save(saves, f"{run['result']}.aggregation.rank{dist.rank()}")
        return result
    if run.get("aggregation_fault"):  # [fault, rank, step]: a fault in an aggregated save; each rank's outcome
        return _with_aggregation_fault(run, world_size)
    if run.get("record_pieces"):  # which tensors each save writes in place, piece by piece (no assembling)
        with record_pieces() as pieces:
            return {**run_spec({k: v for k, v in run.items() if k != "record_pieces"}, world_size), "pieces": pieces}
    if run.get("env"):  # environment variables of this run only (e.g. accelerate's MoE leaf-module classes)
        with scoped_environ(run["env"]):
            return run_spec({k: v for k, v in run.items() if k != "env"}, world_size)
    overrides = dict(run.get("overrides", {}))
    model = run.get("model", "llama")
    if run.get("zero"):
        disable_deepspeed_jit()
        overrides["deepspeed"] = zero_config(run["zero"], **(FP16_SCALER if run.get("fp16") else {}))
    if run.get("autotp"):  # DeepSpeed AutoTP: the global batch is split over the data-parallel ranks only
        overrides["deepspeed"]["tensor_parallel"] = {"autotp_size": run["autotp"]}
        overrides["per_device_train_batch_size"] = GLOBAL_BATCH * run["autotp"] // world_size
    if run.get("fp16"):
        fp16_on_cpu()
        if run.get("forget_loss_scaler"):  # the control: a resume that leaves the scaler as configured
            from hf_unified_ckpt.engines.deepspeed import DeepSpeedEngine

            DeepSpeedEngine._restore_loss_scaler = lambda self, saved: None
    if run.get("fsdp"):
        overrides.update(fsdp_args(run["fsdp"], run.get("fsdp_state_dict_type", "SHARDED_STATE_DICT"), model))
    if run.get("eval"):  # evaluation every save, e.g. for load_best_model_at_end
        overrides["eval_dataset"] = TokenDataset(12, seed=7)
    shim = run.get("fsdp") and run.get("fsdp_shim", True)  # without it accelerate runs DDP on CPU, silently
    tp = tuple(run["tp"]) if run.get("tp") else None  # (tp_size, fsdp_size)
    with fsdp_on_cpu() if shim else tp_on_cpu() if tp else contextlib.nullcontext():
        trainer = make_trainer(run["output_dir"], model, world_size, run.get("optim", "adamw_torch"),
                               tp=tp, **overrides)
        if run.get("expect_error"):
            return _refused(trainer, run.get("resume"), run["expect_error"])
        if run.get("fused_keys"):  # what the plugin wrote before conversions were handled: the run-time names
            trainer._uc_session.conversion = None
        if run.get("plant_ties"):  # before RecordAt: what is recorded (and saved) at that step holds the ties
            PlantTies(trainer, run["plant_ties"])
        at = RecordAt(trainer, run["record_at"]) if run.get("record_at") else None
        every = RecordWeights(trainer) if run.get("record_weights") else None
        scaler = RecordLossScaler(trainer) if run.get("fp16") else None
        if run.get("stop_after_save"):
            trainer.add_callback(stop_after_save(trainer, *run["stop_after_save"]))
        revived = KillPersister(trainer, *run["kill_persister"]) if run.get("kill_persister") else None
        trainer.train(resume_from_checkpoint=run.get("resume"))
    if shim:
        assert_sharded(trainer)
    if tp:
        assert_tensor_parallel(trainer, *tp)
    if run.get("autotp"):
        assert_autotp(trainer, run["autotp"])
    if run.get("save_model"):  # the trainer's save_model after training, as a user calls it
        trainer.save_model(run["save_model"])
    session = vars(trainer).get("_uc_session")  # None: a plain Trainer
    resumed = session.resume if session is not None else None
    return {**record(trainer, losses_of(trainer)), **({"at": at.record} if at else {}),
            "resumed_from": resumed.layout.path if resumed is not None else None,
            **(scaler.result() if scaler else {}),
            **({"weights": every.record} if every else {}),
            **({"durable_while_training": revived.durable} if revived else {})}


def _refused(trainer, resume, expected: str) -> dict:
    """A run that must be refused: its error, and how many steps it trained first."""
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        assert expected in str(e), f"expected {expected!r} in: {e}"
        return {"error": f"{type(e).__name__}: {e}", "global_step": trainer.state.global_step}
    raise AssertionError(f"the run was expected to fail with {expected!r}")


def _with_aggregation_fault(run: dict, world_size: int) -> dict:
    """`run` with `aggregation_fault` (and "default_timeout": the default group's timeout, seconds, where the group
    exists already); every rank saves what it saw to `<result>.fault.rank<r>`: the file the fault hit, the
    timeouts of the default and `aggregate` groups, when this rank's `train()` raised (time.time()) and what, and for
    kills the SIGTERM the launcher sent it (recorded and ignored: a survivor must fail on its own; the launcher's
    SIGKILL follows 5 s later)."""
    import signal

    from hf_unified_ckpt import dist

    fault, rank, step = run["aggregation_fault"]
    if run.get("default_timeout") and dist.is_distributed():  # as init_process_group(timeout=...) sets it
        import datetime

        import torch.distributed.distributed_c10d as c10d

        c10d._set_pg_timeout(datetime.timedelta(seconds=run["default_timeout"]))
    seen = {"fault": fault, "rank": rank, "sigterm": None, "error": None, "failed_at": None}
    out = f"{run['result']}.fault.rank"

    def keep():
        torch.save(seen, f"{out}{dist.rank()}")

    if fault.startswith("kill"):
        signal.signal(signal.SIGTERM, lambda *_: seen.update(sigterm=time.time()))
    rest = {k: v for k, v in run.items() if k not in ("aggregation_fault", "default_timeout")}
    try:
        with aggregation_fault(fault, rank, step, seen, keep):
            result = run_spec(rest, world_size)
    except Exception as e:  # noqa: BLE001 - what each rank raised is what the tests check
        seen.update(error=f"{type(e).__name__}: {e}", failed_at=time.time())
        keep()
        if fault.startswith("kill"):
            raise
        return {"error": seen["error"]}
    keep()
    return result


#: The ordinary Trainer options around the loop: eval every 2 steps, `load_best_model_at_end` (greater_is_better on
#: eval_loss: the tiny llama's eval loss falls, so an early checkpoint is the best one and loading it visibly changes
#: the final weights; the MoE model's rises, so its best is the last, the checkpoint being saved) and
#: `save_total_limit=2` (rotation must keep the best one); `loop_spec` adds `save_model` after training. Where the
#: best lands in every combination is the native-parity harness's job (test_native_parity.py).
BEST = {"max_steps": 6, "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss", "greater_is_better": True, "save_total_limit": 2}


def loop_spec(spec: dict, model_dir) -> dict:
    """`spec` with evaluation, `load_best_model_at_end`, rotation (`BEST`) and a `save_model(model_dir)` at the end."""
    return {**spec, "eval": True, "save_model": str(model_dir), "overrides": {**spec.get("overrides", {}), **BEST}}
