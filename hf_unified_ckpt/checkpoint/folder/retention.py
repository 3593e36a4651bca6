"""`save_total_limit` rotation that never deletes the newest complete checkpoint or one being written."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from .layout import detect_layout
from .commit import COMMIT_FILE, list_checkpoints
from ...store import canonical, store_for

logger = logging.getLogger(__name__)


def rotate_checkpoints(run_dir: str | os.PathLike, limit: int | None, protect: Iterable[str | os.PathLike] = ()) -> list[str]:
    """Delete the oldest complete `checkpoint-N` folders beyond `limit`; return what was deleted.

    Only committed checkpoints count and only they are deleted: folders still being written are hidden staging
    folders (never matched), and incomplete `checkpoint-N` folders are left for a person to inspect. A machine's
    local folder of a checkpoint spread over several machines is committed (its manifest is there) though it
    holds only part of the files. The
    newest complete checkpoint and everything in `protect` (the best model, the one just written) are kept.
    """
    if not limit or limit <= 0:
        return []
    complete = [path for _, path in list_checkpoints(run_dir) if detect_layout(path).committed]
    if not complete:
        return []
    keep = {canonical(p) for p in protect if p} | {canonical(complete[-1])}
    excess = len(complete) - limit
    deleted = []
    for path in complete:
        if excess <= 0:
            break
        if canonical(path) in keep:
            continue
        logger.info("Deleting older checkpoint %s due to save_total_limit=%d", path, limit)
        store_for(path).retire(path, COMMIT_FILE)  # a kill mid-delete leaves no half-deleted checkpoint-N behind
        deleted.append(path)
        excess -= 1
    return deleted

