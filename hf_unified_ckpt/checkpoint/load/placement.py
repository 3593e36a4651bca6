"""Which machine holds which file: checkpoints whose folders are local to each machine.

Every rank looks at its own path for a checkpoint (`<output_dir>/checkpoint-N`, or the path it was given). On a
shared filesystem every rank sees every file; with machine-local folders each machine sees its own share (see
`save/saving.py`). A checkpoint counts as complete when the union of what the ranks see covers its manifest; the ranks
that see a file are its holders, and the others read it from them (`file_service.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ... import dist
from ...store import as_ref, is_folder, listing
from ..folder.layout import UNIFIED, UNKNOWN, Layout, detect_layout
from ..folder.commit import list_checkpoints
from ..folder.manifest import MANIFEST_NAME, describe_problems, size_problem


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
        return self.held_by_all(self.holders)

    def held_by_all(self, names) -> bool:
        return all(len(self.holders[n]) == self.world_size for n in names)

    def with_everywhere(self, names) -> "Placement":
        """The placement after `names` were copied into every rank's folder."""
        everyone = tuple(range(self.world_size))
        return Placement({n: everyone if n in names else h for n, h in self.holders.items()}, self.rank,
                         self.world_size)

    def verification_shares(self, work) -> dict[int, list]:
        """Which rank checks what: `work` is a mapping of file name -> size (whole files) or a list of
        `checkpoint.folder.manifest.Chunk`s (byte ranges); each item goes to one holder of its file, biggest first to
        the least loaded holder (the same answer on every rank)."""
        items = [(n, size, 0, n) for n, size in work.items()] if isinstance(work, Mapping) else \
            [(c.name, c.length, c.offset, c) for c in work]
        load = {r: 0 for r in range(self.world_size)}
        shares: dict[int, list] = {r: [] for r in range(self.world_size)}
        for name, size, _, item in sorted(items, key=lambda t: (-t[1], t[0], t[2])):
            chosen = min(self.holders[name], key=lambda r: (load[r], r))
            load[chosen] += size
            shares[chosen].append(item)
        return shares


@dataclass(frozen=True)
class Sighting:
    """What one rank sees of one checkpoint folder (its local path), compact enough to all-gather: the folder's
    layout and, for a unified folder, a digest of its manifest's file table, which of those files are present
    with their recorded size (a bitmap over the sorted names) and the size on disk of those present with another
    size ((index in the sorted names, size) pairs; normally none)."""

    layout: Layout = field(repr=False)
    digest: str | None = None
    present: bytes = b""
    wrong_sizes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, path: str) -> tuple["Sighting", dict | None]:
        """The sighting and, for a unified folder, its manifest (which stays on this rank)."""
        layout = detect_layout(path)
        if layout.kind != UNIFIED:
            return cls(_portable(layout)), None
        files, sizes = layout.manifest["files"], listing(path)
        bits, wrong = bytearray((len(files) + 7) // 8), []
        for i, name in enumerate(sorted(files)):
            size = sizes.get(name)
            if size is None:
                continue
            if size == files[name]["size"]:
                bits[i // 8] |= 1 << (i % 8)
            else:
                wrong.append((i, size))
        return cls(_portable(layout), _digest(files), bytes(bits), tuple(wrong)), layout.manifest


@dataclass(frozen=True)
class Verdict:
    """Whether the ranks together hold a complete checkpoint at one path (each rank its own copy of the path).
    `problems`: when every rank sees the same folder (one process, or one shared folder), what `hf-unified-ckpt
    verify` says of each file it lacks whole."""

    kind: str
    complete: bool
    reason: str = ""
    manifest: dict | None = field(default=None, repr=False)
    holders: Mapping[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    missing: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def refusal(self, path) -> str:
        """The error for resuming from `path` (not complete): what is wrong and what to do, naming machines only
        when the ranks see more than one folder."""
        if self.problems:
            return describe_problems(path, list(self.problems))
        return (f"{path} is not a complete unified checkpoint across the machines of this job: {self.reason}. "
                f"Copy the missing files into {path} on any machine of the job (each machine may hold a part), or "
                "resume from an earlier checkpoint (resume_from_checkpoint=True picks the newest complete one).")


def judge(sightings: list[Sighting | None], manifest: dict | None = None) -> Verdict:
    """Combine every rank's sighting of one checkpoint (None: the rank has no such folder). `manifest`: the one
    of the lowest rank with a unified sighting (needed when there is one). Pure."""
    unified = [(r, s) for r, s in enumerate(sightings) if s is not None and s.layout.kind == UNIFIED]
    if unified:
        return _judge_unified(unified, manifest, _one_folder(sightings))
    seen = [s for s in sightings if s is not None]
    if not seen:
        return Verdict(UNKNOWN, False, "no rank sees this folder")
    first = seen[0].layout
    if len(seen) < len(sightings) or any(s.layout.kind != first.kind for s in seen):
        return Verdict(first.kind, False, f"a {first.kind} checkpoint must be visible to every machine of the job "
                                          "(only unified checkpoints can be spread over machine-local folders)")
    bad = next((s.layout for s in seen if not s.layout.complete), None)
    return Verdict(first.kind, bad is None, bad.reason if bad else "")


def _one_folder(sightings: list[Sighting | None]) -> bool:
    """Every rank sees the same folder (one process, or one shared folder): no machines to talk about."""
    first = sightings[0]
    return first is not None and all(s is not None and (s.digest, s.present, s.wrong_sizes) ==
                                     (first.digest, first.present, first.wrong_sizes) for s in sightings)


def _judge_unified(unified: list[tuple[int, Sighting]], manifest: dict, one_folder: bool) -> Verdict:
    files = manifest["files"]
    if any(s.digest != unified[0][1].digest for _, s in unified[1:]):
        return Verdict(UNIFIED, False, "the machines' folders hold different saves of this step (their manifests "
                                       "differ); remove the stale copies")
    names = sorted(files)
    holders = {name: tuple(r for r, s in unified if s.present[i // 8] >> (i % 8) & 1) for i, name in enumerate(names)}
    missing = tuple(n for n in names if not holders[n])
    holders[MANIFEST_NAME] = tuple(r for r, _ in unified)
    if not missing:
        return Verdict(UNIFIED, True, "", manifest, holders)
    wrong = [dict(s.wrong_sizes) for _, s in unified]
    lacking = [(i, n) for i, n in enumerate(names) if not holders[n]]
    if one_folder:  # the folder every rank sees, in verify's words
        problems = tuple(size_problem(n, wrong[0].get(i), files[n]["size"]) for i, n in lacking)
        return Verdict(UNIFIED, False, f"{len(missing)} file(s) missing or damaged: {_shown(problems, '; ')}",
                       manifest, holders, missing, problems)
    shown = [_with_sizes(n, sorted({w[i] for w in wrong if i in w}), files[n]["size"]) for i, n in lacking]
    return Verdict(UNIFIED, False, f"{len(missing)} file(s) missing from every machine's folder (absent or of the "
                                   f"wrong size): {_shown(shown, ', ')}", manifest, holders, missing)


def _with_sizes(name: str, sizes: list[int], expected: int) -> str:
    """`name`, with the wrong sizes some folders have it at."""
    return f"{name} ({' or '.join(map(str, sizes))} bytes on disk, expected {expected})" if sizes else name


def _shown(items, sep: str) -> str:
    return sep.join(items[:20]) + (f"{sep}..." if len(items) > 20 else "")


def judge_path(path: str | os.PathLike) -> Verdict:
    """Judge one path, each rank looking at its own copy of it. Collective: all ranks must call it."""
    path = as_ref(path)
    mine, manifest = Sighting.of(path) if is_folder(path) else (None, None)
    everyone = dist.all_gather_object(mine)
    return judge(everyone, _reference_manifest(everyone, manifest))


def newest_across_machines(run_dir: str | os.PathLike) -> tuple[int | None, Verdict | None, list[tuple[int, Verdict]]]:
    """The highest step whose `checkpoint-N` the ranks together hold completely: (step, verdict, and the newer
    steps skipped with their verdicts). Collective: all ranks must call it."""
    mine = {step: Sighting.of(path) for step, path in list_checkpoints(run_dir)}
    everyone = dist.all_gather_object({step: sighting for step, (sighting, _) in mine.items()})
    skipped = []
    for step in sorted({s for seen in everyone for s in seen}, reverse=True):
        sightings = [seen.get(step) for seen in everyone]
        verdict = judge(sightings, _reference_manifest(sightings, mine.get(step, (None, None))[1]))
        if verdict.complete:
            return step, verdict, skipped
        skipped.append((step, verdict))
    return None, None, skipped


def _reference_manifest(sightings: list[Sighting | None], mine: dict | None) -> dict | None:
    """The manifest of the lowest rank with a unified sighting, sent to all. Collective when there is one (the
    same decision on every rank)."""
    source = next((r for r, s in enumerate(sightings) if s is not None and s.layout.kind == UNIFIED), None)
    if source is None:
        return None
    return dist.broadcast_object(mine if dist.rank() == source else None, src=source)


def _digest(files: Mapping) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def placement_of(verdict: Verdict) -> Placement:
    return Placement(dict(verdict.holders), dist.rank(), dist.world_size())


def _portable(layout: Layout) -> Layout:
    """The layout without what need not cross the process group."""
    return Layout(layout.kind, layout.path, layout.complete, layout.global_step, layout.reason)
