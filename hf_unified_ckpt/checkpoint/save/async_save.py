"""`async_save`: the save algorithm of `saving.py` with its second half off the training thread.

On the training thread (what training waits for): `saving.begin` (the staging folder, the plan, the write
strategy, the assembly of sharded tensors on their writers: collectives on the default group). A background
thread then takes the snapshot (`snapshot.Snapshots`: this rank's tensors copied into host buffers reused from
save to save, or, for the memory tier's files, straight into the files through mappings kept from save to save)
and hands the job to the executor (`executors.py`), which runs `saving.finish` (write, conclude, commit) on that
thread or in a writer process. The copy reads live parameters and optimizer state, which only the next optimizer
step changes: `wait_for_snapshot` (called from the `on_pre_optimizer_step` callback) blocks that step until the
copy is done, so the copy overlaps the next forward and backward passes. DeepSpeed steps inside `backward`, where
no callback runs: there its optimizer's own `step` waits (`engines.deepspeed.wait_before_steps`).

A save may name a `Fallback` (the memory tier's saves do): when a rank runs out of space (ENOSPC, EDQUOT) the
same snapshot is written to the fallback folder instead, so nothing is lost.

One save is in flight at a time: the next save, the end of training and `wait()` wait for it, and its error is
raised there, on every rank (the outcome is shared by a collective). A failed save is never committed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from ... import dist
from ...engines.base import EngineAdapter
from ...errors import UnifiedCheckpointError
from ...store.node import mem_available
from .executors import executor_for
from .persist import Background
from .saving import SaveRequest, SmallFiles, Started, begin, plan_save
from .snapshot import Snapshots, snapshot_specs

logger = logging.getLogger(__name__)

#: The share of the memory available that host buffers made ahead may take.
HEADROOM = 0.8


@dataclass(frozen=True)
class Fallback:
    """Where a save goes when its folder's filesystem is full: `final_dir`, then `after_commit` there (rotation);
    `said` runs once on every rank when it is used (the caller stops aiming at the full folder)."""

    final_dir: str
    after_commit: Callable[[], None] | None = None
    said: Callable[[str], None] | None = None


class AsyncSaver:
    """Owns the background saves of one training job (one instance per Trainer). `executor`: where the half after
    the snapshot runs, "thread" or "process" (`executors.py`)."""

    def __init__(self, executor: str = "thread"):
        self._executor = executor_for(executor)
        shared = self._executor.shares_memory
        self._snapshots = Snapshots(shared=shared, place=not shared)
        self._background = Background("save", self._snapshots.buffers.transfers)
        self._in_flight: str | None = None  # the folder of the save in flight
        self._warmed_up = False  # this run's host buffers were asked for (`warm_up`)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def snapshot_bytes(self) -> int:
        """What the last save copied of this rank's tensors (into buffers or files)."""
        return self._snapshots.nbytes

    @property
    def warmed_up(self) -> bool:
        """Whether this run's host buffers were asked for (`warm_up`; reset at the run's end)."""
        return self._warmed_up

    def host_buffer_bytes(self) -> int:
        """Host memory held by the reused snapshot buffers (the extra memory async_save costs; none for the files
        a flash save copies straight into its memory files)."""
        return self._snapshots.buffers.nbytes()

    def start(self, engine: EngineAdapter, request: SaveRequest, small_files: SmallFiles, after_commit=None,
              fallback: Fallback | None = None) -> str:
        """Begin a save and return once the rest can run in the background. Waits for (and raises the error
        of) the previous save first. Collective: all ranks must call it."""
        self.wait()
        self._executor.set_up()
        started = begin(engine, request, small_files)
        self._background.start(lambda: self._snapshots.take(engine, started.job, started.files),
                               lambda snapshot: self._finish(started, snapshot, after_commit, fallback),
                               label=started.staging.final)
        self._in_flight = started.staging.final
        return started.staging.final

    def _finish(self, started: Started, snapshot, after_commit, fallback: Fallback | None) -> str:
        """The background thread, once the snapshot is taken: the executor runs the rest; then, on the folder's
        leader, `after_commit` of the folder the save went to; a failure is raised (at the next `wait`). Collective
        (the executor's group)."""
        outcome = self._executor.run(started, snapshot, fallback.final_dir if fallback is not None else None)
        if outcome.fell_back is not None:
            if fallback.said is not None:
                fallback.said(outcome.fell_back)
            after_commit = fallback.after_commit
        return outcome.after_commit_or_raise(after_commit)

    def warm_up(self, engine: EngineAdapter, request: SaveRequest, device, placed_whole: bool = False) -> None:
        """Once per run, before its first background save (after the first optimizer step, when the optimizer's
        state exists): the host buffers that save will copy into are made in the background (allocated, faulted
        in, pinned for a GPU; `snapshot.HostBuffers.warm_up`), from the save plan of `request`, so that the first
        save blocks training no longer than a later one. Skipped, said once, where they would not fit in the
        memory available (the first save then makes them as it copies, as without this), and where a codec
        stores the tensors (their encoded sizes are known only from the data). Collective (the save plan): all
        ranks must call it."""
        if self._warmed_up:
            return
        self._warmed_up = True
        specs = snapshot_specs(plan_save(engine, request, shared=True, rank_local=True).files, dist.rank(),
                               placed_whole)
        if not specs:
            return
        need = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _ in specs)
        room = mem_available()
        if room is not None and need > HEADROOM * room:
            logger.info("The host buffers of the background saves (%.2f GB on this rank) are not made ahead: %.2f GB "
                        "of memory is available; the first save makes them as it copies.", need / 1e9, room / 1e9)
            return
        self._snapshots.buffers.warm_up(specs, device)

    def release_mappings(self) -> None:
        """Release what the saves keep from one to the next (a run's end): the host buffers, the mappings of the
        files they wrote through (the memory tier's files may be freed) and the writer process, if any. Call with
        no save in flight; the next save (and the next run's `warm_up`) makes again what it needs."""
        self._snapshots.release_mappings()
        self._snapshots.buffers.release()
        self._warmed_up = False
        self._executor.close()

    def wait_for_snapshot(self) -> None:
        """Block until the in-flight save has copied what it writes (call before the optimizer changes it)."""
        self._background.wait_for_snapshot()

    def wait(self) -> None:
        """Wait for the in-flight save; raise its error (on every rank). Call on all ranks."""
        if self._in_flight is not None:
            self._in_flight = None
            logger.info("Background save of %s committed.", self._background.wait())

    def close(self) -> None:
        """Wait for the in-flight save without raising (interpreter exit); its error is logged. Stops the writer
        process, if any."""
        try:
            self.wait()
        except UnifiedCheckpointError as e:
            logger.error("%s", e)
        self.release_mappings()
