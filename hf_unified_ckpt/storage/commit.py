"""Atomic commit and checkpoint-folder bookkeeping: staging, rename, newest complete, rotation.

A checkpoint is written into a hidden staging folder `.checkpoint-N.incomplete` next to its final place; its
manifest is written last inside it, then the folder is renamed to `checkpoint-N`. A job killed at any instant
leaves either no `checkpoint-N` or a complete one.
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


def staging_dir(final: str | os.PathLike) -> Path:
    final = Path(final)
    return final.with_name(f".{final.name}{STAGING_SUFFIX}")


def prepare_staging(staging: Path) -> None:
    """Create an empty staging folder, removing what an interrupted earlier attempt left there."""
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)


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


def remove_stale(run_dir: str | os.PathLike) -> list[Path]:
    """Remove staging/superseded/deleting folders that interrupted saves or rotations left behind (rank 0,
    no save in flight)."""
    removed = []
    for path in Path(run_dir).glob(".checkpoint-*"):
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
