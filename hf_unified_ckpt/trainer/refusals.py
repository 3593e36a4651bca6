"""What `train()` refuses before anything trains, because a save would refuse it later (`refuse_unsupported`), and
the one warning about an engine other than the one asked for (`warn_engine_fallback`)."""

from __future__ import annotations

import logging
import os

from .. import dist
from ..errors import UnsupportedCheckpointError
from .engines import engine_of

logger = logging.getLogger(__name__)


#: The base Trainer's methods its native `_save_checkpoint` calls to write a checkpoint: the unified save writes
#: those files itself, so a trainer class's override of one would never run during a save.
NATIVE_WRITES = ("save_model", "_save", "_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state")


def refuse_unsupported(trainer) -> None:
    """Refuse what a save of `trainer` would refuse: push_to_hub with a background save or with
    `unified_checkpoint_storage`, parameter names with '/', a trainer class overriding a native write
    (`refuse_native_write_overrides`), what the engine cannot save. Local."""
    options = trainer.args.unified_checkpoint_options
    if options.enabled:
        refuse_native_write_overrides(type(trainer))
    if (options.async_save or options.flash.enabled) and trainer.args.push_to_hub:
        raise UnsupportedCheckpointError(f"{'flash' if options.flash.enabled else 'async_save'} with push_to_hub "
                                         "is not supported yet: the upload would run before the background save "
                                         "commits. Drop one of them.")
    if options.storage is not None and trainer.args.push_to_hub:
        raise UnsupportedCheckpointError("unified_checkpoint_storage with push_to_hub is not supported yet: the "
                                         "Hub upload reads checkpoints from output_dir. Drop one of them.")
    slashed = [n for n, _ in trainer.model.named_parameters() if "/" in n] if options.enabled else []
    if slashed:
        raise UnsupportedCheckpointError(
            f"parameter name(s) {slashed[:5]} contain '/', which unified checkpoints reserve for optimizer keys "
            "(`<parameter name>/<state name>`). Register the parameter under a name without '/', or train "
            "without unified_checkpoint.")
    refusal = engine_of(trainer).refusal(trainer)
    if refusal:
        raise UnsupportedCheckpointError(refusal)


def refuse_native_write_overrides(cls: type) -> None:
    """Refuse a trainer class (not the plugin's own, not `transformers.Trainer`) overriding one of `NATIVE_WRITES`:
    the unified save replaces the base Trainer's native write, which is what calls them. Local."""
    import transformers

    found = [(c.__name__, name) for name in NATIVE_WRITES for c in cls.__mro__
             if c not in (transformers.Trainer, object) and not c.__module__.startswith("hf_unified_ckpt.")
             and name in vars(c)]
    if found:
        owner, name = found[0]
        raise UnsupportedCheckpointError(
            f"{owner} overrides {name}, which the base Trainer's _save_checkpoint calls to write a native checkpoint; "
            "with unified_checkpoint=True the unified save writes the checkpoint instead, so that override would "
            "never run during a save (overrides found: "
            + ", ".join(f"{o}.{n}" for o, n in found) + "). Write extra state from your _save_checkpoint after "
            "super()._save_checkpoint(model, trial) returns (into "
            "os.path.join(self._get_output_dir(trial), f'checkpoint-{self.state.global_step}'): it becomes part of "
            "the checkpoint), or train without unified_checkpoint.")


def warn_engine_fallback(trainer) -> None:
    """Warn once (rank 0) when FSDP was asked for but the engine is another (accelerate falls back to DDP on CPU
    without a word). Local."""
    engine = engine_of(trainer)
    asked = trainer.args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    if asked and not engine.fsdp and dist.rank() == 0:
        logger.warning("FSDP was requested (the fsdp argument or an accelerate FSDP config) but the model is "
                       "trained with %s: accelerate "
                       "applies FSDP only on accelerators and falls back to DDP on CPU. Checkpoints are saved "
                       "for the engine that runs.", engine.label())
