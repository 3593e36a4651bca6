"""Preemption in one process: the options, the handler's rules (first signal wins, repeats change nothing, off the
main thread none is installed), `resume_from_checkpoint="auto"`, SLURM requeue (a recording `scontrol` first on
PATH), transformers' `enable_jit_checkpoint` taken over or refused. The multi-process phases are in
test_preemption.py."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import stat
import threading

import pytest
import torch
from transformers import TrainerCallback

from support.trainers import make_trainer
from hf_unified_ckpt import TrainingPreempted, UnifiedCheckpointArguments
from hf_unified_ckpt.errors import UnsupportedCheckpointError
from hf_unified_ckpt.preemption.requeue import requeue, requeue_command


def args(**fields):
    return UnifiedCheckpointArguments(output_dir="unused", unified_checkpoint=True, use_cpu=True, report_to=[],
                                      **fields)


def test_options_parse_signals_by_name_or_number_and_refuse_what_cannot_be_caught():
    options = args(preemption_signals="TERM, usr1 12").unified_checkpoint_options.preemption
    assert options.enabled and options.signals == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    assert options.grace_period == 30.0 and options.agree_timeout == 15.0 and not options.requeue
    assert not args(save_on_preemption=False).unified_checkpoint_options.preemption.enabled
    with pytest.raises(ValueError, match="'SIGKILL' is not a signal a preemption can be caught by"):
        args(preemption_signals="SIGTERM SIGKILL")
    with pytest.raises(ValueError, match="preemption_signals is empty"):
        args(preemption_signals=" ")
    with pytest.raises(ValueError, match="preemption_grace_period=0"):
        args(preemption_grace_period=0)


def test_the_exception_is_a_quiet_system_exit_that_pickles():
    e = TrainingPreempted("Training preempted by SIGTERM at step 4", 15, 4, "/x/checkpoint-4", True)
    assert isinstance(e, SystemExit) and not isinstance(e, Exception) and e.code == 143
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.code, back.step, back.checkpoint, back.saved) == (str(e), 143, 4, "/x/checkpoint-4", True)


def test_the_message_states_the_status_the_process_exits_with():
    """A rank that got no signal and lost a peer exits 1, and its message says 1 (not 128)."""
    from hf_unified_ckpt.options import PreemptionOptions
    from hf_unified_ckpt.preemption.watch import Watch

    watch = Watch(PreemptionOptions(enabled=True, signals=(15,), grace_period=30.0, requeue=False))
    lost = watch.ended(0, 4, "/x/checkpoint-3", False, "voting")
    signalled = watch.ended(15, 4, "/x/checkpoint-4", True, "at a step boundary")
    assert (lost.code, signalled.code) == (1, 143)
    assert "a lost peer" in str(lost) and "Exiting with status 1;" in str(lost)
    assert "SIGTERM" in str(signalled) and "Exiting with status 143;" in str(signalled)


class SignalAt(TrainerCallback):
    """Sends `signals` to this process in the middle of step `step` (after its backward)."""

    def __init__(self, step: int, *signals):
        self.step, self.signals, self.handlers = step, signals, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.handlers.append(signal.getsignal(signal.SIGTERM))
        if state.global_step + 1 == self.step:
            for number in self.signals:
                os.kill(os.getpid(), number)


def preempted(trainer, **train_kwargs) -> TrainingPreempted:
    with pytest.raises(TrainingPreempted) as info:
        trainer.train(**train_kwargs)
    return info.value


def test_first_signal_wins_and_repeats_change_nothing(tmp_path, caplog):
    """SIGUSR1 then SIGTERM twice, in the middle of step 2: one process has nothing to wait for, so step 2 is saved
    and the status names the first signal. Said once."""
    trainer = make_trainer(tmp_path / "run", max_steps=6, save_steps=4, preemption_signals="SIGTERM,SIGUSR1")
    trainer.add_callback(SignalAt(2, signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM))
    with caplog.at_level(logging.WARNING, logger="hf_unified_ckpt"):
        e = preempted(trainer)
    assert (e.code, e.step, e.saved) == (128 + signal.SIGUSR1, 2, True)
    assert e.checkpoint == str(tmp_path / "run" / "checkpoint-2") and os.listdir(tmp_path / "run") == ["checkpoint-2"]
    said = [r.getMessage() for r in caplog.records if "Training preempted" in r.getMessage()]
    assert said == [str(e)] and "SIGUSR1 at step 2" in said[0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_resume_auto_starts_fresh_then_resumes_the_newest(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="resume_from_checkpoint='auto'"):
        make_trainer(run_dir, max_steps=4, save_steps=2).train(resume_from_checkpoint=True)
    trainer = make_trainer(run_dir, max_steps=4, save_steps=2)
    trainer.add_callback(SignalAt(3, signal.SIGTERM))
    assert preempted(trainer, resume_from_checkpoint="auto").step == 3  # the first start: nothing to resume
    trainer = make_trainer(run_dir, max_steps=4, save_steps=2)
    trainer.train(resume_from_checkpoint="auto")
    assert trainer.state.global_step == 4 and [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2,
                                                                                                              3, 4]


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A recording `scontrol` first on PATH: it appends its arguments to a file and exits with $SCONTROL_STATUS."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit ${{SCONTROL_STATUS:-0}}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_requeue_runs_scontrol_for_the_job_or_the_array_task(scontrol, monkeypatch, caplog):
    assert requeue_command({}) is None
    with caplog.at_level(logging.WARNING):
        assert requeue() is False and "outside SLURM" in caplog.text
    assert not scontrol.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert requeue() is True
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue() is True
    monkeypatch.setenv("SCONTROL_STATUS", "1")
    with caplog.at_level(logging.ERROR):
        assert requeue() is False and "failed with status 1" in caplog.text
    assert scontrol.read_text().splitlines() == ["requeue 4242", "requeue 77_3", "requeue 77_3"]


def test_a_preempted_slurm_job_is_requeued_after_its_save(tmp_path, scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    trainer = make_trainer(tmp_path / "run", max_steps=6, save_steps=4, slurm_requeue=True)
    trainer.add_callback(SignalAt(3, signal.SIGTERM))
    e = preempted(trainer)
    assert e.saved and e.step == 3 and scontrol.read_text() == "requeue 99\n"


def test_jit_checkpoint_is_taken_over(tmp_path):
    trainer = make_trainer(tmp_path / "run", max_steps=6, save_steps=4, enable_jit_checkpoint=True)
    jit_handler = signal.getsignal(signal.SIGTERM)
    assert callable(jit_handler)  # transformers installed its handler when the Trainer was built
    probe = SignalAt(3, signal.SIGTERM)
    trainer.add_callback(probe)
    e = preempted(trainer)
    assert e.step == 3 and e.saved and os.listdir(tmp_path / "run") == ["checkpoint-3"]
    assert all(h != jit_handler for h in probe.handlers)  # the plugin's handler ran the run, not the JIT one
    assert not [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "JITCheckpointCallback"]


def test_jit_checkpoint_without_preemption_handling_is_refused_before_the_first_step(tmp_path):
    trainer = make_trainer(tmp_path / "run", max_steps=6, save_steps=4, enable_jit_checkpoint=True,
                           save_on_preemption=False)
    try:
        with pytest.raises(UnsupportedCheckpointError, match="enable_jit_checkpoint=True"):
            trainer.train()
        assert trainer.state.global_step == 0 and not list((tmp_path / "run").glob("checkpoint-*"))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the JIT callback's handler, left by the refused run


def test_off_the_main_thread_no_handler_is_installed_and_training_goes_on(tmp_path, caplog):
    trainer = make_trainer(tmp_path / "run", max_steps=2, save_steps=2)
    probe = SignalAt(99)
    trainer.add_callback(probe)
    errors = []
    worker = threading.Thread(target=lambda: _catching(errors, trainer.train))
    with caplog.at_level(logging.WARNING, logger="hf_unified_ckpt"):
        worker.start()
        worker.join()
    assert not errors and trainer.state.global_step == 2
    assert probe.handlers == [signal.SIG_DFL, signal.SIG_DFL]
    assert sum("off the main thread" in r.getMessage() for r in caplog.records) == 1


def _catching(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        errors.append(e)


class NeverVotes:
    """A vote in flight whose peer never takes part: its timed waits time out, it never completes."""

    def wait(self, timeout=None):
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return False


def test_a_rank_with_a_signal_stops_waiting_for_a_vote_after_half_the_grace():
    """The rule `Agreement` applies to a vote that does not arrive (a peer died): without a signal it keeps waiting
    (a slow peer is not a dead one); with one, it gives up once `agree_timeout` has passed since the signal."""
    import time

    from hf_unified_ckpt.preemption.watch import Agreement, PeerLost
    from hf_unified_ckpt.preemption.signals import SignalFlag

    flag = SignalFlag((signal.SIGTERM,))
    agreement = Agreement(flag, agree_timeout=0.2)
    flag.received, flag.at = signal.SIGTERM, time.monotonic()
    began = time.monotonic()
    with pytest.raises(PeerLost, match="no agreement within 0 s of the signal"):
        agreement._wait(NeverVotes())
    assert 0.2 <= time.monotonic() - began < 2.0


class ArrivesAsTheWaitTimesOut:
    """A vote whose timed wait runs out just as it completes (gloo raises "Operation timed out!", and the work is
    complete by the time it is asked); waited on again, it returns or, with `fails`, raises its failure."""

    def __init__(self, fails: bool = False):
        self.fails, self.completed = fails, False

    def wait(self, timeout=None):
        if not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self):
        return self.completed


def test_a_vote_that_arrives_as_its_timed_wait_runs_out_is_taken_not_a_lost_peer():
    """The race that ended a rank quietly with status 1 mid-training (a `TrainingPreempted` for "a lost peer", its
    peer then failing on a closed connection): a vote completing between the timed wait's timeout and the check is a
    vote; only one that failed is a lost peer."""
    from hf_unified_ckpt.preemption.watch import Agreement, PeerLost
    from hf_unified_ckpt.preemption.signals import SignalFlag

    agreement = Agreement(SignalFlag((signal.SIGTERM,)), agree_timeout=60)
    agreement._wait(ArrivesAsTheWaitTimesOut())
    with pytest.raises(PeerLost, match="the vote failed: RuntimeError: Operation timed out!"):
        agreement._wait(ArrivesAsTheWaitTimesOut(fails=True))


@pytest.mark.parametrize("kind, extra", [("gpt2", {}), ("lora", {}), ("llama", {"bf16": True})],
                         ids=["tied-gpt2", "lora", "bf16"])
def test_preempted_then_resumed_equals_the_uninterrupted_run(tmp_path, kind, extra):
    """What users run: a tied-embedding model, a LoRA adapter, bf16 autocast; preempted mid-step 3 and resumed with
    "auto" in a new Trainer, the weights equal the uninterrupted run's bit for bit (one process, same threads)."""
    from support.states import final_state
    from support.trainers import losses_of

    reference = make_trainer(tmp_path / "reference", kind, max_steps=6, save_steps=4, **extra)
    reference.train()
    trainer = make_trainer(tmp_path / "run", kind, max_steps=6, save_steps=4, **extra)
    trainer.add_callback(SignalAt(3, signal.SIGTERM))
    assert preempted(trainer).step == 3
    resumed = make_trainer(tmp_path / "run", kind, max_steps=6, save_steps=4, **extra)
    resumed.train(resume_from_checkpoint="auto")
    assert {s: l for s, l in losses_of(resumed).items() if s > 3} == \
        {s: l for s, l in losses_of(reference).items() if s > 3}
    want, got = final_state(reference), final_state(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
