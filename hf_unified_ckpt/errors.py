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


def count_and_first(items, noun: str = "tensor", shown: int = 5) -> str:
    """How many `items` there are and the first few: "12 tensor(s): ['a', 'b', 'c', 'd', 'e', ...]"."""
    items = list(items)
    more = ", ..." if len(items) > shown else ""
    return f"{len(items)} {noun}(s): [{', '.join(map(repr, items[:shown]))}{more}]"


def missing_and_unexpected(missing, unexpected) -> str:
    """"missing 12 tensor(s): [...]; unexpected 1 tensor(s): [...]", each part only when not empty."""
    parts = (("missing", list(missing)), ("unexpected", list(unexpected)))
    return "; ".join(f"{what} {count_and_first(names)}" for what, names in parts if names)
