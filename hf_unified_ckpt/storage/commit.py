"""Atomic commit and checkpoint-folder bookkeeping: staging, rename, newest complete, rotation.

A checkpoint is written into a hidden staging folder `.checkpoint-N.incomplete` next to its final place; its
manifest is written last inside it, then the folder is renamed to `checkpoint-N`. A job killed at any instant
leaves either no `checkpoint-N` or a complete one. When machines have their own local folders, each machine
has its own staging folder; `.writer-<rank>` marks tell which ranks share one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from .files import fsync_dir

logger = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STAGING_SUFFIX = ".incomplete"
SUPERSEDED_SUFFIX = ".superseded"
DELETING_SUFFIX = ".deleting"
WRITER_MARK = ".writer-"


def staging_dir(final: str | os.PathLike) -> Path:
    final = Path(final)
    return final.with_name(f".{final.name}{STAGING_SUFFIX}")


def prepare_staging(staging: Path) -> None:
    """Create an empty staging folder, removing what an interrupted earlier attempt left there."""
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)


def join_staging(staging: Path, attempt: str) -> None:
    """Create `staging` if it is missing and empty it of what an interrupted earlier attempt left, keeping the
    writer marks of save `attempt`. Safe when several processes run it at once on the same folder (the ranks of
    one machine, or machines sharing a folder that rank 0 does not see)."""
    staging.mkdir(parents=True, exist_ok=True)
    for entry in os.listdir(staging):
        path = staging / entry
        if _mark_attempt(path) == attempt:
            continue
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except FileNotFoundError:  # another process removed it first
            pass


def mark_writer(staging: Path, rank: int, attempt: str) -> None:
    """Leave the mark that `rank` writes into this folder for save `attempt`."""
    (staging / f"{WRITER_MARK}{rank}").write_text(attempt)


def sees_writer(staging: Path, rank: int, attempt: str) -> bool:
    """Whether this process sees `rank`'s mark for save `attempt` in `staging` (opened directly, not listed: a
    network filesystem may list a directory from a stale cache)."""
    return _mark_attempt(staging / f"{WRITER_MARK}{rank}") == attempt


def remove_writer_marks(staging: Path) -> None:
    for entry in os.listdir(staging):
        if entry.startswith(WRITER_MARK):
            (staging / entry).unlink(missing_ok=True)


def _mark_attempt(path: Path) -> str | None:
    if not path.name.startswith(WRITER_MARK):
        return None
    try:
        return path.read_text()
    except OSError:
        return None


def commit(staging: Path, final: Path) -> None:
    """Move a fully written staging folder (manifest included) into place as `final`, durably."""
    aside = final.with_name(f".{final.name}{SUPERSEDED_SUFFIX}")
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        logger.warning("Replacing the existing %s with the checkpoint just written for the same step.", final)
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def remove_stale(run_dir: str | os.PathLike, keep: Path | None = None) -> list[Path]:
    """Remove staging/superseded/deleting folders that interrupted saves or rotations left behind (no save in
    flight), except `keep`."""
    removed = []
    for path in Path(run_dir).glob(".checkpoint-*"):
        if path == keep:
            continue
        if path.is_dir() and path.name.endswith((STAGING_SUFFIX, SUPERSEDED_SUFFIX, DELETING_SUFFIX)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """`checkpoint-N` folders of `run_dir`, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for path in run_dir.iterdir():
        match = CHECKPOINT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)
