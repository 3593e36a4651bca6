"""`async_save`: the save algorithm of `save.py` with the slow parts moved off the training thread.

On the training thread (what training waits for): the staging folder, the plan, the assembly of sharded tensors
on their writers (collectives on the default group), and an in-memory capture of the small non-tensor state
(RNG, trainer state, scheduler), which the background thread writes with the tensors.
A background thread then copies this rank's tensors into host buffers that are reused from save to save, writes
the files, and concludes the save with the same collectives as a synchronous save, on a second gloo group so
they never interleave with training's. The copy reads live parameters and optimizer state, which only the next
optimizer step changes: `wait_for_snapshot` (called from the `on_pre_optimizer_step` callback) blocks that step
until the copy is done, so the copy overlaps the next forward and backward passes. DeepSpeed steps inside
`backward`, where no callback runs: there its optimizer's own `step` waits (`engines.deepspeed.wait_before_steps`).

One save is in flight at a time: the next save, the end of training and `wait()` wait for it, and its error is
raised there, on every rank (the outcome is shared by a collective). A failed save is never committed.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from . import dist
from .engines.base import EngineAdapter
from .errors import UnifiedCheckpointError
from .planning import FilePlan
from .save import (ExtrasWriter, SaveRequest, Staging, assembled_files, conclude, guarded, open_staging,
                   plan_save, raise_if_failed)

logger = logging.getLogger(__name__)


class AsyncSaver:
    """Owns the background save of one training job (one instance per Trainer)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._snapshot_done = threading.Event()
        self._snapshot_done.set()
        self._result: tuple[list, Staging] | None = None
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._group = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def host_buffer_bytes(self) -> int:
        """Host memory held by the reused snapshot buffers (the extra memory async_save costs)."""
        return sum(b.nbytes for b in self._buffers.values())

    def start(self, engine: EngineAdapter, request: SaveRequest, write_extras: ExtrasWriter,
              after_commit=None) -> Path:
        """Begin a save and return once the rest can run in the background. Waits for (and raises the error
        of) the previous save first. Collective: all ranks must call it."""
        self.wait()
        if self._group is None:
            self._group = dist.gloo_group("async-save")
        final = Path(request.final_dir)
        staging = open_staging(final)
        plan = plan_save(engine, request, shared=staging.shared)
        mine = list(assembled_files(engine, plan.writer, plan.files, f"Saving {final.name}",
                                    request.show_progress and dist.rank() == 0))
        self._snapshot_done.clear()
        self._thread = threading.Thread(target=self._run, name=f"hf_unified_ckpt-save-{final.name}",
                                        args=(engine, plan, mine, write_extras, staging, request, after_commit))
        self._thread.start()
        return final

    def _run(self, engine, plan, mine, write_extras, staging: Staging, request: SaveRequest, after_commit) -> None:
        try:
            snapshot = guarded(lambda: self._snapshot(engine, plan.writer, mine))
        finally:
            self._snapshot_done.set()
        _yield_cpu_to_training()
        outcome = snapshot if not snapshot[0] else guarded(
            lambda: self._write(plan.writer, staging.path, snapshot[1]) + write_extras(staging.path))
        try:
            reports = conclude(plan, staging, request, outcome, group=self._group, after_commit=after_commit)
        except Exception as e:  # a collective failed (another rank died): report it as this save's failure
            reports = [(False, f"rank {dist.rank()}: {type(e).__name__}: {e}")]
        self._result = (reports, staging)

    @staticmethod
    def _write(writer, folder: Path, snapshot: list[tuple[FilePlan, dict[str, torch.Tensor]]]) -> list:
        with writer.syncing():
            return [r for file, tensors in snapshot for r in writer.write(folder, file, tensors)]

    def _snapshot(self, engine, writer, mine: list[FilePlan]) -> list[tuple[FilePlan, dict[str, torch.Tensor]]]:
        files = []
        for file in mine:
            tensors = {}
            for name, tensor in writer.local_tensors(engine, file).items():
                buffer = self._buffers.get((file.component, name))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = self._buffers[(file.component, name)] = torch.empty(tensor.shape, dtype=tensor.dtype)
                buffer.copy_(tensor.detach())
                tensors[name] = buffer
            files.append((file, tensors))
        return files

    def wait_for_snapshot(self) -> None:
        """Block until the in-flight save has copied what it writes (call before the optimizer changes it)."""
        self._snapshot_done.wait()

    def wait(self) -> None:
        """Wait for the in-flight save; raise its error (on every rank). Call on all ranks."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        reports, staging = self._result
        self._result = None
        raise_if_failed(reports, staging)
        logger.info("Background save of %s committed.", staging.final)

    def close(self) -> None:
        """Wait for the in-flight save without raising (interpreter exit); its error is logged."""
        try:
            self.wait()
        except UnifiedCheckpointError as e:
            logger.error("%s", e)


def _yield_cpu_to_training() -> None:
    """Once the snapshot is taken, nothing waits for this thread: lower its CPU priority (Linux: per-thread
    nice), so that on a busy CPU the writing, checksums and page-cache copies take idle cycles, not training's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass
