"""The `unified_checkpoint.json` manifest: what a complete checkpoint contains, and checking a folder against it.

A folder is a complete unified checkpoint exactly when its manifest is present, valid, of a known version, and
every file it lists is present with the recorded size (and checksum, when checked).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..._version import __version__
from ...errors import CorruptCheckpointError, UnsupportedCheckpointError
from .commit import COMMIT_FILE
from ...store import as_ref, join, listing, name_of, store_for
from .files import CHECKSUM_ALGORITHM, FileRecord, RangeRecord, combine_ranges, read_json, write_json
from .manifest_fields import check_index_fields, check_manifest_fields
from .safetensors_header import read_safetensors_header

MANIFEST_NAME = COMMIT_FILE
FORMAT_NAME = "hf-unified-checkpoint"
FORMAT_VERSION = 1
#: Version 2 = version 1 + codecs: written only when a component is stored through a codec (O1/O2 optimizer
#: moments, residual master weights), so that a reader of version 1, which would load codes as values, refuses it.
CODEC_FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)


@dataclass(frozen=True)
class ComponentEntry:
    """One tensor component (model / adapter / optimizer / master_weights / ema) of a checkpoint."""

    file_stem: str
    files: tuple[str, ...]
    index: str | None
    tensors: int
    bytes: int
    codec: dict | None = None  # `codec_summary` of the codec its tensors are stored with; None: stored as they are

    def as_dict(self) -> dict:
        out = {"file_stem": self.file_stem, "files": list(self.files), "index": self.index,
               "tensors": self.tensors, "bytes": self.bytes}
        return out if self.codec is None else {**out, "codec": self.codec}


def codec_summary(codec_metadata: Mapping | None) -> dict | None:
    """What the manifest records of a component's codec (its index metadata holds the full description)."""
    if codec_metadata is None:
        return None
    keep = ("name", "version", "stage", "bits", "block_size", "scale_dtype", "anchor")
    out = {k: codec_metadata[k] for k in keep if k in codec_metadata}
    return {**out, "encoded_tensors": len(codec_metadata.get("tensors", {}))}


def build_manifest(global_step: int, saved_by: Mapping, options: Mapping,
                   components: Mapping[str, ComponentEntry], files: Iterable[FileRecord]) -> dict:
    """Assemble the manifest dictionary (pure)."""
    records = sorted(files, key=lambda r: r.name)
    names = [r.name for r in records]
    if len(names) != len(set(names)):
        raise ValueError(f"two writers recorded the same file: {sorted({n for n in names if names.count(n) > 1})}")
    return {
        "format": FORMAT_NAME,
        "format_version": CODEC_FORMAT_VERSION if any(c.codec for c in components.values()) else FORMAT_VERSION,
        "library": {"name": "hf_unified_ckpt", "version": __version__},
        "global_step": int(global_step),
        "saved_by": dict(saved_by),
        "options": dict(options),
        "components": {k: v.as_dict() for k, v in components.items()},
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "files": {r.name: r.as_dict() for r in records},
    }


def write_manifest(folder: str | os.PathLike, manifest: Mapping) -> FileRecord:
    """Write the manifest (durably, atomically), only if the folder has none (a conditional put on object stores:
    two writers never both commit). Call it last: its presence commits the folder."""
    return write_json(join(folder, MANIFEST_NAME), manifest, exclusive=True)


