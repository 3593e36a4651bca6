"""Uploads to a store with multipart uploads (`base.MultipartUploads`, S3's): a bounded pool of part uploads
(`PartUploads`: the parts ranks upload, `checkpoint/write/multipart.py`) and a file streamed whole by one writer
(`stream_upload`), both holding at most `part_size * UPLOAD_CONCURRENCY` bytes of parts in flight, the part size
the store's (`Capabilities.part_size`). Nothing here knows a concrete store: `s3.py` imports this module, never the
reverse."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from ..format.checksum import crc32
from .base import MultipartUploads, Range, Written

#: Parts one process uploads at once. Extra host memory per process: each part in flight and the HTTP stack's
#: copies of it, measured 222-255 MiB at 16 MiB x 4 on S3 (bench/bench_s3.py; s3fs's own upload: 131-148 MiB).
UPLOAD_CONCURRENCY = 4


class PartUploads:
    """Parts of one or more multipart uploads sent by a few threads, at most `concurrency` in flight. A caller
    takes a slot (`slot()`) *before* it builds a part's bytes and hands them to `submit`, so at most `concurrency`
    parts exist at once (and the HTTP stack's copy of each in flight: about 2 x concurrency x part size in all).
    `results` waits for all and raises the first failure, naming the object and the part."""

    def __init__(self, store: MultipartUploads, concurrency: int = UPLOAD_CONCURRENCY):
        self.store = store
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="s3-part")
        self._futures: list[tuple[str, int, Future]] = []

    def slot(self) -> None:
        """Wait for a free slot; the next `submit` uses it."""
        self._slots.acquire()

    def submit(self, ref: str, upload: str, number: int, data: bytes | bytearray) -> None:
        """Send part `number` in the slot taken by `slot()`."""
        future = self._pool.submit(self._send, ref, upload, number, data)
        self._futures.append((ref, number, future))

    def _send(self, ref, upload, number, data) -> str:
        try:
            return self.store.write_part(ref, upload, number, data)
        finally:
            self._slots.release()

    def results(self) -> list[tuple[str, int, str]]:
        """(ref, part number, ETag) of every part, once all are uploaded."""
        try:
            out = []
            for ref, number, future in self._futures:
                try:
                    out.append((ref, number, future.result()))
                except Exception as e:
                    raise OSError(f"uploading part {number} of {ref} failed: {type(e).__name__}: {e}") from e
            return out
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def stream_upload(store, ref: str, ranges: Iterable[Range], size: int) -> list[Written]:
    """Create object `ref` of `store` (a `Store` with `MultipartUploads`) from `ranges` (offset order, tiling
    [0, size)): one `put` below a part, else a multipart upload of `store.capabilities.part_size` parts, aborted on
    any failure (no object appears). Each part's bytes are copied once, from the ranges into the part, whatever the
    ranges' sizes."""
    part_size = store.capabilities.part_size
    written, end, pending = [], 0, bytearray()
    upload, parts, number = None, None, 0
    try:
        for offset, data in ranges:
            if offset != end:
                raise ValueError(f"{ref}: a range starts at byte {offset}, expected {end} (gap or overlap)")
            view = memoryview(data).cast("B")
            written.append((offset, len(view), crc32(view)))
            end += len(view)
            while view:
                take = min(part_size - len(pending), len(view))
                pending += view[:take]
                view = view[take:]
                if len(pending) == part_size:  # every part but the last is part_size (>= min_part_size)
                    if upload is None:
                        upload, parts = store.start_upload(ref), PartUploads(store)
                    parts.slot()
                    number += 1
                    parts.submit(ref, upload, number, pending)
                    pending = bytearray()
        if end != size:
            raise ValueError(f"{ref}: the ranges end at {end}, the file is {size} bytes")
        if upload is None:
            store.put(ref, pending)
            return written
        if pending:
            parts.slot()
            number += 1
            parts.submit(ref, upload, number, pending)
        store.finish_upload(ref, upload, [(n, etag) for _, n, etag in parts.results()])
    except BaseException:
        if parts is not None:
            parts.close()
        if upload is not None:
            store.abort_upload(ref, upload)
        raise
    return written
