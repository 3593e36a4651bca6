"""Bounded JSON: every JSON file a checkpoint holds (manifest, indexes, safetensors headers, trainer state, the
memory tier's records) is parsed by `parse_json`, which refuses one larger than `MAX_JSON_BYTES`, nested deeper
than `MAX_DEPTH`, or with a key twice in one object, with a `CorruptCheckpointError` naming it. Pure: the caller
reads the bytes (and checks the size on disk before reading, `MAX_JSON_BYTES`)."""

from __future__ import annotations

import json
from collections import Counter

from ..errors import CorruptCheckpointError

#: The largest JSON file read (an index of a million tensors is about 100 MB; a safetensors header is bounded
#: apart, `checkpoint.folder.safetensors_header.MAX_HEADER`).
MAX_JSON_BYTES = 256 * 2**20
#: The deepest nesting accepted (what this library writes nests 6 deep at most; a trainer state about 4).
MAX_DEPTH = 64


def parse_json(data: bytes | bytearray | memoryview | str, where: str, max_bytes: int = MAX_JSON_BYTES):
    """The value of JSON text `data` (UTF-8 bytes or text) from `where` (say which file: "manifest '/x/u.json'"),
    checked against the bounds of the module docstring."""
    if len(data) > max_bytes:
        raise too_large(where, len(data), max_bytes)
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        value = _loads(text)
    except RecursionError:
        raise CorruptCheckpointError(f"{where} is nested deeper than {MAX_DEPTH} levels; the file is corrupt or "
                                     "hostile (nothing was loaded from it).") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e}); the file is corrupt.") from e
    _check_depth(value, where)
    return value


def too_large(where: str, size: int, max_bytes: int = MAX_JSON_BYTES) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where} is {size} bytes, more than the {max_bytes} a JSON file of a checkpoint "
                                  "may be; the file is corrupt or hostile (it was not read).")


def _loads(text: str):
    return json.loads(text, object_pairs_hook=_unique_keys)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"the key {twice!r} appears twice in one object")
    return out


def _check_depth(value, where: str) -> None:
    """Containers nested at most `MAX_DEPTH` deep (walked level by level: no recursion)."""
    level, depth = [value], 0
    while containers := [item for item in level if isinstance(item, (dict, list))]:
        depth += 1
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where} is nested deeper than {MAX_DEPTH} levels; the file is corrupt or "
                                         "hostile (nothing was loaded from it).")
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
