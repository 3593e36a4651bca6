"""The Trainer's `best_model_checkpoint`, kept as the native Trainer keeps it while the plugin writes the folders:
decided before a save's small files are captured (`track_best`), found among committed folders (`locate_best`)."""

from __future__ import annotations

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.folder.layout import detect_layout
from ..store import join


def track_best(trainer, roots: list[str], final_dir: str) -> str | None:
    """The native `_save_checkpoint`'s bookkeeping of `best_model_checkpoint`, decided before this save's small
    files are captured, so its `trainer_state.json`, rotation's protected set and the memory tier's hold the same
    value: the folder of `best_global_step` -- this save's own `final_dir` when the best evaluation is this step's
    (native records it once the model files exist; a unified save writes them with everything else), else that
    step's committed folder in `roots` (`locate_best`), else unchanged. Returns the value before, which a failed
    save puts back. Collective: all ranks call it."""
    state = trainer.state
    before = state.best_model_checkpoint
    step = state.best_global_step
    if trainer.args.save_strategy in ("steps", "epoch", "best") and step:
        here = step == state.global_step
        state.best_model_checkpoint = final_dir if here else (locate_best(trainer, roots) or before)
    return before


def locate_best(trainer, roots: list[str]) -> str | None:
    """The committed folder of `best_global_step` in the first of `roots` that holds it (the run folder, then the
    memory tier's); None if none does. Rank 0 looks, every rank gets its answer. Collective: all ranks call it."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}"
    found = next((join(r, name) for r in roots if detect_layout(join(r, name)).committed),
                 None) if dist.rank() == 0 else None
    return dist.broadcast_object(found)
