"""Verify-then-load of a unified checkpoint into an engine, the same with and without a process group."""

from __future__ import annotations

import logging
from pathlib import Path

from . import dist
from .engines.base import MODEL, OPTIMIZER, EngineAdapter
from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .storage.manifest import describe_problems, read_manifest, verify_folder
from .storage.safetensors_io import ComponentReader

logger = logging.getLogger(__name__)


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


def load_checkpoint(folder: str | Path, engine: EngineAdapter, manifest: dict, load_optimizer: bool = True) -> None:
    """Load model weights and (optionally) optimizer state from a verified unified checkpoint into `engine`.

    Collective on sharded engines: all ranks must call it.
    """
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
    with ComponentReader(folder, wanted_stem) as reader:
        engine.load_model(reader)
    if not load_optimizer:
        return
    if OPTIMIZER not in components:
        raise UnsupportedCheckpointError(
            f"{folder} has no optimizer state (it was saved with save_only_model=True), so training cannot resume "
            "exactly. Load its weights with from_pretrained and start a new run instead."
        )
    with ComponentReader(folder, components[OPTIMIZER]["file_stem"]) as reader:
        engine.load_optimizer(reader)
