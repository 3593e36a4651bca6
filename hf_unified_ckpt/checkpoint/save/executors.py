"""Where the half of a background save after its snapshot runs (`saving.finish`: write, conclude, commit).

- `ThreadExecutor`: on the background thread of `async_save.AsyncSaver` itself; its collectives go on a second
  gloo group of this process (`dist.gloo_group("async-save")`), never interleaved with training's.
- `ProcessExecutor`: in a writer process of each rank (`python -m hf_unified_ckpt.checkpoint.save.writer_process`, as
  torch DCP's process-based async save), which holds its own process group with the writers of the other ranks.
  The job travels over a private socket pair; its tensors are host buffers in shared memory (`snapshot.py`), so
  the writer maps the very pages the snapshot copied into: host memory stays at one snapshot. The writer takes
  the write, the checksums, the codecs and the fsyncs off this interpreter (its GIL, its threads). A writer that
  dies is a `WriterProcessDied` at the next wait, never a hang; the next save starts a new one.

The synchronous save runs the same `saving.finish` inline (`saving.save_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Protocol, runtime_checkable

import torch

from ... import dist
from ...errors import WriterProcessDied
from .persist import PersistJob
from .saving import Outcome, Started, discard, finish_in_background

logger = logging.getLogger(__name__)

#: The environment variable that hands the writer process this process's multiprocessing authentication key (the
#: shared tensors' file descriptors are fetched from this process's resource sharer, which checks it).
AUTHKEY_ENV = "HF_UNIFIED_CKPT_WRITER_AUTHKEY"
#: What torchrun tells its workers about its own store; a writer must not inherit it: with it, rank 0's writer would
#: not host the writers' store but wait for an agent's that does not exist (torch's `_create_c10d_store`).
LAUNCHER_STORE = ("TORCHELASTIC_USE_AGENT_STORE",)


@runtime_checkable
class Executor(Protocol):
    """Where the half of a background save after its snapshot runs (see the module docstring), in one call order per
    save: `set_up` (training thread), then `run` (the background thread); `close` at a run's end."""

    #: Whether the snapshot's host buffers must be in shared memory (another process writes them); then nothing
    #: is copied straight into place (`snapshot.Snapshots`).
    shares_memory: bool

    def set_up(self) -> None:
        """Make ready where the half runs (its group, its processes). Collective: all ranks must call it."""

    def run(self, started: Started, snapshot: tuple[bool, object], fallback: str | None) -> Outcome:
        """Run `saving.finish` there and return its outcome. Collective on the executor's group."""

    def close(self) -> None:
        """Release what it holds (no save in flight). Local."""


class ThreadExecutor:
    """See the module docstring."""

    shares_memory = False  # the snapshot stays in this process

    def __init__(self):
        self._group = None

    def set_up(self) -> None:
        """The group of the background collectives. Collective on first call: all ranks must call it."""
        self._group = dist.gloo_group("async-save")

    def run(self, started: Started, snapshot: tuple[bool, object], fallback: str | None) -> Outcome:
        """`saving.finish` here (the background thread). Collective on the async-save group."""
        return finish_in_background(started, snapshot, group=self._group, fallback=fallback)

    def close(self) -> None:
        pass


class ProcessExecutor:
    """See the module docstring."""

    shares_memory = True  # the snapshot's buffers are in shared memory; nothing is copied into place

    def __init__(self):
        self._writer: WriterProcess | None = None
        self._shipping = BufferShipping()

    def set_up(self) -> None:
        """Start the writer processes where any rank has none alive (all ranks then start new ones, which meet on
        an address rank 0 picks). Collective: all ranks must call it."""
        alive = self._writer is not None and self._writer.alive
        if all(dist.all_gather_object(alive)):
            return
        self.close()
        address = dist.broadcast_object(_free_address() if dist.rank() == 0 else None)
        self._writer = WriterProcess(dist.rank(), dist.world_size(), address)
        self._shipping = BufferShipping()  # a new writer holds no buffer yet

    def run(self, started: Started, snapshot: tuple[bool, object], fallback: str | None) -> Outcome:
        """Run `saving.finish` in the writer process and return its outcome (the background thread waits). Raises
        `WriterProcessDied` (after removing what the save wrote, on the folder's leader) if the writer died."""
        job, new, live = self._shipping.pack(started.job if snapshot[0] else None)
        started = dataclasses.replace(started, job=job)
        try:
            return self._writer.run((started, (True, job) if snapshot[0] else snapshot, fallback, new, live))
        except WriterProcessDied:
            if started.staging.is_leader:
                discard(started.staging.path, started.writer)
            raise

    def close(self) -> None:
        """Stop the writer process (no save in flight). Local."""
        if self._writer is not None:
            self._writer.stop()
            self._writer = None


