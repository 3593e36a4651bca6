"""Atomic commit and checkpoint-folder bookkeeping: staging, publishing, listing, stale folders, through the store.

Where the store renames atomically (`LocalStore`), a checkpoint is written into a hidden staging folder
`.checkpoint-N.<host>.<pid>.<token>.incomplete` next to its final place (the owner tag `store.node.owner_tag`: a
folder of this save's own, never shared with another save of the same step); its manifest is written last inside
it, then the folder is renamed to `checkpoint-N`. Elsewhere it is written in place and its manifest, written last,
commits it. Either way a job killed at any instant leaves no `checkpoint-N` that a reader takes for complete. When
machines have their own local folders, each machine has its own staging folder; `.writer-<rank>` marks tell which
ranks share one.
"""

from __future__ import annotations

import logging
import os
import re

from ...store import (DELETING_SUFFIX, STAGING_SUFFIX, SUPERSEDED_SUFFIX, as_ref, join, local_paths_of, name_of,
                     store_for)
from ...store.node import owner_gone, owner_tag

logger = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
WRITER_MARK = ".writer-"
#: The file whose presence commits a checkpoint (`manifest.MANIFEST_NAME`; named here, which imports less).
COMMIT_FILE = "unified_checkpoint.json"


#: Seconds a hidden folder of a process on another machine must be left untouched before a clean-up takes it for
#: an interrupted one (on this machine a dead pid says so at once).
QUIET_AFTER = 3600.0


def new_tag(token: str | None = None) -> str:
    """The owner tag of a save's hidden folders (`store.node.owner_tag`: this machine, this pid, `token` or a
    random one)."""
    return owner_tag(token)


def staging_dir(final: str | os.PathLike, tag: str = "") -> str:
    """Where a save of `final` is written: a hidden sibling of this save's own (`tag`, from `new_tag`) renamed into
    place where the store renames atomically, else `final` itself (its manifest, written last, commits it)."""
    return store_for(final).stage(as_ref(final), tag)


def prepare_staging(staging: str | os.PathLike) -> None:
    """Create an empty staging folder, removing what an interrupted earlier attempt left there (an earlier
    checkpoint written in place: its manifest first)."""
    staging = as_ref(staging)
    store = store_for(staging)
    if store.is_folder(staging):
        store.retire(staging, COMMIT_FILE)
    store.make_folder(staging)


def join_staging(staging: str | os.PathLike, attempt: str) -> None:
    """Create `staging` if it is missing and empty it of what an interrupted earlier attempt left, keeping the
    writer marks of save `attempt`. Safe when several processes run it at once on the same folder (the ranks of
    one machine, or machines sharing a folder that rank 0 does not see)."""
    staging = as_ref(staging)
    store = store_for(staging)
    store.make_folder(staging)
    entries = store.list(staging)
    for entry in sorted(entries, key=lambda n: n != COMMIT_FILE):  # an earlier commit file first
        if _mark_attempt(join(staging, entry)) != attempt:
            store.remove(join(staging, entry))


def mark_writer(staging: str | os.PathLike, rank: int, attempt: str) -> None:
    """Leave the mark that `rank` writes into this folder for save `attempt`."""
    store_for(staging).put(join(staging, f"{WRITER_MARK}{rank}"), attempt.encode())


def sees_writer(staging: str | os.PathLike, rank: int, attempt: str) -> bool:
    """Whether this process sees `rank`'s mark for save `attempt` in `staging` (opened directly, not listed: a
    network filesystem may list a directory from a stale cache)."""
    return _mark_attempt(join(staging, f"{WRITER_MARK}{rank}")) == attempt


def remove_writer_marks(staging: str | os.PathLike) -> None:
    store = store_for(staging)
    for entry in store.list(as_ref(staging)):
        if entry.startswith(WRITER_MARK):
            store.remove(join(staging, entry))


def _mark_attempt(ref: str) -> str | None:
    if not name_of(ref).startswith(WRITER_MARK):
        return None
    try:
        return store_for(ref).read(ref).decode()
    except (OSError, UnicodeDecodeError):
        return None


def commit(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make a fully written staging folder (manifest included) the checkpoint `final`, durably."""
    store_for(final).publish(as_ref(staging), as_ref(final))


def remove_stale(run_dir: str | os.PathLike, keep: str | os.PathLike | None = None,
                 prefix: str = ".checkpoint-") -> list[str]:
    """Remove the staging/superseded/deleting folders (`<prefix>...`) that interrupted saves or rotations left
    behind, except `keep`, and except another live process's (`store.node.owner_gone`: a save of another job, or
    of this job's persister, is never removed under it)."""
    store, removed = store_for(run_dir), []
    keep = name_of(keep) if keep is not None else None
    paths = local_paths_of(store)
    for name, size in store.list(as_ref(run_dir)).items():
        if (name.startswith(prefix) and name != keep and size is None
                and name.endswith((STAGING_SUFFIX, SUPERSEDED_SUFFIX, DELETING_SUFFIX))):
            ref = join(run_dir, name)
            if paths is not None and not owner_gone(paths.local_path(ref), QUIET_AFTER):
                continue
            store.remove(ref)
            removed.append(ref)
    return removed


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """`checkpoint-N` folders of `run_dir`, oldest step first."""
    found = []
    for name, size in store_for(run_dir).list(as_ref(run_dir)).items():
        match = CHECKPOINT_RE.match(name)
        if match and size is None:
            found.append((int(match.group(1)), join(run_dir, name)))
    return sorted(found)
