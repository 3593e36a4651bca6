"""What each rank reports of its part in a save, as every rank receives it: `(True, value)` or `(False, Failure)`.

A `Failure` is plain data (it crosses processes: the all-gather of a save's outcome, the writer process), with the
exception's type name and `errno`, so that what a failure was (out of space) is recognised by its number, never by
its message.
"""

from __future__ import annotations

import errno
import logging
import traceback
from dataclasses import dataclass

from ... import dist
from ...errors import UnifiedCheckpointError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """One rank's failure as every rank receives it (picklable): the exception's type name, message and `errno`
    (an `OSError`'s: out of space is recognised by it, never by the message), and where it happened."""

    rank: int
    kind: str
    message: str
    errno: int | None = None
    trace: str = ""

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}" + (f"\n{self.trace}" if self.trace else "")

    @classmethod
    def of(cls, e: BaseException, trace: str = "") -> "Failure":
        return cls(dist.rank(), type(e).__name__, str(e), e.errno if isinstance(e, OSError) else None, trace)

    @classmethod
    def said(cls, message: str) -> "Failure":
        """A failure the algorithm states itself (no exception)."""
        return cls(dist.rank(), UnifiedCheckpointError.__name__, message)


#: The errors of a full filesystem: a save with a fallback goes there instead.
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(reports) -> bool:
    """Whether a rank's report is a failure of a full filesystem (by `errno`)."""
    return any(not ok and isinstance(payload, Failure) and payload.errno in OUT_OF_SPACE for ok, payload in reports)


def guarded(fn) -> tuple[bool, object]:
    """(True, fn()) or (False, the `Failure` of the exception, naming this rank)."""
    try:
        return True, fn()
    except Exception as e:  # reported to every rank, re-raised there
        logger.debug("unified checkpoint save failed on rank %d", dist.rank(), exc_info=True)
        return False, Failure.of(e, traceback.format_exc(limit=3))
