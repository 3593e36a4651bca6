"""The `unified_checkpoint.json` manifest: what a complete checkpoint contains, and checking a folder against it.

A folder is a complete unified checkpoint exactly when its manifest is present, valid, of a known version, and
every file it lists is present with the recorded size (and checksum, when checked).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .files import CHECKSUM_ALGORITHM, FileRecord, check_plain_name, file_crc32, read_json, write_json
from .headers import read_safetensors_header

MANIFEST_NAME = "unified_checkpoint.json"
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
    """Write the manifest (durably, atomically). Call it last: its presence commits the folder."""
    return write_json(Path(folder) / MANIFEST_NAME, manifest)


def read_manifest(folder: str | os.PathLike) -> dict:
    """Read and validate the manifest's structure; raise a named error for an unknown version or bad names."""
    path = Path(folder) / MANIFEST_NAME
    manifest = read_json(path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{path} is not a {FORMAT_NAME} manifest (its 'format' is "
            f"{manifest.get('format') if isinstance(manifest, dict) else type(manifest).__name__!r})."
        )
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedCheckpointError(
            f"{path} has format_version {version!r}; this hf_unified_ckpt ({__version__}) reads versions "
            f"{list(SUPPORTED_VERSIONS)}. Upgrade hf_unified_ckpt to read it."
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
        raise CorruptCheckpointError(f"{path} has no valid 'files' table.")
    for name in files:
        check_plain_name(name, f"manifest {path}")
    for comp, entry in (manifest.get("components") or {}).items():
        for name in list(entry.get("files", [])) + ([entry["index"]] if entry.get("index") else []):
            check_plain_name(name, f"manifest {path} component {comp!r}")
            if name not in files:
                raise CorruptCheckpointError(f"{path}: component {comp!r} lists {name!r}, which 'files' does not.")
    return manifest


def verify_folder(folder: str | os.PathLike, manifest: Mapping, names: Iterable[str] | None = None,
                  checksums: bool = True, show_progress: bool = False) -> list[str]:
    """Check the listed files (all by default): present, of the recorded size, checksum matching, safetensors
    headers well formed and index entries plain names. Returns one message per problem (empty = good)."""
    folder = Path(folder)
    table = manifest["files"]
    todo = sorted(names if names is not None else table, key=lambda n: -table[n]["size"])  # big files first
    with ThreadPoolExecutor(max_workers=_verify_threads()) as pool:  # CRC-32 releases the GIL
        results = pool.map(lambda n: _check_file(folder, n, table, checksums), todo)
        if show_progress:
            from tqdm.auto import tqdm  # here: tqdm.auto takes a tenth of the command line's start-up

            results = tqdm(results, total=len(todo), desc=f"Verifying {folder.name}", unit="file")
        problems = [p for found in results for p in found]
    return sorted(problems)


def _verify_threads() -> int:
    per_process = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, per_process))


def _check_file(folder: Path, name: str, table: Mapping, checksums: bool) -> list[str]:
    expected = table[name]
    path = folder / name
    problem = size_problem(name, path.stat().st_size if path.is_file() else None, expected["size"])
    if problem:
        return [problem]
    if checksums:
        actual = file_crc32(path)
        if actual != expected.get(CHECKSUM_ALGORITHM):
            return [f"{name}: {CHECKSUM_ALGORITHM} {actual} does not match the recorded "
                    f"{expected.get(CHECKSUM_ALGORITHM)} (the bytes changed after the save)"]
    return _check_content(path, table)


def size_problem(name: str, size: int | None, expected: int) -> str:
    """What verify says of a file absent (`size` None) or of the wrong size; "" when its size is the recorded one."""
    if size is None:
        return f"{name}: missing (expected {expected} bytes)"
    if size != expected:
        return f"{name}: {size} bytes on disk, expected {expected} (truncated or overwritten)"
    return ""


def _check_content(path: Path, table: Mapping) -> list[str]:
    try:
        if path.name.endswith(".safetensors"):
            read_safetensors_header(path)
        elif path.name.endswith(".safetensors.index.json"):
            index = read_json(path, "index file")
            for file in set((index.get("weight_map") or {}).values()):
                check_plain_name(file, f"index {path.name}")
                if file not in table:
                    return [f"{path.name}: names {file!r}, which the manifest does not list"]
    except CorruptCheckpointError as e:
        return [f"{path.name}: {e}"]
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
