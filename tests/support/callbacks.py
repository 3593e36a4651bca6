"""Trainer callbacks the runs add: record values at steps, kill the persister, stop after a save.
"""

from __future__ import annotations

import os
import time

import torch

from .states import final_state, optimizer_state, trainable_fp32


def _wait_until(ready, timeout: float) -> bool:
    """Poll `ready` every 0.1 s for up to `timeout` seconds; whether it became true."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class KillPersister:
    """Flash: SIGKILL the run's persister when step `kill_at` begins (rank 0; the kernel releases its lock, and the
    next save that commits finds it free), then, when step `check_at` begins, wait up to 60 s for checkpoint `name` to be durable in output_dir (`durable`: True
    if it was, while training still runs; a killed persister is otherwise only replaced when train() ends)."""

    def __init__(self, trainer, kill_at: int, check_at: int, name: str):
        import signal
        import subprocess

        import torch.distributed as dist
        from transformers import TrainerCallback

        from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

        self.durable = None
        outer = self

        def kill() -> None:
            run = trainer._uc_session.flash.run
            found = subprocess.run(["pgrep", "-f", f"hf_unified_ckpt.flash.persister {run}"], capture_output=True,
                                   text=True).stdout.split()
            assert found, "no persister to kill"
            for pid in found:
                os.kill(int(pid), signal.SIGKILL)

        def durable() -> bool:
            folder = os.path.join(trainer.args.output_dir, name)
            return os.path.isdir(folder) and detect_layout(folder).committed

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if dist.get_rank() != 0:
                    return
                if state.global_step + 1 == kill_at:
                    kill()
                if state.global_step + 1 == check_at:
                    outer.durable = _wait_until(durable, 60)

        trainer.add_callback(_Callback())


class RecordWeights:
    """Records `trainable_fp32` after every optimizer step, by step (what an EMA averages)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.record = {}
        outer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer.record[state.global_step] = trainable_fp32(trainer)

        trainer.add_callback(_Callback())


class RecordLossScaler:
    """DeepSpeed fp16: the loss scaler's state (and skipped steps) after every step, when training begins (what a
    resume loaded), and at the end."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        from hf_unified_ckpt.engines.deepspeed import SCALER_FIELDS

        self.at, self.start, outer = {}, None, self

        def state():
            engine = trainer.model_wrapped
            scaler = engine.optimizer.loss_scaler
            return {**{k: getattr(scaler, k) for k in SCALER_FIELDS}, "skipped_steps": engine.skipped_steps}

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, st, control, **kwargs):
                outer.start = state()

            def on_step_end(self, args, st, control, **kwargs):
                outer.at[st.global_step] = state()

        self.state = state
        trainer.add_callback(_Callback())

    def result(self) -> dict:
        return {"scaler_at": self.at, "scaler_at_start": self.start, "loss_scaler": self.state()}


class PlantTies:
    """DeepSpeed bf16: at the end of step `step`, makes every `every`-th fp32 master element whose bf16 weight has
    an even last bit a tie that rounds down to that weight (`bf16_bits << 16 | 0x8000`), through DeepSpeed's own
    `safe_set_full_fp32_param`: the bf16 weights stay their master's rounding, and the bf16 residual must list
    these elements as ties (rounded down, they are one more than int16 holds). Natural ties are about one value in
    130,000: the tests' small models have none. Collective (callbacks run on every rank)."""

    def __init__(self, trainer, step: int, every: int = 37):
        from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
        from transformers import TrainerCallback

        def plant(p) -> None:
            master = safe_get_full_fp32_param(p).detach().cpu().reshape(-1)
            high = master.to(torch.bfloat16).view(torch.int16).to(torch.int32)
            chosen = torch.zeros_like(master, dtype=torch.bool)
            chosen[::every] = (high[::every] & 1) == 0
            bits = torch.where(chosen, (high << 16) | 0x8000, master.view(torch.int32))
            safe_set_full_fp32_param(p, bits.view(torch.float32).view(p.ds_shape if hasattr(p, "ds_id") else p.shape))

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    for p in trainer.model_wrapped.module.parameters():
                        if p.requires_grad:
                            plant(p)

        trainer.add_callback(_Callback())


class RecordAt:
    """Records weights and optimizer state at step `step`: at the end of that step (what the save at that step
    writes), or when training begins there (what a resume from that step loaded). On every rank (a collective under
    DeepSpeed and FSDP: callbacks run on all ranks)."""

    def __init__(self, trainer, step: int):
        from transformers import TrainerCallback

        self.record = None
        outer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    outer.record = {"state": final_state(trainer), "optim": optimizer_state(trainer)}

            on_train_begin = on_step_end

        trainer.add_callback(_Callback())


def stop_after_save(trainer, step: int, marker: str, mode: str):
    """A callback: once the save of `step` has committed (its background write waited for, on every rank), rank 0
    writes `marker`, then every rank either holds (sleeps until killed: "hold") or dies as under kill -9 ("exit";
    only in the first attempt of a torchrun with --max-restarts, so the restarted workers train on)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    class StopAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
                return
            trainer._uc_session.saver.wait()
            if dist.is_initialized():
                dist.barrier()
            if not dist.is_initialized() or dist.get_rank() == 0:
                with open(marker, "w") as f:
                    f.write(str(step))
            if mode == "hold":
                time.sleep(3600)
            os._exit(9)

    return StopAfterSave()
