"""Preemption without the Trainer: the signal handlers that only record a signal (`signals.py`), the ranks' vote
on it at step boundaries and what is said once it is agreed (`watch.py`), the SLURM requeue (`requeue.py`). What a
preemption does to a Trainer (the save at the agreed step, `TrainingPreempted`) is `trainer/preempt.py`."""
