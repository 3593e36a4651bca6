"""`MultipartWriter`: every rank uploads the bytes it holds of the shared files, as parts of one multipart upload
per file (object stores: `Capabilities.multipart`).

The strategy's steps (`writer.StorageWriter`): `prepare` (training thread): rank 0 begins one upload per file
(`begin_uploads`: its IDs are sent to all ranks, and uploads that a crashed save left under the run are aborted
first). Each file's part plan (`format.parts`) is the
same on every rank: a rank holding a run of at least the store's smallest part uploads it itself; smaller runs are
sent to the neighbour that uploads them (`_exchange`: one all-gather per file that has hand-overs, on a gloo group
of its own, so it never meets training's collectives). Each rank reports one `PartRecord` per part it uploaded
(offset, length, CRC-32, part number, tag); `finish`: rank 0 completes every upload from them before it puts the
manifest (`finish_uploads`) and records the parts in it (`uploaded`); `abort`: a failed save aborts them.

Memory: a part's bytes are gathered into one buffer once a sending slot is free, and at most
`store.uploads.UPLOAD_CONCURRENCY` parts exist at once: the extra host memory per rank is bounded by that many parts
and the HTTP stack's copies of them (measured: 222-255 MiB at 4 x 16 MiB, `bench/bench_s3.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import dist
from ..format.checksum import crc32
from ..format.parts import VERIFY_BLOCK, PartPlan, block_pieces, file_runs, plan_parts
from ..format.planning import FilePlan
from ..store import MultipartUploads, join, multipart_of, store_for
from ..store.uploads import PartUploads
from .files import RangeRecord, crc32_combine
from .reports import guarded
from .writer import SharedFileWriter, rank_ranges

logger = logging.getLogger(__name__)

#: The name of the gloo group that carries hand-overs (`dist.gloo_group`).
GROUP = "multipart"


@dataclass(frozen=True)
class PartRecord(RangeRecord):
    """A range one rank uploaded as part `part` of its file's upload, with the tag the store returned."""

    part: int = 0
    etag: str = ""
    rank: int = 0
    #: (offset, length, CRC-32) of the part cut at the multiples of `format.parts.VERIFY_BLOCK`.
    blocks: tuple[tuple[int, int, int], ...] = ()


class MultipartWriter(SharedFileWriter):
    """See the module docstring. Every rank takes part in every file (`writes` is always True): the hand-overs
    are collectives, in plan order. A failure on this rank is raised only after this file's exchange, so the other
    ranks never wait for it; `PersistJob.run` goes on with the exchanges of the remaining files after a failure."""

    collective_write = True

    def __init__(self, rank: int, uploads: Mapping[str, str] | None = None):
        super().__init__(rank)
        self.uploads = dict(uploads or {})

    def prepare(self, folder: str, files: list[FilePlan]) -> tuple[bool, object]:
        """Begin one upload per file (rank 0, the IDs sent to all) and make the gloo group of the hand-overs here,
        on the training thread. Collective: all ranks must call it."""
        dist.gloo_group(GROUP)
        status = guarded(lambda: begin_uploads(folder, files)) if dist.rank() == 0 else (True, None)
        status = dist.broadcast_object(status)
        if status[0]:
            self.uploads = status[1]
        return status

    def finish(self, folder: str, files: list[FilePlan], records: list) -> dict:
        """Rank 0: complete every upload from the parts the ranks reported; what the manifest records of them."""
        finish_uploads(folder, self.uploads, records)
        return uploaded(files, records, store_for(folder).capabilities)

    def abort(self, folder: str) -> None:
        """Abort the unfinished uploads under `folder`."""
        multipart_store(folder).abort_uploads(folder)

    def writes(self, file: FilePlan, rank: int) -> bool:
        return True

    def part_plan(self, file: FilePlan, ref: str) -> PartPlan:
        capabilities = store_for(ref).capabilities
        return plan_parts(file_runs(file), capabilities.min_part_size, capabilities.part_size)

    def write(self, folder: str, file: FilePlan, tensors: Mapping) -> list[PartRecord]:
        """Upload this rank's parts of `file` (after sending and receiving its hand-overs: a collective on the
        `multipart` gloo group when the plan has any)."""
        ref = join(folder, file.name)
        plan = self.part_plan(file, ref)
        failure, held = None, []
        try:
            held = list(rank_ranges(file, self.rank, file.encoded(tensors, self.rank)))
        except Exception as e:  # raised after the exchange, which the other ranks wait for
            failure = e
        received = self._exchange(file, plan, held if failure is None else None)
        if failure is not None:
            raise failure
        pieces = sorted(held + received, key=lambda r: r[0])
        uploads, records = PartUploads(multipart_store(ref)), []
        try:
            for part in plan.uploaded_by(self.rank):
                uploads.slot()  # before the part's bytes are gathered: at most `concurrency` parts exist
                data = _gather(pieces, part.start, part.end, ref)
                records.append(_part_record(file.name, part, data, self.rank))
                uploads.submit(ref, self.uploads[file.name], part.number, data)
                del data
            tags = {number: tag for _, number, tag in uploads.results()}
        finally:
            uploads.close()
        return [dataclasses.replace(r, etag=tags[r.part]) for r in records]

    def _exchange(self, file: FilePlan, plan: PartPlan, held: list | None) -> list[tuple[int, memoryview]]:
        """Send the ranges this rank hands over and receive those handed to it (nothing when the plan has no
        hand-over: the same decision on every rank). `held` None: this rank failed; it sends nothing, and a
        receiver of its bytes raises. Collective on the `multipart` gloo group when there are hand-overs."""
        if not plan.hand_overs:
            return []
        sent = {}
        if held is not None:
            pieces = sorted(held, key=lambda r: r[0])
            sent = {(h.start, h.end): _gather(pieces, h.start, h.end, file.name) for h in plan.sent_by(self.rank)}
        everyone = dist.all_gather_object(sent, group=dist.gloo_group(GROUP))
        mine = [h for h in plan.hand_overs if h.receiver == self.rank]
        try:
            return [(h.start, memoryview(everyone[h.sender][(h.start, h.end)])) for h in mine]
        except KeyError:
            raise RuntimeError(f"{file.name}: a rank that hands bytes to rank {self.rank} failed before sending "
                               "them") from None


