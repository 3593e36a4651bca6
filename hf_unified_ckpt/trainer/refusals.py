"""What `train()` refuses before anything trains, because a save would refuse it later (`refuse_unsupported`), and
the one warning about an engine other than the one asked for (`warn_engine_fallback`)."""

from __future__ import annotations

import logging
import os

from .. import dist
from ..errors import UnsupportedCheckpointError
from .engines import engine_of

logger = logging.getLogger(__name__)


def refuse_unsupported(trainer) -> None:
    """Refuse what a save of `trainer` would refuse: push_to_hub with a background save or with
    `unified_checkpoint_storage`, parameter names with '/', what the engine cannot save. Local."""
    options = trainer.args.unified_checkpoint_options
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
