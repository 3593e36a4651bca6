"""`MultipartWriter`: every rank uploads the bytes it holds of the shared files, as parts of one multipart upload
per file (object stores: `MultipartUploads`).

The strategy's steps (`writer.StorageWriter`): `set_up` (training thread): rank 0 starts one upload per file
(`start_uploads`: its IDs are sent to all ranks, and uploads that a crashed save left under the run are aborted
first). Each file's part plan (`format.parts`) is the
same on every rank: a rank holding a run of at least the store's smallest part uploads it itself; smaller runs are
handed over to the rank that uploads the part they join, point to point (`hand_overs`: each rank sends exactly its
hand-overs, to their uploaders only, and receives only those within its own parts, on a gloo group of its own, so
it never meets training's collectives). Each rank reports one `PartRecord` per part it uploaded
(offset, length, CRC-32, part number, tag); `complete`: rank 0 completes every upload from them before it puts the
manifest (`complete_uploads`) and records the parts in it (`uploaded`); `abort`: a failed save aborts them.

Memory: a part's buffer is made once a sending slot is free (its own bytes copied in, the hand-overs received
straight into it), and at most `store.uploads.UPLOAD_CONCURRENCY` parts exist at once: the extra host memory per
rank is bounded by that many parts and the HTTP stack's copies of them (measured: 222-255 MiB at 4 x 16 MiB,
`bench/bench_s3.py`). What a rank sends is views of the bytes it holds (a copy only of a hand-over that spans
several of its ranges, each below the smallest part), kept until its sends are done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ... import dist
from ...format.checksum import crc32
from ...format.aggregation import AggregatedFile, aggregate, wants_aggregation
from ...format.parts import VERIFY_BLOCK, PartPlan, block_pieces, file_runs, plan_parts
from ...format.planning import FilePlan
from ...store import MultipartUploads, join, multipart_of, store_for
from ...store.uploads import PartUploads
from ...options import AggregationOptions
from .aggregating import agreed_layout
from ..folder.files import RangeRecord, crc32_combine
from .hand_overs import Incoming, Sends, copy_held
from .reports import guarded
from .writer import assemble_whole, held_tensors, rank_ranges

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


class MultipartWriter:
    """See the module docstring. Every rank takes part in every file (`writes` is always True): the hand-overs
    are point to point, file by file in plan order. A failure on this rank is raised only after this file's
    transfers, so the other ranks never wait for it; `PersistJob.run` goes on with the remaining files after a
    failure. What each rank holds of a file is what it would write in place (`writer.assemble_whole`,
    `writer.held_tensors`); it never places a snapshot (not `writer.PlacesSnapshots`)."""

    collective_write = True

    def __init__(self, rank: int, uploads: Mapping[str, str] | None = None,
                 aggregation: AggregationOptions | None = None):
        self.rank = rank
        self.uploads = dict(uploads or {})
        self.aggregation = aggregation or AggregationOptions(mode="never")
        #: File name -> its index in the save: the tag of its hand-overs.
        self.tags: dict[str, int] = {}
        #: The files uploaded by aggregators, one part per cell (`format.aggregation`), by name.
        self.aggregated: dict[str, AggregatedFile] = {}

    def set_up(self, folder: str, files: list[FilePlan]) -> tuple[bool, object]:
        """Start one upload per file (rank 0, the IDs sent to all) and make the gloo group of the hand-overs here,
        on the training thread. Collective: all ranks must call it."""
        dist.gloo_group(GROUP, timeout=dist.default_timeout())  # a peer that hangs fails the hand-overs in time
        self.tags = {f.name: i for i, f in enumerate(files)}
        self.aggregated = aggregated_uploads(folder, files, self.aggregation)
        status = guarded(lambda: start_uploads(folder, files)) if dist.rank() == 0 else (True, None)
        status = dist.broadcast_object(status)
        if status[0]:
            self.uploads = status[1]
        return status

    def complete(self, folder: str, files: list[FilePlan], records: list) -> dict:
        """Rank 0: complete every upload from the parts the ranks reported; what the manifest records of them."""
        complete_uploads(folder, self.uploads, records)
        return uploaded(files, records, store_for(folder).capabilities, self.aggregated)

    def abort(self, folder: str) -> None:
        """Abort the unfinished uploads under `folder`."""
        multipart_store(folder).abort_uploads(folder)

    def assemble(self, engine, file: FilePlan) -> None:
        """The tensors written whole assembled on the header rank (`writer.assemble_whole`). Collective: all ranks
        must call it, in plan order."""
        assemble_whole(engine, file)

    def writes(self, file: FilePlan, rank: int) -> bool:
        return True

    def local_tensors(self, engine, file: FilePlan) -> Mapping:
        return held_tensors(engine, file, self.rank)

    def syncing(self) -> contextlib.AbstractContextManager:
        """Nothing to fsync: a part is stored once its upload returned (`write`), the file once `complete` completed
        its upload."""
        return contextlib.nullcontext()

    def part_plan(self, file: FilePlan, ref: str) -> PartPlan | AggregatedFile:
        """`file`'s parts and hand-overs: its aggregators' cells where it is aggregated, else its holders' runs."""
        if file.name in self.aggregated:
            return self.aggregated[file.name]
        capabilities = store_for(ref).capabilities
        return plan_parts(file_runs(file), capabilities.min_part_size, capabilities.part_size)

    def write(self, folder: str, file: FilePlan, tensors: Mapping) -> list[PartRecord]:
        """Upload this rank's parts of `file`, after posting the sends of the bytes it hands over; each part's
        hand-overs are received into it when it is built (`hand_overs`, point to point on the `multipart` gloo
        group). Every rank calls it for every file, in plan order. A failure to produce this rank's bytes is raised
        once its sends and receives are done (zeros sent in their place), so no other rank waits for them."""
        ref = join(folder, file.name)
        plan = self.part_plan(file, ref)
        group, tag = dist.gloo_group(GROUP, timeout=dist.default_timeout()), self.tags.get(file.name, 0)
        failure, held = None, None
        try:
            held = sorted(rank_ranges(file, self.rank, file.encoded(tensors, self.rank)), key=lambda r: r[0])
        except Exception as e:  # raised once the transfers the other ranks wait for are done
            failure = e
        sends = Sends(plan.sent_by(self.rank), held, group, tag, file.name)
        incoming = Incoming(plan.received_by(self.rank), group, tag, file.name)
        failure = failure or sends.failure
        try:
            records = self._upload(ref, file, plan, held, incoming) if failure is None else []
        finally:
            incoming.drain()  # nothing left unless this rank stopped early
            unsent = sends.wait()  # the send buffers live until here
        if failure is not None or unsent is not None:
            raise failure or unsent
        return records

    def _upload(self, ref: str, file: FilePlan, plan: PartPlan, held, incoming: Incoming) -> list[PartRecord]:
        """Build and upload this rank's parts, each from the bytes it holds and those received into it."""
        uploads, records = PartUploads(multipart_store(ref)), []
        try:
            for part in plan.uploaded_by(self.rank):
                uploads.slot()  # before the part's bytes exist: at most `concurrency` parts at once
                data = bytearray(part.end - part.start)
                if copy_held(data, part.start, held) + incoming.into(data, part.start, part.end) != len(data):
                    raise RuntimeError(f"{ref}: bytes [{part.start}, {part.end}) of part {part.number} are neither "
                                       "held by this rank nor handed over to it; the part plan and the engine's "
                                       "shards disagree.")
                records.append(_part_record(file.name, part, data, self.rank))
                uploads.submit(ref, self.uploads[file.name], part.number, data)
                del data
            tags = {number: tag for _, number, tag in uploads.results()}
        finally:
            uploads.close()
        return [dataclasses.replace(r, etag=tags[r.part]) for r in records]


