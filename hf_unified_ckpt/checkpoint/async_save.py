"""`async_save`: the save algorithm of `save.py` with the slow parts moved off the training thread.

On the training thread (what training waits for): the staging folder, the plan, the assembly of sharded tensors
on their writers (collectives on the default group), and an in-memory capture of the small non-tensor state
(RNG, trainer state, scheduler), which the background thread writes with the tensors.
A background thread then copies this rank's tensors into host buffers that are reused from save to save (or, for
the memory tier's files, straight into the files through mappings kept from save to save), writes the files, and
concludes the save with the same collectives as a synchronous save, on a second gloo group so
they never interleave with training's. The copy reads live parameters and optimizer state, which only the next
optimizer step changes: `wait_for_snapshot` (called from the `on_pre_optimizer_step` callback) blocks that step
until the copy is done, so the copy overlaps the next forward and backward passes. DeepSpeed steps inside
`backward`, where no callback runs: there its optimizer's own `step` waits (`engines.deepspeed.wait_before_steps`).

A save may name a `Fallback` (the memory tier's saves do): when a rank runs out of space (ENOSPC, EDQUOT) the
background thread writes the same snapshot to the fallback folder instead, so nothing is lost.

One save is in flight at a time: the next save, the end of training and `wait()` wait for it, and its error is
raised there, on every rank (the outcome is shared by a collective). A failed save is never committed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .. import dist
from ..engines.base import EngineAdapter
from ..errors import UnifiedCheckpointError
from .persist import Background, HostBuffers, PersistJob
from ..format.planning import FilePlan
from .save import (SaveRequest, SmallFiles, Staging, assembled_files, begin_multipart, conclude, discard, guarded,
                   open_staging, plan_save, raise_if_failed)
from ..store import WritableMaps, as_ref, name_of

logger = logging.getLogger(__name__)

#: What an out-of-space failure reads like in a rank's report (`save.guarded`): ENOSPC, EDQUOT.
OUT_OF_SPACE = ("[Errno 28]", "[Errno 122]")


@dataclass(frozen=True)
class Fallback:
    """Where a save goes when its folder's filesystem is full: `final_dir`, then `after_commit` there (rotation);
    `said` runs once on every rank when it is used (the caller stops aiming at the full folder)."""

    final_dir: str
    after_commit: Callable[[], None] | None = None
    said: Callable[[str], None] | None = None


def out_of_space(reports) -> bool:
    return any(not ok and any(mark in str(payload) for mark in OUT_OF_SPACE) for ok, payload in reports)


class AsyncSaver:
    """Owns the background save of one training job (one instance per Trainer)."""

    def __init__(self):
        self._buffers = HostBuffers()
        self._maps = WritableMaps()  # mappings of the files saves copy into directly (`SharedFileWriter.place`)
        self.snapshot_bytes = 0  # what the last save copied of this rank's tensors (into buffers or files)
        self._background = Background("save", self._buffers.transfers)

    @property
    def in_flight(self) -> bool:
        return self._background.in_flight

    def host_buffer_bytes(self) -> int:
        """Host memory held by the reused snapshot buffers (the extra memory async_save costs; none for the files
        a flash save copies straight into its memory files)."""
        return self._buffers.nbytes()

    def start(self, engine: EngineAdapter, request: SaveRequest, small_files: SmallFiles, after_commit=None,
              fallback: Fallback | None = None) -> str:
        """Begin a save and return once the rest can run in the background. Waits for (and raises the error
        of) the previous save first. Collective: all ranks must call it."""
        self.wait()
        group = dist.gloo_group("async-save")
        final = as_ref(request.final_dir)
        staging = open_staging(final)
        plan = begin_multipart(plan_save(engine, request, shared=staging.in_place), staging)
        mine = list(assembled_files(engine, plan.writer, plan.files, f"Saving {name_of(final)}",
                                    request.show_progress and dist.rank() == 0))
        job = PersistJob(staging.path, plan.writer, small_files=dict(small_files))
        self._background.start(lambda: guarded(lambda: self.stage(engine, job, mine)),
                               lambda staged: self._finish(staged, plan, staging, request, after_commit, group,
                                                           fallback),
                               label=name_of(final))
        return final

    def stage(self, engine, job: PersistJob, mine: list[FilePlan]) -> PersistJob:
        """Copy this rank's tensors of the files it writes: straight into the files where the writer can place
        them (the memory tier's reused files, mapped), else into the reused host buffers. `job`, ready to run."""
        self._maps.prune()
        self.snapshot_bytes = 0
        for file in mine:
            tensors = job.writer.local_tensors(engine, file)
            placed = self._place(job, file, tensors)
            if placed is not None:  # its host buffers, if an earlier save made them, are not needed any more
                self._buffers.drop((file.component, name) for name in tensors)
            else:
                tensors = {name: self._buffers.copy((file.component, name), tensor) for name, tensor in tensors.items()}
            self.snapshot_bytes += sum(t.nbytes for t in tensors.values())
            job.files.append((file, placed if placed is not None else tensors))
        return job

    def _place(self, job: PersistJob, file: FilePlan, tensors):
        place = getattr(job.writer, "place", None)  # SharedFileWriter's; whole-file writers copy into buffers
        return place(job.folder, file, tensors, self._maps) if place is not None else None

    def release_mappings(self) -> None:
        """Unmap the files the saves wrote through mappings (a run's end: the memory tier's files may be freed).
        Call with no save in flight."""
        self._maps.close()

    def _finish(self, staged, plan, staging: Staging, request: SaveRequest, after_commit, group,
                fallback: Fallback | None = None) -> tuple[list, Staging]:
        """Run the staged job, then conclude the save on the save's own group (collectives); out of space with a
        `fallback`: the same job again, into the fallback folder."""
        outcome = staged if not staged[0] else guarded(staged[1].run)
        try:
            reports = conclude(plan, staging, request, outcome, group=group, after_commit=after_commit)
            if fallback is not None and staged[0] and out_of_space(reports):
                return self._save_elsewhere(staged[1], plan, staging, request, fallback, group, reports)
        except Exception as e:  # a collective failed (another rank died): report it as this save's failure
            reports = [(False, f"rank {dist.rank()}: {type(e).__name__}: {e}")]
        return reports, staging

    def _save_elsewhere(self, job: PersistJob, plan, full: Staging, request: SaveRequest, fallback: Fallback, group,
                        reports) -> tuple[list, Staging]:
        """Write `job` (this rank's snapshot, still in the host buffers) into `fallback.final_dir`, where the
        folder that ran out of space is written the same way (in place, or whole files). Collective on `group`."""
        if full.is_leader:
            discard(full.path)
        staging = open_staging(fallback.final_dir, group=group)
        if staging.in_place != full.in_place or staging.multipart:
            return reports + [(False, f"{fallback.final_dir} is written another way than {full.final}; the "
                                      "snapshot could not be saved there instead.")], staging
        why = next(str(p).splitlines()[0] for ok, p in reports if not ok)
        if fallback.said is not None:
            fallback.said(why)
        job.folder = staging.path
        outcome = guarded(job.run)
        elsewhere = dataclasses.replace(request, final_dir=fallback.final_dir)
        return conclude(plan, staging, elsewhere, outcome, group=group, after_commit=fallback.after_commit), staging

    def wait_for_snapshot(self) -> None:
        """Block until the in-flight save has copied what it writes (call before the optimizer changes it)."""
        self._background.wait_for_stage()

    def wait(self) -> None:
        """Wait for the in-flight save; raise its error (on every rank). Call on all ranks."""
        if not self._background.in_flight:
            return
        reports, staging = self._background.wait()
        raise_if_failed(reports, staging)
        logger.info("Background save of %s committed.", staging.final)

    def close(self) -> None:
        """Wait for the in-flight save without raising (interpreter exit); its error is logged."""
        try:
            self.wait()
        except UnifiedCheckpointError as e:
            logger.error("%s", e)
        self.release_mappings()
