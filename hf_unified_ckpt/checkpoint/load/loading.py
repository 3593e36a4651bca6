"""Verify-then-load of a unified checkpoint into an engine, the same with and without a process group."""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack

from ... import dist
from ...format.components import MASTER, MODEL, OPTIMIZER, Role
from ...engines.base import EngineAdapter, LoadSources, MasterPrecision
from ...errors import CorruptCheckpointError, UnifiedCheckpointError, UnsupportedCheckpointError, count_and_first
from .file_service import FileService
from ...format.optim_state import group_param_names
from ...options import UnifiedCheckpointOptions
from .placement import Placement
from ..folder.files import put_file
from ..folder.manifest import (MANIFEST_NAME, check_share, checksum_problems, chunks_of, describe_problems,
                       read_manifest, sized_as_recorded)
from ..folder.safetensors_io import ComponentReader
from ..folder.state_check import check_saved_state
from ...store import as_ref, join, store_for

logger = logging.getLogger(__name__)

_LOW_PRECISION = {"F16", "BF16", "F8_E4M3", "F8_E5M2"}


def verify_checkpoint(folder: str | os.PathLike, checksums: bool = True, show_progress: bool = False,
                      placement: Placement | None = None, checked_on_read: bool = False) -> dict:
    """Check every file of the checkpoint (presence, size, checksum, headers, index names) before any tensor is
    read; each rank checks a share of the files and checksums a share of their byte ranges (`chunks_of`; with
    `placement`, files spread over machine-local folders: by ranks that see them), and every rank combines the
    ranges' CRC-32s into each file's. With `checked_on_read` (a resume from object storage), files whose manifest
    entry has a CRC-32 per block are not read here: each ranged read checks its blocks (`checkpoint.folder.ranged`), so
    a rank fetches only what it loads. Returns the manifest.

    Collective: all ranks must call it. Raises `CorruptCheckpointError` on every rank if any file is bad.
    """
    folder = as_ref(folder)
    try:
        manifest, error = read_manifest(folder), None
    except Exception as e:  # the same on every rank (same files), but keep the collective below aligned
        manifest, error = None, e
    table = manifest["files"] if manifest else {}
    sizes = {n: table[n]["size"] for n in sorted(table)}
    summed = {n: size for n, size in sizes.items() if not (checked_on_read and "blocks" in table[n])}
    if placement is None:  # one folder every rank sees: ranges only of files whose size on disk is the recorded one
        summed = sized_as_recorded(folder, summed) if manifest else {}
    placement = placement or Placement({n: tuple(range(dist.world_size())) for n in table}, dist.rank(),
                                       dist.world_size())
    files = placement.verification_shares(sizes)[dist.rank()]
    chunks = placement.verification_shares(chunks_of(summed) if checksums else [])[dist.rank()]
    show = show_progress and dist.rank() == 0
    share = check_share(folder, table, files, chunks, show_progress=show) if manifest else ([], [])
    everyone = dist.all_gather_object(share)
    all_problems = sorted([p for problems, _ in everyone for p in problems]
                          + checksum_problems(table, [r for _, records in everyone for r in records]))
    if error is not None:
        raise error
    if all_problems:
        raise CorruptCheckpointError(describe_problems(folder, all_problems))
    return manifest


def fetch_small_files(folder: str | os.PathLike, manifest: dict, placement: Placement) -> Placement:
    """Copy into this rank's folder (created if missing) every file of the checkpoint but the tensor files that it
    does not see (trainer state, scheduler, RNG states, configs, indexes; the manifest last), read from ranks that
    see them, so the Trainer's own resume code finds them. Returns the placement after the copy.

    Collective: all ranks must call it (the placement is the same on every rank)."""
    folder = as_ref(folder)
    shards = {f for entry in manifest.get("components", {}).values() for f in entry["files"]}
    small = sorted((n for n in placement.holders if n not in shards), key=lambda n: (n == MANIFEST_NAME, n))
    if placement.held_by_all(small):
        return placement
    service = FileService(folder, placement)
    try:
        wanted = [n for n in small if not placement.is_local(n)]
        if wanted:
            _clear_unverified(folder, shards, manifest_here=placement.is_local(MANIFEST_NAME))
        for name in wanted:
            put_file(join(folder, name), service.read_file(name))
    finally:
        service.close()
    if wanted and dist.local_rank() == 0:
        logger.info("Copied %d small file(s) of %s from other machines' folders.", len(wanted), folder)
    return placement.with_everywhere(small)


def _clear_unverified(folder: str, shards: set[str], manifest_here: bool) -> None:
    """Make `folder` ready to receive the small files. Without a manifest, tensor files already there belong to
    no committed save (an interrupted one): remove them, so the folder never pairs them with this manifest."""
    store = store_for(folder)
    store.make_folder(folder)
    if not manifest_here:
        for name in shards:
            store.remove(join(folder, name))


