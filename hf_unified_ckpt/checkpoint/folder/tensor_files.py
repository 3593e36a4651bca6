"""A safetensors file's tensors, opened above the store (`open_tensors`): reading tensors is not a store's job.

Where the store has local paths (`store.LocalPaths`), the file is memory-mapped by `safe_open` through the store
(`store.open_mapped_tensors`: the path never leaves the store); a local checkpoint is verified whole before it is
loaded, so no block table is checked. Elsewhere it is read by byte ranges over `Store.read` (`ranged.RangedFile`),
each range checked against the manifest's CRC-32 per block where there are some.
"""

from __future__ import annotations

import os

from ...format.reader import FileHandle
from ...store import as_ref, local_paths_of, open_mapped_tensors, store_for
from .ranged import RangedFile


def open_tensors(ref: str | os.PathLike, blocks: dict | None = None) -> FileHandle:
    """A lazy handle on safetensors file `ref`: tensors or slices of them read when asked for. `blocks`: the
    manifest's CRC-32 per block of the file ({"size", "crc32"}), checked on every ranged read (unused where the
    file is memory-mapped)."""
    ref = as_ref(ref)
    store = store_for(ref)
    local = local_paths_of(store)
    if local is not None:
        return open_mapped_tensors(local, ref)
    return RangedFile(store, ref, blocks)