class BufferShipping:
    """The snapshot's host buffers as the writer process receives them: a buffer crosses once (its file
    descriptor, the first time a job holds it); later jobs name it by number, and the writer keeps it mapped from
    save to save (no descriptor per tensor per save, no new mapping to fault in). Each job says which buffers are
    still in use; the writer drops the others."""

    def __init__(self):
        self._held: dict[int, torch.Tensor] = {}  # number -> buffer the writer holds

    def pack(self, job: PersistJob | None) -> tuple[PersistJob | None, dict[int, torch.Tensor], list[int]]:
        """`job` with every tensor replaced by its buffer's number; the buffers the writer does not hold yet; the
        numbers in use (None: nothing to write, every buffer dropped)."""
        if job is None:
            self._held = {}
            return None, {}, []
        new, held, files = {}, {}, []
        for file, tensors in job.files:
            numbers = {}
            for name, tensor in tensors.items():
                number = id(tensor)  # the buffer stays alive while held here, so its number is its own
                if self._held.get(number) is not tensor:
                    new[number] = tensor
                numbers[name], held[number] = number, tensor
            files.append((file, numbers))
        self._held = held
        return dataclasses.replace(job, files=files), new, list(held)


def unpack(job: PersistJob, buffers: dict[int, torch.Tensor]) -> PersistJob:
    """The writer's side of `BufferShipping.pack`: `job` with each number replaced by its buffer."""
    job.files = [(file, {name: buffers[number] for name, number in numbers.items()}) for file, numbers in job.files]
    return job


def executor_for(name: str) -> Executor:
    """The executor `unified_checkpoint_async_executor` names (validated by `options.parse_options`)."""
    return {"thread": ThreadExecutor, "process": ProcessExecutor}[name]()


class WriterProcess:
    """One rank's writer process and the socket pair it is reached by (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, address: str | None):
        ours, theirs = multiprocessing.Pipe(duplex=True)
        env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_STORE}
        env[AUTHKEY_ENV] = bytes(multiprocessing.current_process().authkey).hex()
        timeout = dist.default_timeout()  # the job's: the writers' collectives (the `aggregate` group's) wait as long
        command = [sys.executable, "-m", "hf_unified_ckpt.checkpoint.save.writer_process", str(theirs.fileno()),
                   str(rank), str(world_size), address or "", str(timeout.total_seconds() if timeout else "")]
        self._process = subprocess.Popen(command, env=env, pass_fds=(theirs.fileno(),))
        theirs.close()  # only the writer holds its end: its death is an end of file here
        self._conn: Connection = ours
        self.rank = rank

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def run(self, message):
        """Send one job and return what the writer answers, or raise what it raised (its type kept)."""
        try:
            self._conn.send(message)
            ok, value = self._conn.recv()
        except (EOFError, OSError) as e:
            raise WriterProcessDied(
                f"the writer process of rank {self.rank} (pid {self._process.pid}) ended (status "
                f"{self._process.wait()}) during a save; nothing of that save was committed, earlier checkpoints are "
                "untouched, and the next save starts a new writer process.") from e
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """Ask the writer to end, and wait for it."""
        try:
            self._conn.send(None)
        except OSError:
            pass  # already gone
        self._conn.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            logger.warning("the writer process %d did not end; killed", self._process.pid)
            self._process.kill()
            self._process.wait()


def _free_address() -> str | None:
    """Where the writers' process group meets: a free port on this machine (rank 0's), under the launcher's
    MASTER_ADDR; None without a process group (the writer runs alone)."""
    if dist.world_size() == 1:
        return None
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"tcp://{host}:{port}"