def load_checkpoint(folder: str | os.PathLike, engine: EngineAdapter, manifest: dict, options: UnifiedCheckpointOptions,
                    load_optimizer: bool = True, placement: Placement | None = None) -> list[list[str]] | None:
    """Load model weights, master weights and (optionally) optimizer state from a verified unified checkpoint.
    Returns the parameter names of the saved optimizer's param groups (None without the optimizer), which the
    learning-rate scheduler's saved state follows (`optim_state.fit_scheduler_state`).

    Reads are local (with `placement`, files other ranks hold are read from them); engines do not communicate
    while loading unless they say so. Collective when `placement` is given: all ranks must call it, and a failure
    on one rank is raised on every rank.
    """
    if placement is None or placement.everywhere:
        return _load(as_ref(folder), engine, manifest, options, load_optimizer, None)
    error, groups = None, None
    service = FileService(folder, placement)
    try:
        groups = _load(as_ref(folder), engine, manifest, options, load_optimizer, service)
    except Exception as e:  # shared below, so that no rank trains on after another failed
        error = e
    finally:
        service.close()
    failures = [f for f in dist.all_gather_object(None if error is None else f"rank {dist.rank()}: {error}") if f]
    if error is not None:
        raise error
    if failures:
        raise UnifiedCheckpointError(f"loading {folder} failed on other ranks:\n" + "\n".join(failures))
    return groups


def _load(folder: str, engine: EngineAdapter, manifest: dict, options: UnifiedCheckpointOptions,
          load_optimizer: bool, remote: FileService | None) -> list[list[str]] | None:
    components = manifest.get("components", {})
    model_entry = components.get(MODEL.name)
    if model_entry is None:
        raise UnsupportedCheckpointError(f"{folder} holds no model weights component; it cannot be resumed.")
    wanted_stem = next(c for c in engine.components() if c.role is Role.WEIGHTS).file_stem
    if model_entry["file_stem"] != wanted_stem:
        raise UnsupportedCheckpointError(
            f"{folder} stores its weights as '{model_entry['file_stem']}' files but the model being trained expects "
            f"'{wanted_stem}' (a PEFT adapter checkpoint needs a PEFT model, and the reverse)."
        )
    if load_optimizer and OPTIMIZER.name not in components:
        raise UnsupportedCheckpointError(
            f"{folder} has no optimizer state (it was saved with save_only_model=True), so training cannot resume "
            "exactly. Load its weights with from_pretrained and start a new run instead."
        )
    wanted = [name for name in components if load_optimizer or name != OPTIMIZER.name]
    with ExitStack() as stack:
        model = stack.enter_context(ComponentReader(folder, model_entry["file_stem"], remote))
        readers = {name: model if name == MODEL.name else
                   stack.enter_context(ComponentReader(folder, components[name]["file_stem"], remote, anchor=model))
                   for name in wanted}
        _check_shapes(engine, readers[MODEL.name])
        check_saved_state(folder, engine, readers)  # optimizer state, master weights, EMA: before any engine reads
        if MASTER.name not in readers:  # the model weights are the best fp32 values there are
            _check_master_rebuild(folder, manifest, readers[MODEL.name], engine, options)
            readers[MASTER.name] = readers[MODEL.name]
        engine.load(LoadSources(readers, int(manifest.get("global_step", 0))))
        return group_param_names(readers[OPTIMIZER.name].metadata) if OPTIMIZER.name in readers else None


def _check_shapes(engine, model: ComponentReader) -> None:
    """Sharded engines write the saved tensors into their shards by position, so a saved weight of another shape
    than the model's is refused here, naming it, before anything is loaded. An engine that loads through the
    module's own `load_state_dict` (`loads_by_module`: one process, DDP, as the native Trainer) leaves shapes to it."""
    if engine.loads_by_module:
        return
    saved = model.specs()
    bad = [f"{spec.name}: checkpoint {tuple(saved[spec.name][0])} vs model {tuple(spec.shape)}"
           for spec in engine.specs(MODEL.name) if spec.name in saved and tuple(saved[spec.name][0]) != tuple(spec.shape)]
    if bad:
        raise UnsupportedCheckpointError(f"shape mismatch between checkpoint and model in {count_and_first(bad)}. "
                                         "Build the same architecture (config) as the run that saved it.")


def _check_master_rebuild(folder: str, manifest: dict, model: ComponentReader, engine, options) -> None:
    """The folder has no master weights. Fine if its model weights are fp32; otherwise fp32 values are rebuilt
    from low precision: allowed by `master_weight_compatible` or a `remove_master_weight` save, said once."""
    if not (isinstance(engine, MasterPrecision) and engine.needs_fp32_master()):
        return
    low = sorted({dtype for _, dtype in model.specs().values() if dtype in _LOW_PRECISION})
    if not low:
        return
    saved_removed = bool(manifest.get("options", {}).get("remove_master_weight"))
    if not (saved_removed or options.master_weight_compatible):
        raise UnsupportedCheckpointError(
            f"{folder} has no fp32 master weights (its model weights are {low}), but this run keeps fp32 master "
            "weights. Add 'master_weight_compatible' to unified_checkpoint_config to rebuild them from the model "
            "weights (inexact: the low-precision rounding is kept), or resume with the engine that saved it.")
    if dist.rank() == 0:
        logger.warning("Resuming from %s: it has no fp32 master weights (%s); rebuilding them from the %s model "
                       "weights, so the resumed run is not bit-identical to an uninterrupted one.", folder,
                       "saved with remove_master_weight" if saved_removed else "master_weight_compatible", low)