def multipart_store(ref: str) -> MultipartUploads:
    """The store of `ref` as `MultipartUploads` (this writer is chosen only where `Capabilities.multipart`)."""
    store = multipart_of(store_for(ref))
    if store is None:
        raise TypeError(f"{ref}: its store has no multipart uploads (Capabilities.multipart is False)")
    return store


def _part_record(name: str, part, data: bytes, rank: int) -> PartRecord:
    """The record of `part` (its bytes `data`): CRC-32 per block piece, and of the whole part combined from them."""
    view, blocks, crc = memoryview(data), [], 0
    for offset, length in block_pieces(part.start, part.end):
        piece = crc32(view[offset - part.start:offset - part.start + length])
        blocks.append((offset, length, piece))
        crc = crc32_combine(crc, piece, length)
    return PartRecord(name, part.start, len(data), crc, part.number, rank=rank, blocks=tuple(blocks))


def _gather(pieces: list[tuple[int, memoryview]], start: int, end: int, what: str) -> bytearray:
    """Bytes `[start, end)` of a file from `pieces` ((offset, bytes), offset order, covering them)."""
    out, at = bytearray(), start
    for offset, data in pieces:
        stop = offset + len(data)
        if stop <= at or offset >= end:
            continue
        if offset > at:
            break
        take = data[at - offset:min(end, stop) - offset]
        out += take
        at += len(take)
        if at == end:
            return out
    raise RuntimeError(f"{what}: bytes [{at}, {end}) of a part are not held by this rank; the part plan and the "
                       "engine's shards disagree.")


def begin_uploads(staging: str, files: list[FilePlan]) -> dict[str, str]:
    """Rank 0: abort the uploads a crashed save left under the run, then begin one upload per file of this save;
    file name -> upload ID."""
    store = multipart_store(staging)
    parent = staging.rstrip("/").rpartition("/")[0]
    aborted = store.abort_uploads(parent)
    if aborted:
        logger.info("Aborted %d multipart upload(s) that an interrupted save left under %s.", len(aborted), parent)
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = pool.map(lambda f: store.start_upload(join(staging, f.name)), files)
        return {f.name: upload for f, upload in zip(files, ids)}


def finish_uploads(staging: str, uploads: Mapping[str, str], records: list) -> None:
    """Rank 0: complete every file's upload from the parts the ranks reported (before the manifest)."""
    store = multipart_store(staging)
    parts: dict[str, list[tuple[int, str]]] = {name: [] for name in uploads}
    for r in records:
        if isinstance(r, PartRecord):
            parts[r.name].append((r.part, r.etag))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda name: store.finish_upload(join(staging, name), uploads[name], parts[name]), uploads))


def uploaded(files: list[FilePlan], records: list, capabilities) -> dict:
    """What the manifest records of the ranks' uploads: per file, its parts in order as [offset, length, CRC-32
    (hex), uploading rank] and a CRC-32 per `VERIFY_BLOCK` bytes (`blocks`: a reader checks each range it fetches
    against them), and in `saved_by.upload` the part sizes and the bytes that crossed ranks (from the plan: the
    same on every rank)."""
    entries: dict[str, dict] = {}
    blocks: dict[str, dict[int, int]] = {}
    for r in sorted((r for r in records if isinstance(r, PartRecord)), key=lambda r: (r.name, r.offset)):
        entries.setdefault(r.name, {}).setdefault("parts", []).append([r.offset, r.length, f"{r.crc32:08x}", r.rank])
        table = blocks.setdefault(r.name, {})
        for offset, length, crc in r.blocks:  # in offset order: a block cut by a part boundary is combined here
            index = offset // VERIFY_BLOCK
            table[index] = crc32_combine(table[index], crc, length) if index in table else crc
    for name, table in blocks.items():
        entries[name]["blocks"] = {"size": VERIFY_BLOCK, "crc32": [f"{table[i]:08x}" for i in sorted(table)]}
    min_part, part_size = capabilities.min_part_size, capabilities.part_size
    crossed = sum(plan_parts(file_runs(f), min_part, part_size).hand_over_bytes for f in files)
    return {"files": entries,
            "saved_by": {"upload": {"min_part_size": min_part, "part_size": part_size, "hand_over_bytes": crossed}}}
