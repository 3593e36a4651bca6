"""Exception types. Every error names what was found, what was expected and how to fix it."""

from __future__ import annotations


class UnifiedCheckpointError(RuntimeError):
    """Base class for checkpoint errors raised by hf_unified_ckpt."""


class CorruptCheckpointError(UnifiedCheckpointError):
    """Files are missing, truncated, fail their checksum, or an index/manifest is malformed or hostile."""


class NotRegularFileError(CorruptCheckpointError, OSError):
    """A file of a checkpoint is not a regular file (a FIFO, a device, a socket, a symbolic link): it is never read,
    so that nothing hangs on it or reads through it. An `OSError` too, so that code that treats an unreadable file
    as missing still does."""


class IncompleteCheckpointError(UnifiedCheckpointError):
    """The folder was never committed: its manifest is missing (the save was interrupted)."""


class UnsupportedCheckpointError(UnifiedCheckpointError):
    """The folder, engine or option is recognised but cannot be handled (yet); nothing was loaded."""


class CheckpointNotFoundError(UnifiedCheckpointError, ValueError):
    """`resume_from_checkpoint` names no checkpoint: a missing path, a folder without checkpoint files, or (`True`)
    an output directory without a complete checkpoint. A `ValueError`, as the native Trainer raises for the same
    mistake, and its message begins with the native wording (`Can't find a valid checkpoint at ...` / `No valid
    checkpoint found in output directory (...)`), the plugin's explanation after it."""


class OutputDirInUseError(UnifiedCheckpointError):
    """Another live job holds the lease of the folder (or URL prefix) this job's checkpoints go to: raised by
    `train()` before its first step, naming that job (host, pid, start time) and the ways out (another output_dir,
    `unified_checkpoint_lease_wait`, or removing the lease of a job that is surely gone). Nothing was written."""


class WriterProcessDied(UnifiedCheckpointError):
    """The writer process of a background save (`unified_checkpoint_async_executor="process"`) ended while a save
    was in flight (killed, out of memory): that save committed nothing, earlier checkpoints are untouched, and the
    next save starts a new writer process. Raised at the next wait (the next save, the end of training)."""


class UnsupportedOptionError(ValueError):
    """An option is valid in the format but not implemented by this version of the library."""


class TrainingPreempted(SystemExit):
    """Raised by `Trainer.train()` when a preemption signal (`preemption_signals`) ended training: all ranks agreed
    at one step boundary, the training state of that step was saved and made durable (`saved`, at `checkpoint`),
    and training stopped there. Uncaught, it ends the process quietly with status 128 + the signal's number (143
    for SIGTERM), so a scheduler retries the job and nothing after `train()` runs by accident; a script that wants
    to go on catches it (`except TrainingPreempted`). `saved` is False when nothing new was saved: the signal came
    before the first step, after training had ended, or the ranks could not agree (a peer died); `checkpoint` is
    then the newest complete checkpoint, if any (`signal_number` 0 and status 1: this rank got no signal and lost a
    peer while voting). Resume with `train(resume_from_checkpoint="auto")`."""

    def __init__(self, message: str, signal_number: int, step: int, checkpoint: str | None, saved: bool):
        super().__init__(128 + signal_number if signal_number else 1)
        self.message = message
        self.signal_number = signal_number
        self.step = step
        self.checkpoint = checkpoint
        self.saved = saved

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message, self.signal_number, self.step, self.checkpoint, self.saved)


def short_read(ref, offset: int, length: int, got: int) -> CorruptCheckpointError:
    """The error for a read of `length` bytes at `offset` of `ref` that got `got` (the file ends sooner)."""
    return CorruptCheckpointError(f"{ref}: asked for bytes [{offset}, {offset + length}), got {got}: the file ends "
                                  "before them (truncated, or changed since it was listed).")


def count_and_first(items, noun: str = "tensor", shown: int = 5) -> str:
    """How many `items` there are and the first few: "12 tensor(s): ['a', 'b', 'c', 'd', 'e', ...]"."""
    items = list(items)
    more = ", ..." if len(items) > shown else ""
    return f"{len(items)} {noun}(s): [{', '.join(map(repr, items[:shown]))}{more}]"


def missing_and_unexpected(missing, unexpected) -> str:
    """"missing 12 tensor(s): [...]; unexpected 1 tensor(s): [...]", each part only when not empty."""
    parts = (("missing", list(missing)), ("unexpected", list(unexpected)))
    return "; ".join(f"{what} {count_and_first(names)}" for what, names in parts if names)
