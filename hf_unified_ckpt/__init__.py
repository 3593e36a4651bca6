"""hf_unified_ckpt: engine- and world-size-independent safetensors checkpoints for the Hugging Face Trainer.

The public names below are imported on first use (PEP 562), so that importing a submodule
(`hf_unified_ckpt.checkpoint.folder.layout`, the `hf-unified-ckpt` command line) does not load transformers, accelerate
or torch.
"""

from __future__ import annotations

import importlib

from ._version import __version__

_PUBLIC = {
    "UnifiedCheckpointArguments": "arguments", "UnifiedCheckpointFields": "arguments",
    "with_unified_checkpoint": "arguments",
    "UnifiedCheckpointCallback": "trainer.attach", "UnifiedCheckpointMixin": "trainer.mixin",
    "attach": "trainer.attach",
    "Layout": "checkpoint.folder.layout", "detect_layout": "checkpoint.folder.layout",
    "newest_complete": "checkpoint.folder.layout",
    "UnifiedCheckpointOptions": "options", "parse_options": "options",
    "TrainingPreempted": "errors", "CheckpointNotFoundError": "errors", "RESUME_AUTO": "trainer.resume",
    "wait_for_saves": "trainer.hooks",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    """Import the submodule that defines public `name` and return it (cached in the package afterwards)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
