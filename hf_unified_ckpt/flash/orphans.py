"""Run folders of the memory tier that nothing owns any more, found when a run starts on the machine.

A job killed before its first memory save leaves `<memory_dir>/hf_unified_ckpt/<run>/lease.json` (and perhaps
its `members/` marks) with no persister to remove them: the persister is started only before the first step. A
job and its persister both killed leave their memory checkpoints. Memory (a tmpfs) is RAM: nothing may stay there
for good. A run folder is owned while its persister holds its lock, a process its lease names lives, or something
in it changed within `GRACE` seconds (a job between its first mark and its lease); else it is an orphan:

- holding no committed memory checkpoint: it is removed;
- holding some (the only copy of its newest checkpoint, maybe): a persister is started for it, which makes the
  newest durable, waits the lease timeout for a restarted job, then frees the memory (`persister.py`).
"""

from __future__ import annotations

import logging

from ..checkpoint.folder.commit import list_checkpoints
from ..checkpoint.folder.layout import detect_layout
from ..errors import CorruptCheckpointError
from ..format.bounded_json import parse_json
from ..store import is_file, join, listing, read_bytes, remove
from ..store.node import age, is_locked, is_mine, pid_alive
from .layout import CHECKPOINTS, LEASE_FILE, LOCK_FILE, RUN_FILE, TIER_FOLDER

logger = logging.getLogger(__name__)

#: Seconds after its last change during which a run folder counts as owned whatever its lease says.
GRACE = 60.0


def orphaned_runs(memory_dir: str) -> list[str]:
    """The run folders of this user under `memory_dir` that no live job or persister owns (see the module
    docstring); another user's folders are neither read nor touched. Local."""
    tier = join(memory_dir, TIER_FOLDER)
    return [join(tier, name) for name, size in sorted(listing(tier).items())
            if size is None and is_mine(join(tier, name)) and not _owned(join(tier, name))]


def holds_checkpoints(run: str) -> bool:
    """Whether `run` holds a committed memory checkpoint (and the record a persister needs to serve it)."""
    if not is_file(join(run, RUN_FILE)):
        return False
    return any(detect_layout(path).committed for _, path in list_checkpoints(join(run, CHECKPOINTS)))


def clear(run: str) -> None:
    """Remove an orphaned run folder that holds no committed checkpoint. Local."""
    logger.warning("flash: removing %s, left by a job that ended without cleaning up (no process of it lives, no "
                   "persister serves it, no memory checkpoint in it).", run)
    remove(run)


def _owned(run: str) -> bool:
    if is_locked(join(run, LOCK_FILE)):
        return True
    try:
        pids = parse_json(read_bytes(join(run, LEASE_FILE)), "a memory-tier lease").get("pids", ())
    except (OSError, CorruptCheckpointError, AttributeError):
        pids = ()
    if any(pid_alive(int(p)) for p in pids if isinstance(p, int)):
        return True
    return _quiet_for(run) < GRACE


def _quiet_for(run: str) -> float:
    """Seconds since the newest change of `run` and of what lies directly in it and in its sub-folders."""
    ages = [age(path) for folder in (run, *(join(run, n) for n, size in listing(run).items() if size is None))
            for path in (folder, *(join(folder, n) for n in listing(folder)))]
    return min((a for a in ages if a is not None), default=float("inf"))

