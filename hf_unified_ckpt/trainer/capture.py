"""The small state of a Trainer checkpoint (RNG, trainer state, scheduler, scaler, configs, tokenizer, training
args), captured as bytes when a save starts: an async save writes them later, in the background, and a persist job
carries them as data. `export_callback_states` puts the callbacks' state into the trainer state first, as the native
save does."""

from __future__ import annotations

import dataclasses
import json

from .. import dist
from ..checkpoint.folder.rng import capture_rng_state, rng_file_name
from ..store.capture import files_written_by, torch_bytes

SCHEDULER_FILE, TRAINER_STATE_FILE, ARGS_FILE, SCALER_FILE = (
    "scheduler.pt", "trainer_state.json", "training_args.bin", "scaler.pt")


def small_files(trainer, engine) -> dict[str, bytes]:
    """This rank's non-tensor files, captured now as bytes (an async save writes them later, in the
    background): its RNG state; on rank 0 also the trainer state, scheduler and scaler, configs, tokenizer and
    training args."""
    full = not trainer.args.save_only_model
    out = {rng_file_name(dist.rank()): torch_bytes(capture_rng_state())} if full else {}
    if dist.rank() != 0:
        return out
    out.update(engine.config_files())
    out.update(processing_class_files(trainer))
    out[ARGS_FILE] = torch_bytes(trainer.args)
    scaler = getattr(trainer.accelerator, "scaler", None)
    if full and trainer.lr_scheduler is not None:
        out[SCHEDULER_FILE] = torch_bytes(trainer.lr_scheduler.state_dict())
    if full and scaler is not None:
        out[SCALER_FILE] = torch_bytes(scaler.state_dict())
    out[TRAINER_STATE_FILE] = trainer_state_bytes(trainer.state)
    return out


def processing_class_files(trainer) -> dict[str, bytes]:
    """The tokenizer's (or processor's) files, as its `save_pretrained` writes them: name -> bytes."""
    if trainer.processing_class is None or not hasattr(trainer.processing_class, "save_pretrained"):
        return {}
    return files_written_by(trainer.processing_class.save_pretrained)


def trainer_state_bytes(state) -> bytes:
    """`TrainerState.save_to_json`'s bytes."""
    return (json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n").encode("utf-8")


def export_callback_states(trainer) -> None:
    """Same as the native `_save_checkpoint`: store the `ExportableState` callbacks' state in the trainer state."""
    from transformers.trainer_callback import ExportableState

    handler = trainer.callback_handler
    for cb in [c for c in handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name, cb_state = type(cb).__name__, cb.state()
        if isinstance(trainer.state.stateful_callbacks.get(name), list):
            trainer.state.stateful_callbacks[name].append(cb_state)
        else:
            trainer.state.stateful_callbacks[name] = cb_state
