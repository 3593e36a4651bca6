"""The save algorithm, the same with and without a process group.

1. rank 0 creates the staging folder `.checkpoint-N.incomplete`;
2. every rank computes the same shard plan; file by file, sharded engines assemble each tensor on the rank that
   writes it, and that rank's writer thread writes the file; then every rank writes its extras (RNG state...);
3. every rank reports its file records (or its error) to all;
4. rank 0 writes the index files and the manifest (last), then renames the staging folder to `checkpoint-N`.
Any failure on any rank aborts the save on every rank: the staging folder is removed and nothing is committed.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import traceback
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from . import dist
from .engines.base import MODEL, OPTIMIZER, EngineAdapter
from .errors import UnifiedCheckpointError
from .options import UnifiedCheckpointOptions
from .planning import ComponentPlan, plan_component
from .storage.commit import commit, prepare_staging, staging_dir
from .storage.files import FileRecord
from .storage.manifest import ComponentEntry, build_manifest, write_manifest
from .storage.safetensors_io import index_name, write_index, write_shard

logger = logging.getLogger(__name__)

#: Writes this rank's non-tensor files (RNG, and on rank 0 trainer state, scheduler, tokenizer...) into a folder.
ExtrasWriter = Callable[[Path], list[FileRecord]]


@dataclass(frozen=True)
class SaveRequest:
    """Where and what to save."""

    final_dir: Path
    global_step: int
    options: UnifiedCheckpointOptions
    include_optimizer: bool = True
    show_progress: bool = True


@dataclass(frozen=True)
class SavePlan:
    """Everything the save writes besides tensor bytes, fixed when the save starts (an async save finishes
    while training goes on, so nothing may be read from the live engine later): the shard plan of every
    component, the optimizer's param-group metadata, and how the checkpoint was saved."""

    components: dict[str, ComponentPlan]
    saved_by: dict


def plan_save(engine: EngineAdapter, request: SaveRequest) -> SavePlan:
    """The save plan, identical on all ranks. Collective (locality hints of sharded engines): all ranks must
    call it."""
    components = [c for c in engine.components() if request.include_optimizer or c != OPTIMIZER]
    plans = {}
    for c in components:
        plan = plan_component(c, engine.specs(c), dist.world_size(), request.options.max_shard_size,
                              file_stem=engine.file_stem(c), owners=engine.preferred_owners(c))
        if c == OPTIMIZER:
            plan = dataclasses.replace(plan, index_metadata=copy.deepcopy(engine.optimizer_metadata()))
        plans[c] = plan
    return SavePlan(plans, copy.deepcopy(engine.saved_by()))


def save_checkpoint(engine: EngineAdapter, request: SaveRequest, write_extras: ExtrasWriter) -> Path:
    """Write and commit one unified checkpoint at `request.final_dir`.

    Collective: all ranks must call it. Returns the committed folder; raises `UnifiedCheckpointError` on every
    rank if any rank failed, leaving no `checkpoint-N` behind (an existing complete one stays untouched).
    """
    final = Path(request.final_dir)
    staging = open_staging(final)
    plan = plan_save(engine, request)
    outcome = guarded(lambda: _write_share(engine, plan.components, staging, request) + write_extras(staging))
    raise_if_failed(conclude(plan, staging, request, outcome), staging, final)
    return final


def open_staging(final: Path) -> Path:
    """Rank 0 creates the empty staging folder of `final`; a failure (read-only or full disk) is raised on every
    rank before anything is written. Collective: all ranks must call it."""
    staging = staging_dir(final)
    status = guarded(lambda: prepare_staging(staging)) if dist.rank() == 0 else None
    raise_if_failed([dist.broadcast_object(status)], staging, final)
    return staging


def conclude(plan: SavePlan, staging: Path, request: SaveRequest, outcome: tuple[bool, object], group=None,
             after_commit: Callable[[], None] | None = None) -> list:
    """Share every rank's outcome; if all wrote their files, rank 0 writes the indexes and the manifest and
    commits. Returns the reports every rank then checks with `raise_if_failed` (the same on all ranks).

    Collective (on `group`): all its ranks must call it."""
    reports = dist.all_gather_object(outcome, group=group)
    if any(not ok for ok, _ in reports):
        return reports
    status = None
    if dist.rank() == 0:
        records = [r for _, payload in reports for r in payload]
        status = guarded(lambda: _finalize(plan, staging, request.final_dir, request, records))
        if status[0] and after_commit is not None:
            after_commit()
    return [dist.broadcast_object(status, group=group)]


def guarded(fn) -> tuple[bool, object]:
    """(True, fn()) or (False, a description of the exception naming this rank)."""
    try:
        return True, fn()
    except Exception as e:  # reported to every rank, re-raised there
        logger.debug("unified checkpoint save failed on rank %d", dist.rank(), exc_info=True)
        return False, f"rank {dist.rank()}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"


def raise_if_failed(reports, staging: Path, final: Path) -> None:
    failures = [payload for ok, payload in reports if not ok]
    if not failures:
        return
    if dist.rank() == 0 and staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
    raise UnifiedCheckpointError(
        f"saving {final} failed; nothing was committed and earlier checkpoints are untouched.\n"
        + "\n".join(failures)
    )


def _write_share(engine: EngineAdapter, plans: dict[str, ComponentPlan], staging: Path,
                 request: SaveRequest) -> list[FileRecord]:
    """Walk every file of the plan in the same order on all ranks: assemble its tensors on its writer
    (`engine.exchange`, a collective on sharded engines), and hand the files this rank owns to a writer thread,
    so writing one file overlaps assembling the next. Collective: all ranks must call it."""
    everything = [(c, f) for c, plan in plans.items() for f in plan.files]
    show = request.show_progress and dist.rank() == 0
    futures = []
    with ThreadPoolExecutor(max_workers=1) as writer:
        for component, file in tqdm(everything, desc=f"Saving {request.final_dir.name}", unit="file",
                                    disable=not show):
            names, owner = plans[component].files[file], plans[component].owners[file]
            engine.exchange(component, names, owner)
            if owner == dist.rank():
                futures.append(writer.submit(lambda c=component, f=file, n=names:
                                             write_shard(staging / f, engine.tensors(c, n))))
        return [f.result() for f in futures]


def _finalize(plan: SavePlan, staging: Path, final: Path, request: SaveRequest,
              records: list[FileRecord]) -> None:
    entries = {}
    for component, cplan in plan.components.items():
        index = None
        if component != MODEL or cplan.is_sharded:
            records.append(write_index(staging, cplan.file_stem, cplan.weight_map, cplan.total_size,
                                       cplan.index_metadata))
            index = index_name(cplan.file_stem)
        entries[component] = ComponentEntry(cplan.file_stem, tuple(cplan.files), index, len(cplan.weight_map),
                                            cplan.total_size)
    manifest = build_manifest(request.global_step, plan.saved_by, request.options.as_manifest_dict(),
                              entries, records)
    write_manifest(staging, manifest)
    commit(staging, final)
    logger.info("Saved unified checkpoint %s (%d files)", final, len(records) + 1)
