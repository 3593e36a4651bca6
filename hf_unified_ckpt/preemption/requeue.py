"""SLURM requeue after a preemption save (`slurm_requeue=True`), as PyTorch Lightning's SLURM environment does with
`auto_requeue`: `scontrol requeue <job>` puts the job back in the queue; its next start resumes with
`resume_from_checkpoint="auto"`. An array task is requeued as `<array job>_<task>`, the job id its task has."""

from __future__ import annotations

import logging
import os
import subprocess

logger = logging.getLogger(__name__)

REQUEUE_TIMEOUT_S = 15


def slurm_job_id(environ=None) -> str | None:
    """The id `scontrol` knows this job (or array task) by; None outside SLURM."""
    environ = os.environ if environ is None else environ
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def requeue_command(environ=None) -> list[str] | None:
    job = slurm_job_id(environ)
    return None if job is None else ["scontrol", "requeue", job]


def requeue() -> bool:
    """Requeue this SLURM job; say what happened. True when `scontrol` accepted it. Local (call on one rank)."""
    command = requeue_command()
    if command is None:
        logger.warning("slurm_requeue=True but this process runs outside SLURM (no SLURM_JOB_ID): nothing requeued.")
        return False
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.error("Could not requeue SLURM job %s (%s): %s. Requeue it by hand or resubmit it.", command[-1],
                     " ".join(command), e)
        return False
    if done.returncode != 0:
        logger.error("`%s` failed with status %d: %s. Requeue it by hand or resubmit it.", " ".join(command),
                     done.returncode, (done.stderr or done.stdout).strip())
        return False
    logger.info("Requeued SLURM job %s (%s).", command[-1], " ".join(command))
    return True
