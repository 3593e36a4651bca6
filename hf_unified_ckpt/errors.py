"""Exception types. Every error names what was found, what was expected and how to fix it."""

from __future__ import annotations


class UnifiedCheckpointError(RuntimeError):
    """Base class for checkpoint errors raised by hf_unified_ckpt."""


class CorruptCheckpointError(UnifiedCheckpointError):
    """Files are missing, truncated, fail their checksum, or an index/manifest is malformed or hostile."""


class IncompleteCheckpointError(UnifiedCheckpointError):
    """The folder was never committed: its manifest is missing (the save was interrupted)."""


class UnsupportedCheckpointError(UnifiedCheckpointError):
    """The folder, engine or option is recognised but cannot be handled (yet); nothing was loaded."""


class UnsupportedOptionError(ValueError):
    """An option is valid in the format but not implemented by this version of the library."""
