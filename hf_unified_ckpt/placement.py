"""Which machine holds which file: checkpoints whose folders are local to each machine.

Every rank looks at its own path for a checkpoint (`<output_dir>/checkpoint-N`, or the path it was given). On a
shared filesystem every rank sees every file; with machine-local folders each machine sees its own share (see
`save.py`). A checkpoint counts as complete when the union of what the ranks see covers its manifest; the ranks
that see a file are its holders, and the others read it from them (`file_service.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import dist
from .layout import UNIFIED, UNKNOWN, Layout, detect_layout
from .storage.commit import list_checkpoints
from .storage.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class Placement:
    """The holders (ranks that see the file in their folder) of every file of one checkpoint, seen by `rank`."""

    holders: Mapping[str, tuple[int, ...]]
    rank: int
    world_size: int

    def is_local(self, name: str) -> bool:
        return self.rank in self.holders.get(name, ())

    def source(self, name: str) -> int:
        """The rank this rank reads `name` from: itself when it sees the file, else one of its holders (spread
        over the holders, so the ranks of one machine ask different ranks of another)."""
        holders = self.holders[name]
        return self.rank if self.rank in holders else holders[self.rank % len(holders)]

    @property
    def everywhere(self) -> bool:
        """Every rank sees every file (one shared folder): nothing is read from another rank."""
        return all(len(h) == self.world_size for h in self.holders.values())

    def with_everywhere(self, names) -> "Placement":
        """The placement after `names` were copied into every rank's folder."""
        everyone = tuple(range(self.world_size))
        return Placement({n: everyone if n in names else h for n, h in self.holders.items()}, self.rank,
                         self.world_size)

    def verification_shares(self, sizes: Mapping[str, int]) -> dict[int, list[str]]:
        """Which rank checks which file: one holder each, biggest files first to the least loaded holder (the
        same answer on every rank)."""
        load = {r: 0 for r in range(self.world_size)}
        shares: dict[int, list[str]] = {r: [] for r in range(self.world_size)}
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            chosen = min(self.holders[name], key=lambda r: (load[r], r))
            load[chosen] += sizes[name]
            shares[chosen].append(name)
        return shares


@dataclass(frozen=True)
class Sighting:
    """What one rank sees of one checkpoint folder (its local path): the folder's layout and, for a unified
    folder, the manifest and the size of every file present."""

    layout: Layout = field(repr=False)
    sizes: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, path: Path) -> "Sighting":
        layout = detect_layout(path)
        if layout.kind != UNIFIED:
            return cls(_portable(layout))
        sizes = {}
        for name in layout.manifest["files"]:
            try:
                sizes[name] = os.stat(path / name).st_size
            except OSError:
                continue
        return cls(layout, sizes)


@dataclass(frozen=True)
class Verdict:
    """Whether the ranks together hold a complete checkpoint at one path (each rank its own copy of the path)."""

    kind: str
    complete: bool
    reason: str = ""
    manifest: dict | None = field(default=None, repr=False)
    holders: Mapping[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    missing: tuple[str, ...] = ()


def judge(sightings: list[Sighting | None]) -> Verdict:
    """Combine every rank's sighting of one checkpoint (None: the rank has no such folder). Pure."""
    unified = [(r, s) for r, s in enumerate(sightings) if s is not None and s.layout.kind == UNIFIED]
    if unified:
        return _judge_unified(unified, len(sightings))
    seen = [s for s in sightings if s is not None]
    if not seen:
        return Verdict(UNKNOWN, False, "no rank sees this folder")
    first = seen[0].layout
    if len(seen) < len(sightings) or any(s.layout.kind != first.kind for s in seen):
        return Verdict(first.kind, False, f"a {first.kind} checkpoint must be visible to every machine of the job "
                                          "(only unified checkpoints can be spread over machine-local folders)")
    bad = next((s.layout for s in seen if not s.layout.complete), None)
    return Verdict(first.kind, bad is None, bad.reason if bad else "")


def _judge_unified(unified: list[tuple[int, Sighting]], world: int) -> Verdict:
    manifest = unified[0][1].layout.manifest
    files = manifest["files"]
    if any(s.layout.manifest["files"] != files for _, s in unified[1:]):
        return Verdict(UNIFIED, False, "the machines' folders hold different saves of this step (their manifests "
                                       "differ); remove the stale copies")
    holders = {name: tuple(r for r, s in unified if s.sizes.get(name) == rec["size"]) for name, rec in files.items()}
    missing = tuple(sorted(n for n, h in holders.items() if not h))
    holders[MANIFEST_NAME] = tuple(r for r, _ in unified)
    if missing:
        shown = ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else "")
        return Verdict(UNIFIED, False, f"{len(missing)} file(s) missing from every machine's folder (absent or of "
                                       f"the wrong size): {shown}", manifest, holders, missing)
    return Verdict(UNIFIED, True, "", manifest, holders)


def judge_path(path: str | os.PathLike) -> Verdict:
    """Judge one path, each rank looking at its own copy of it. Collective: all ranks must call it."""
    path = Path(path)
    mine = Sighting.of(path) if path.is_dir() else None
    return judge(dist.all_gather_object(mine))


def newest_across_machines(run_dir: str | os.PathLike) -> tuple[int | None, Verdict | None, list[tuple[int, Verdict]]]:
    """The highest step whose `checkpoint-N` the ranks together hold completely: (step, verdict, and the newer
    steps skipped with their verdicts). Collective: all ranks must call it."""
    mine = {step: Sighting.of(path) for step, path in list_checkpoints(run_dir)}
    everyone = dist.all_gather_object(mine)
    skipped = []
    for step in sorted({s for seen in everyone for s in seen}, reverse=True):
        verdict = judge([seen.get(step) for seen in everyone])
        if verdict.complete:
            return step, verdict, skipped
        skipped.append((step, verdict))
    return None, None, skipped


def placement_of(verdict: Verdict) -> Placement:
    return Placement(dict(verdict.holders), dist.rank(), dist.world_size())


def _portable(layout: Layout) -> Layout:
    """The layout without what need not cross the process group."""
    return Layout(layout.kind, layout.path, layout.complete, layout.global_step, layout.reason)
