"""Slow repeat test of clean exits (marker `slow`, not in the default suite: `make test-slow`).

Launches DDP×2 again and again, each a run that trains to the end and then a resume of its final checkpoint
(`resume_from_checkpoint="auto"`), the case in which processes were seen aborting at interpreter exit ("terminate
called without an active exception", SIGABRT) once in tens of launches; every other launch is preempted by SIGTERM
at its end instead. Every launch must exit with its own status (0, or 143 for the preempted ones) and never abort.
The deterministic check of the cause is in test_preemption.py (nothing of the plugin outlives `train()`).
REPEATS (environment, default 30) sets the number of launches.
"""

from __future__ import annotations

import os

import pytest

from support.preemption import exit_codes, finish, launch, run

pytestmark = [pytest.mark.slow, pytest.mark.dist]


@pytest.mark.parametrize("i", range(int(os.environ.get("REPEATS", "30"))))
def test_every_launch_exits_with_its_own_status(tmp_path, i):
    preempt = i % 2 == 1
    runs = [run(tmp_path, "run", overrides={"max_steps": 4, "save_steps": 2}),
            run(tmp_path, "run", resume="auto", exit=preempt, phase="after_training" if preempt else None,
                overrides={"max_steps": 4, "save_steps": 2})]
    proc = launch("repeat", runs, tmp_path)
    out = finish(proc, ok=not preempt)
    assert "terminate called" not in out and "exitcode  : -6" not in out, out[-6000:]
    if preempt:
        assert proc.returncode != 0 and exit_codes(tmp_path, "repeat") == [143, 143], out[-6000:]
