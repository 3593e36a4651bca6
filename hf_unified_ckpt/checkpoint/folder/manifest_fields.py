"""The type of every field of a manifest (`unified_checkpoint.json`) and of an index, checked before any is used:
a malformed field is a `CorruptCheckpointError` naming the file and the field, never a `TypeError` or an
`AttributeError` from the code that reads it. Pure (no I/O)."""

from __future__ import annotations

import re

from ...errors import CorruptCheckpointError
from .files import check_plain_name

_HEX8 = re.compile(r"^[0-9a-f]{8}$")


def check_manifest_fields(manifest: dict, path: str) -> None:
    """Every field of `manifest` (a dict whose `format` and `format_version` were checked) of the type the
    format gives it; the names of its files plain, and every file a component lists in its `files` table."""
    _require(_count(manifest.get("global_step", 0)), path, "global_step", "a non-negative integer")
    for key in ("library", "saved_by", "options"):
        _require(isinstance(manifest.get(key, {}), dict), path, key, "an object")
    world_size = manifest.get("saved_by", {}).get("world_size", 1)
    _require(_count(world_size) and world_size >= 1, path, "saved_by.world_size", "a positive integer")
    _require(isinstance(manifest.get("checksum_algorithm", ""), str), path, "checksum_algorithm", "a string")
    files = manifest.get("files")
    _require(isinstance(files, dict), path, "files", "an object of file name -> {size, crc32}")
    for name, entry in files.items():
        check_plain_name(name, f"manifest {path}")
        _check_file_entry(entry, path, f"files[{name!r}]")
    components = manifest.get("components", {})
    _require(isinstance(components, dict), path, "components", "an object of component name -> entry")
    for comp, entry in components.items():
        _check_component(entry, files, path, f"components[{comp!r}]")


def _check_file_entry(entry, path: str, field: str) -> None:
    _require(isinstance(entry, dict), path, field, "an object {size, crc32}")
    _require(_count(entry.get("size")), path, f"{field}.size", "a non-negative integer")
    _require(isinstance(entry.get("crc32"), str) and _HEX8.match(entry["crc32"]), path, f"{field}.crc32",
             "8 hexadecimal digits")
    if "blocks" in entry:
        blocks = entry["blocks"]
        _require(isinstance(blocks, dict) and _count(blocks.get("size")) and blocks["size"] > 0
                 and isinstance(blocks.get("crc32"), list)
                 and all(isinstance(c, str) and _HEX8.match(c) for c in blocks["crc32"])
                 and len(blocks["crc32"]) == -(-entry["size"] // blocks["size"]), path, f"{field}.blocks",
                 "{size: a positive integer, crc32: one 8-hex-digit CRC-32 per block of the file}")


def _check_component(entry, files: dict, path: str, field: str) -> None:
    _require(isinstance(entry, dict), path, field, "an object")
    _require(isinstance(entry.get("file_stem"), str) and entry["file_stem"], path, f"{field}.file_stem",
             "a non-empty string")
    _require(isinstance(entry.get("files"), list), path, f"{field}.files", "a list of file names")
    _require(entry.get("index") is None or isinstance(entry["index"], str), path, f"{field}.index",
             "a file name or null")
    for key in ("tensors", "bytes"):
        _require(_count(entry.get(key, 0)), path, f"{field}.{key}", "a non-negative integer")
    _require(entry.get("codec") is None or isinstance(entry["codec"], dict), path, f"{field}.codec",
             "an object or null")
    for name in entry["files"] + ([entry["index"]] if entry.get("index") else []):
        check_plain_name(name, f"manifest {path} {field}")
        if name not in files:
            raise CorruptCheckpointError(f"{path}: {field} lists {name!r}, which 'files' does not.")


def check_index_fields(index, path: str) -> tuple[dict, dict[str, str]]:
    """An index file's `metadata` (an object; `total_size` a non-negative integer where present) and `weight_map`
    (tensor name -> plain file name), checked."""
    _require(isinstance(index, dict), path, "(the whole file)", "an object")
    metadata, weight_map = index.get("metadata") or {}, index.get("weight_map")
    _require(isinstance(metadata, dict), path, "metadata", "an object")
    _require(_count(metadata.get("total_size", 0)), path, "metadata.total_size", "a non-negative integer")
    _require(isinstance(weight_map, dict), path, "weight_map", "an object of tensor name -> file name")
    for name, file in weight_map.items():
        check_plain_name(file, f"index {path}")
    return metadata, weight_map


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require(ok, path: str, field: str, expected: str) -> None:
    if not ok:
        raise CorruptCheckpointError(f"{path}: the field '{field}' is not {expected}; the file is corrupt or "
                                     "hostile (nothing was loaded from it).")