def read_manifest(folder: str | os.PathLike) -> dict:
    """Read and validate the manifest's structure; raise a named error for an unknown version or bad names."""
    path = join(folder, MANIFEST_NAME)
    manifest = read_json(path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{path} is not a {FORMAT_NAME} manifest (its 'format' is "
            f"{manifest.get('format') if isinstance(manifest, dict) else type(manifest).__name__!r})."
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpointError(f"{path}: the field 'format_version' is {version!r}, not an integer; the file is "
                                     "corrupt or hostile (nothing was loaded from it).")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedCheckpointError(
            f"{path} has format_version {version!r}; this hf_unified_ckpt ({__version__}) reads versions "
            f"{list(SUPPORTED_VERSIONS)}. Upgrade hf_unified_ckpt to read it."
        )
    check_manifest_fields(manifest, path)
    return manifest


#: Files are checksummed in ranges of this many bytes, spread over threads and ranks, then combined.
VERIFY_CHUNK = 64 * 2**20


@dataclass(frozen=True)
class Chunk:
    """Bytes `[offset, offset + length)` of file `name`, checksummed as one task."""

    name: str
    offset: int
    length: int


def chunks_of(sizes: Mapping[str, int], chunk: int = VERIFY_CHUNK) -> list[Chunk]:
    """Every file of `sizes` (name -> recorded size) cut into ranges of at most `chunk` bytes, biggest first."""
    out = [Chunk(n, offset, min(chunk, size - offset)) for n, size in sizes.items()
           for offset in range(0, max(size, 1), chunk)]
    return sorted(out, key=lambda c: (-c.length, c.name, c.offset))


def sized_as_recorded(folder: str | os.PathLike, sizes: Mapping[str, int]) -> dict[str, int]:
    """The files of `sizes` (name -> recorded size) whose size in `folder` is the recorded one (one listing):
    only those are cut into ranges to checksum, so that a recorded size is never trusted before the file on disk
    backs it (a manifest recording 2**62 bytes allocates nothing; the size check reports the file)."""
    on_disk = listing(folder)
    return {n: size for n, size in sizes.items() if on_disk.get(n) == size}


def verify_folder(folder: str | os.PathLike, manifest: Mapping, names: Iterable[str] | None = None,
                  checksums: bool = True, show_progress: bool = False, checked_on_read: bool = False) -> list[str]:
    """Check the listed files (all by default): present, regular files of the recorded size, checksum matching,
    safetensors headers valid (`format.headers.validate_header`) and index entries plain names. With
    `checked_on_read`, files whose manifest entry has a CRC-32 per block are not checksummed here (each ranged read
    checks its blocks). Returns one message per problem (empty = good)."""
    table = manifest["files"]
    names = sorted(names if names is not None else table)
    summed = {n: table[n]["size"] for n in names if not (checked_on_read and "blocks" in table[n])}
    chunks = chunks_of(sized_as_recorded(folder, summed)) if checksums else []
    problems, records = check_share(folder, table, names, chunks, show_progress)
    return sorted(problems + checksum_problems(table, records))


def check_share(folder: str | os.PathLike, table: Mapping, names: Iterable[str], chunks: Iterable[Chunk],
                show_progress: bool = False) -> tuple[list[str], list[RangeRecord]]:
    """One process's share of a verification: the size, header and index checks of `names`, and the CRC-32 of
    each range in `chunks` (of files whose size is the recorded one), on a pool of threads (CRC-32 and reads
    release the GIL). Returns the problems and the range records (`checksum_problems` combines everyone's)."""
    folder = as_ref(folder)
    store = store_for(folder)
    tasks = [("file", n) for n in names] + [("chunk", c) for c in chunks]
    with ThreadPoolExecutor(max_workers=_verify_threads()) as pool:
        results = pool.map(lambda t: _check_file(store, folder, t[1], table) if t[0] == "file" else
                           _checksum(store, folder, t[1], table[t[1].name]["size"]), tasks)
        if show_progress:
            from tqdm.auto import tqdm  # here: tqdm.auto takes a tenth of the command line's start-up

            results = tqdm(results, total=len(tasks), desc=f"Verifying {name_of(folder)}", unit="part")
        done = list(results)
    problems = {p for (kind, _), found in zip(tasks, done) if kind == "file" for p in found}
    problems |= {r for (kind, _), r in zip(tasks, done) if kind == "chunk" and isinstance(r, str)}
    records = [r for (kind, _), r in zip(tasks, done) if kind == "chunk" and isinstance(r, RangeRecord)]
    return sorted(problems), records


def checksum_problems(table: Mapping, records: Iterable[RangeRecord]) -> list[str]:
    """Compare each file's CRC-32, combined from the ranges checksummed of it (by any rank), with the recorded
    one. A file whose ranges do not cover it (its size is wrong: reported by the size check) is skipped."""
    by_file: dict[str, list[RangeRecord]] = {}
    for record in records:
        by_file.setdefault(record.name, []).append(record)
    problems = []
    for name, ranges in sorted(by_file.items()):
        try:
            (actual,) = combine_ranges({name: table[name]["size"]}, ranges)
        except RuntimeError:
            continue
        if actual.crc32 != table[name].get(CHECKSUM_ALGORITHM):
            problems.append(f"{name}: {CHECKSUM_ALGORITHM} {actual.crc32} does not match the recorded "
                            f"{table[name].get(CHECKSUM_ALGORITHM)} (the bytes changed after the save)")
    return problems


def _verify_threads() -> int:
    per_process = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, per_process))


def _check_file(store, folder: str, name: str, table: Mapping) -> list[str]:
    ref = join(folder, name)
    try:
        problem = size_problem(name, store.size(ref), table[name]["size"])
    except OSError as e:  # not a regular file (a FIFO, a device, a link), or not readable
        return [f"{name}: {e}"]
    return [problem] if problem else _check_content(ref, table)


def _checksum(store, folder: str, chunk: Chunk, size: int) -> RangeRecord | str | None:
    """The CRC-32 of one range; None when the file is missing or not of its recorded `size` (`_check_file`
    reports it); the problem when it cannot be read (not a regular file, not readable)."""
    ref = join(folder, chunk.name)
    try:
        if store.size(ref) != size:
            return None
        crc = store.crc32(ref, chunk.offset, chunk.length)
    except OSError as e:
        return f"{chunk.name}: {e}"
    return None if crc is None else RangeRecord(chunk.name, chunk.offset, chunk.length, crc)


def size_problem(name: str, size: int | None, expected: int) -> str:
    """What verify says of a file absent (`size` None) or of the wrong size; "" when its size is the recorded one."""
    if size is None:
        return f"{name}: missing (expected {expected} bytes)"
    if size != expected:
        return f"{name}: {size} bytes on disk, expected {expected} (truncated or overwritten)"
    return ""


def _check_content(ref: str, table: Mapping) -> list[str]:
    name = name_of(ref)
    try:
        if name.endswith(".safetensors"):
            read_safetensors_header(ref)
        elif name.endswith(".safetensors.index.json"):
            _, weight_map = check_index_fields(read_json(ref, "index file"), name)
            for file in sorted(set(weight_map.values())):
                if file not in table:
                    return [f"{name}: names {file!r}, which the manifest does not list"]
    except (CorruptCheckpointError, OSError) as e:
        return [f"{name}: {e}"]
    return []


def describe_problems(folder: str | os.PathLike, problems: list[str]) -> str:
    shown = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
    return (f"checkpoint {str(folder)!r} failed verification ({len(problems)} problem(s)):\n  {shown}\n"
            "Nothing was loaded. Resume from an earlier complete checkpoint, or restore the listed files."
            + spread_hint(problems))


def spread_hint(problems: list[str]) -> str:
    """When every problem is a missing file, say where such files usually are (machine-local folders)."""
    if not problems or not all(": missing (" in p for p in problems):
        return ""
    return (" If the checkpoint was saved by a job whose machines each had a local folder, the other machines "
            "hold the missing files: resuming with all of them reads the files from there.")
