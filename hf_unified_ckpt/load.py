"""Verify-then-load of a unified checkpoint into an engine, the same with and without a process group."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from . import dist
from .engines.base import MASTER, MODEL, OPTIMIZER, EngineAdapter
from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .options import UnifiedCheckpointOptions
from .storage.manifest import describe_problems, read_manifest, verify_folder
from .storage.safetensors_io import ComponentReader

logger = logging.getLogger(__name__)

_LOW_PRECISION = {"F16", "BF16", "F8_E4M3", "F8_E5M2"}


def verify_checkpoint(folder: str | Path, checksums: bool = True, show_progress: bool = False) -> dict:
    """Check every file of the checkpoint (presence, size, checksum, headers, index names) before any tensor is
    read; each rank checks a share of the files. Returns the manifest.

    Collective: all ranks must call it. Raises `CorruptCheckpointError` on every rank if any file is bad.
    """
    folder = Path(folder)
    try:
        manifest, error = read_manifest(folder), None
    except Exception as e:  # the same on every rank (same files), but keep the collective below aligned
        manifest, error = None, e
    names = sorted(manifest["files"]) if manifest else []
    mine = names[dist.rank()::dist.world_size()]
    show = show_progress and dist.rank() == 0
    problems = verify_folder(folder, manifest, mine, checksums, show_progress=show) if manifest else []
    all_problems = sorted(p for share in dist.all_gather_object(problems) for p in share)
    if error is not None:
        raise error
    if all_problems:
        raise CorruptCheckpointError(describe_problems(folder, all_problems))
    return manifest


@dataclass(frozen=True)
class LoadSources:
    """Readers an engine loads from.

    `master` holds the best fp32 values of the trainable weights: the `master_weights` files when saved, else
    the model weights (exact when they are fp32; a rebuild from low precision otherwise, allowed only by
    `master_weight_compatible` or a checkpoint saved with `remove_master_weight`).
    """

    model: ComponentReader
    master: ComponentReader
    optimizer: ComponentReader | None
    global_step: int


def load_checkpoint(folder: str | Path, engine: EngineAdapter, manifest: dict,
                    options: UnifiedCheckpointOptions, load_optimizer: bool = True) -> None:
    """Load model weights, master weights and (optionally) optimizer state from a verified unified checkpoint.

    Reads are local; engines do not communicate while loading, so a failure on one rank surfaces there.
    """
    folder = Path(folder)
    components = manifest.get("components", {})
    model_entry = components.get(MODEL)
    if model_entry is None:
        raise UnsupportedCheckpointError(f"{folder} holds no model weights component; it cannot be resumed.")
    wanted_stem = engine.file_stem(MODEL)
    if model_entry["file_stem"] != wanted_stem:
        raise UnsupportedCheckpointError(
            f"{folder} stores its weights as '{model_entry['file_stem']}' files but the model being trained expects "
            f"'{wanted_stem}' (a PEFT adapter checkpoint needs a PEFT model, and the reverse)."
        )
    if load_optimizer and OPTIMIZER not in components:
        raise UnsupportedCheckpointError(
            f"{folder} has no optimizer state (it was saved with save_only_model=True), so training cannot resume "
            "exactly. Load its weights with from_pretrained and start a new run instead."
        )
    with ExitStack() as stack:
        model = stack.enter_context(ComponentReader(folder, wanted_stem))
        master = stack.enter_context(ComponentReader(folder, components[MASTER]["file_stem"])) \
            if MASTER in components else model
        if master is model:
            _check_master_rebuild(folder, manifest, model, engine, options)
        optimizer = stack.enter_context(ComponentReader(folder, components[OPTIMIZER]["file_stem"])) \
            if load_optimizer else None
        engine.load(LoadSources(model, master, optimizer, int(manifest.get("global_step", 0))))


def _check_master_rebuild(folder: Path, manifest: dict, model: ComponentReader, engine, options) -> None:
    """The folder has no master weights. Fine if its model weights are fp32; otherwise fp32 values are rebuilt
    from low precision: allowed by `master_weight_compatible` or a `remove_master_weight` save, said once."""
    if not getattr(engine, "needs_fp32_master", lambda: False)():
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