def multipart_store(ref: str) -> MultipartUploads:
    """The store of `ref` as `MultipartUploads` (this writer is chosen only where it is one)."""
    store = multipart_of(store_for(ref))
    if store is None:
        raise TypeError(f"{ref}: its store has no multipart uploads (it is not a store.MultipartUploads)")
    return store


def _part_record(name: str, part, data: bytes, rank: int) -> PartRecord:
    """The record of `part` (its bytes `data`): CRC-32 per block piece, and of the whole part combined from them."""
    view, blocks, crc = memoryview(data), [], 0
    for offset, length in block_pieces(part.start, part.end):
        piece = crc32(view[offset - part.start:offset - part.start + length])
        blocks.append((offset, length, piece))
        crc = crc32_combine(crc, piece, length)
    return PartRecord(name, part.start, len(data), crc, part.number, rank=rank, blocks=tuple(blocks))


def start_uploads(staging: str, files: list[FilePlan]) -> dict[str, str]:
    """Rank 0: abort the uploads a crashed save left under the run, then start one upload per file of this save;
    file name -> upload ID."""
    store = multipart_store(staging)
    parent = staging.rstrip("/").rpartition("/")[0]
    aborted = store.abort_uploads(parent)
    if aborted:
        logger.info("Aborted %d multipart upload(s) that an interrupted save left under %s.", len(aborted), parent)
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = pool.map(lambda f: store.start_upload(join(staging, f.name)), files)
        return {f.name: upload for f, upload in zip(files, ids)}


def complete_uploads(staging: str, uploads: Mapping[str, str], records: list) -> None:
    """Rank 0: complete every file's upload from the parts the ranks reported (before the manifest)."""
    store = multipart_store(staging)
    parts: dict[str, list[tuple[int, str]]] = {name: [] for name in uploads}
    for r in records:
        if isinstance(r, PartRecord):
            parts[r.name].append((r.part, r.etag))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda name: store.finish_upload(join(staging, name), uploads[name], parts[name]), uploads))


def aggregated_uploads(folder: str, files: list[FilePlan], options: AggregationOptions) -> dict[str, AggregatedFile]:
    """The files that aggregators upload (`format.aggregation.wants_aggregation`: more uploaders than
    `options.per_file`, or the word `aggregate`), each range in cells of the store's part size, none under its
    smallest part but a file's last. Collective where any aggregation may be taken (one all-reduce)."""
    if options.mode == "never":
        return {}
    capabilities = store_for(folder).capabilities
    layout, out, index = agreed_layout(folder, options), {}, 0
    for file in files:
        if wants_aggregation(file, layout, options.mode):
            out[file.name] = plan = aggregate(file, layout, index, min_range=capabilities.min_part_size,
                                              cell_bytes=capabilities.part_size)
            index += len(plan.aggregators)
    return out


def uploaded(files: list[FilePlan], records: list, capabilities,
             aggregated: Mapping[str, AggregatedFile] | None = None) -> dict:
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
    aggregated = aggregated or {}
    crossed = sum(aggregated[f.name].hand_over_bytes if f.name in aggregated else
                  plan_parts(file_runs(f), min_part, part_size).hand_over_bytes for f in files)
    return {"files": entries,
            "saved_by": {"upload": {"min_part_size": min_part, "part_size": part_size, "hand_over_bytes": crossed}}}
