"""Per-rank RNG state files (`rng_state_<rank>.pth`), readable by the Trainer's own loader too."""

from __future__ import annotations

import io
import logging
import os
import random
from collections.abc import Collection

import numpy as np
import torch

from ...store import as_ref, is_file, join, read_bytes
from ...store.pickles import load_pickle

logger = logging.getLogger(__name__)


def rng_file_name(rank: int) -> str:
    return f"rng_state_{rank}.pth"


def capture_rng_state() -> dict:
    """The Python, NumPy, torch CPU (and CUDA, when present) generator states, keyed as the Trainer keys them."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _numpy_globals() -> list:
    """What NumPy's generator state pickles beyond `weights_only`'s defaults: its array-reconstruct function."""
    np_core = getattr(np, "_core", None) or np.core
    return [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_rng_file(path: str) -> dict:
    """The generator states pickled in the RNG file at `path` (a store reference), unpickled with `weights_only` and
    NumPy's array classes only: a file that needs any other global is refused, naming it."""
    return load_pickle(io.BytesIO(read_bytes(path)), str(path), _numpy_globals())


def restore_rng_state(folder: str | os.PathLike, rank: int, saved_world_size: int, world_size: int,
                      listed: Collection[str] | None = None) -> str | None:
    """Restore this rank's generators from the folder. Returns a description of what could not be restored
    exactly (when the world size changed or the rank's file is absent), for the caller to warn about once.
    `listed`: the files of a unified folder's manifest; nothing else of the folder is read (a file that is there but
    not listed counts as absent). None for a legacy folder."""
    folder = as_ref(folder)

    def present(name: str) -> bool:
        return (listed is None or name in listed) and is_file(join(folder, name))

    own = rng_file_name(rank)
    if saved_world_size == 1 and not present(own) and present("rng_state.pth"):
        own = "rng_state.pth"  # the plain Trainer's name on one process
    own_found = present(own)
    name = own if own_found else rng_file_name(0)
    path = join(folder, name)
    lost = None
    if saved_world_size != world_size or not own_found:
        lost = (f"the checkpoint was saved by {saved_world_size} rank(s) and is resumed on {world_size}: per-rank "
                f"random streams (dropout, sampling inside the model) cannot continue exactly; ranks without their "
                f"own {rng_file_name(0).replace('0', '<rank>')} continue from rank 0's stream.")
    if not present(name):
        return f"{rng_file_name(0)} is missing: random generators were not restored."
    state = read_rng_file(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])
    return lost
