"""Make one committed memory checkpoint durable: copy its files into the durable store, each file's CRC-32
checked against the memory manifest as it is written, and commit with the manifest last, so the durable
`checkpoint-N` is either complete or absent (a persister killed mid-copy leaves a staging folder that the next
persister of the same save reuses, or a save removes once it has been left untouched for an hour, or an uncommitted
prefix in object storage that nothing picks). The staging folder is named after the save
(`.checkpoint-N.persist-<manifest CRC-32>.incomplete`), so every machine's persister finds the same one and no other
save shares it.

Several machines: each machine's memory folder holds the small files rank 0 wrote, its ranks' own small files
(RNG state) and its share of the tensor files. The machine of rank 0 (the leader) prepares the durable staging
folder and leaves a start mark; every other machine's persister waits for it, copies what it holds and leaves a
done mark; the leader copies what it holds, waits for every done mark, then writes the manifest and commits. The
durable storage must be one that every machine sees (a shared filesystem or a bucket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..checkpoint.folder.commit import commit, prepare_staging, staging_dir
from ..checkpoint.folder.files import crc32_combine
from ..checkpoint.folder.manifest import MANIFEST_NAME, read_manifest
from ..checkpoint.folder.retention import rotate_checkpoints
from ..errors import CorruptCheckpointError
from ..format.checksum import crc32
from ..store import join, parent_of, read_bytes, store_for
from .layout import SaveInfo

logger = logging.getLogger(__name__)

#: Bytes read from memory and written per range.
CHUNK = 64 * 2**20
START_MARK = ".persist-start-"
DONE_MARK = ".persist-done-"
POLL = 0.2


def persist_checkpoint(memory_ckpt: str, info: SaveInfo, still_wanted: Callable[[], bool] = lambda: True,
                       timeout: float = 600.0, direct_io: bool = True) -> None:
    """Copy `memory_ckpt` to `info.durable_final` (see the module docstring; `direct_io`: large files past the page
    cache where the durable store allows it); raise on a damaged file, or when another machine's share did not
    arrive within `timeout` seconds. Local I/O only (no collective)."""
    manifest_bytes = read_bytes(join(memory_ckpt, MANIFEST_NAME))
    attempt = f"{crc32(manifest_bytes):08x}"
    table = read_manifest(memory_ckpt)["files"]  # validated (the bytes above are what is copied)
    staging = staging_dir(info.durable_final, f"persist-{attempt}")  # this save's own, the same on every machine
    store = store_for(staging)
    here = store_for(memory_ckpt).list(memory_ckpt)
    if info.leader:
        prepare_staging(staging)
        store.put(join(staging, f"{START_MARK}{attempt}"), b"")
        mine = [n for n in table if n in here]
    else:
        _wait_for(lambda: store.size(join(staging, f"{START_MARK}{attempt}")) is not None, timeout, still_wanted,
                  f"the leader's start of {info.durable_final}")
        mine = [n for n in table if n in here]
    for name in sorted(mine):
        _copy_file(join(memory_ckpt, name), join(staging, name), table[name], direct_io)
    if not info.leader:
        store.put(join(staging, f"{DONE_MARK}{info.node}-{attempt}"), b"")
        return
    others = [n for n in info.nodes if n != info.node]
    _wait_for(lambda: all(store.size(join(staging, f"{DONE_MARK}{n}-{attempt}")) is not None for n in others),
              timeout, still_wanted, f"the other machines' shares of {info.durable_final}")
    missing = sorted(set(table) - set(store.list(staging)))
    if missing:
        raise CorruptCheckpointError(f"persisting {memory_ckpt}: no machine holds {missing}.")
    for mark in [n for n in store.list(staging) if n.startswith((START_MARK, DONE_MARK))]:
        store.remove(join(staging, mark))
    store.put(join(staging, MANIFEST_NAME), manifest_bytes)
    commit(staging, info.durable_final)
    rotate_checkpoints(parent_of(info.durable_final), info.save_total_limit, protect=info.protect)


def _copy_file(src: str, dst: str, record: dict, direct_io: bool) -> None:
    """Copy `src` to `dst` durably; its CRC-32 must equal the manifest's. A file up to `CHUNK` bytes is put
    atomically (the small files rank 0 wrote are in every machine's folder, and machines may copy them at once), a
    larger one streamed (a tensor file lies in one machine's folder only): mapped from memory and written from the
    mapping with direct I/O where the durable store allows it. This matters on a machine that trains beside the
    copy: reading into fresh buffers and filling fresh page cache cost 0.7-1.7 s of CPU per 600 MB on this VM,
    mapped + direct 0.15 s (`bench/persist_copy.py`)."""
    size = record["size"]
    source = store_for(src)
    if size <= CHUNK:
        data = source.read(src)
        if f"{crc32(data):08x}" != record["crc32"] or len(data) != size:
            raise CorruptCheckpointError(f"{src} does not match its manifest (CRC-32 {crc32(data):08x}, expected "
                                         f"{record['crc32']}): the memory copy is damaged; it is not made durable.")
        store_for(dst).put(dst, data)
        return

    if source.size(src) != size:
        raise CorruptCheckpointError(f"{src} is {source.size(src)} bytes, its manifest says {size}: the memory copy "
                                     "is damaged; it is not made durable.")
    target = store_for(dst)
    written = target.write_whole(dst, source.read_chunks(src, CHUNK), size, direct_io=direct_io)
    crc = 0
    for _, length, part in written:
        crc = crc32_combine(crc, part, length)
    if f"{crc:08x}" != record["crc32"]:
        target.remove(dst)
        raise CorruptCheckpointError(f"{src} does not match its manifest (CRC-32 {crc:08x}, expected "
                                     f"{record['crc32']}): the memory copy is damaged; it is not made durable.")
    target.sync(dst)


def _wait_for(ready: Callable[[], bool], timeout: float, still_wanted: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or not still_wanted():
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f} s.")
        time.sleep(POLL)
