"""`S3Store`: checkpoints in S3 or an S3-compatible object store (MinIO, Ceph, SeaweedFS), on fsspec + s3fs.

Why s3fs: it is what the Hugging Face stack already uses for `s3://` (datasets, huggingface_hub's fsspec layer),
and it exposes the whole S3 API (`call_s3`), so several processes can upload numbered parts of one multipart upload
by a shared upload ID, and the manifest can be put conditionally (`If-None-Match: *`). obstore (Rust object_store)
is faster for many small requests but keeps a multipart upload inside one process.

There are no folders and no rename in S3: a save is written in place and committed by its manifest, put last and
only if absent; a checkpoint is removed manifest first. Every rank sees the same objects (`seen_by_all_ranks`), and
the ranks upload their own byte ranges of the shared files as parts (`start_upload` on one rank, `write_part` on
every rank, `finish_upload` on one rank; `checkpoint/write/multipart.py` plans who uploads what). S3 wants every part
but a file's last to be at least 5 MiB.

Endpoint, region and credentials come from where botocore and fsspec look for them: `AWS_*` environment
variables (`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` for an on-premises server), `~/.aws/config` and
`~/.aws/credentials`, instance roles, and fsspec's own configuration (`FSSPEC_S3_*` variables, fsspec config
files). None of them is ever copied into the training arguments, a checkpoint or a log line.

The client is made per process on first use (a forked DataLoader worker or persister builds its own: an
inherited aiohttp session would be broken), on an event loop of its own in a thread named `hf_unified_ckpt-s3`
(not fsspec's shared loop); `close()` (end of `train()`) closes the session and ends that thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import threading
from collections.abc import Iterable

from ..errors import short_read
from .base import Capabilities, ManifestCommit, RangedReads, Range, Written, as_ref, listed_name, probe_write
from .uploads import stream_upload

logger = logging.getLogger(__name__)

#: S3's smallest part but a file's last (SeaweedFS enforces it too).
MIN_PART_SIZE = 5 * 2**20
#: The part size of whole files streamed by one writer, and the target size of the parts ranks upload
#: (`Capabilities.part_size`; `uploads.UPLOAD_CONCURRENCY` of them in flight per process).
PART_SIZE = 16 * 2**20


class S3Store(RangedReads, ManifestCommit):
    """References are `s3://bucket/key...` URLs (see the module docstring). Capabilities beyond the `Store`
    protocol: `MultipartUploads`."""

    capabilities = Capabilities(atomic_rename=False, seen_by_all_ranks=True, min_part_size=MIN_PART_SIZE,
                                part_size=PART_SIZE)

    def __init__(self, scheme: str = "s3", **storage_options):
        self.scheme = scheme
        self.storage_options = storage_options
        self._fs = None
        self._loop: _LoopThread | None = None
        self._pid = None

    @property
    def fs(self):
        """This process's s3fs file system, on an event loop of its own (a thread named `hf_unified_ckpt-s3`, not
        fsspec's shared one), so that `close` ends both; rebuilt after a fork; listings never cached (other ranks
        write)."""
        if self._fs is None or self._pid != os.getpid():
            try:
                import fsspec
                import s3fs  # noqa: F401  (fsspec finds it; imported here to give the error below)
            except ImportError as e:
                raise ImportError("s3:// checkpoints need s3fs: pip install 'hf_unified_ckpt[s3]'") from e
            self._loop = _LoopThread()  # after a fork the parent's loop thread does not exist here
            self._fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                                         loop=self._loop.loop, **self.storage_options)
            self._pid = os.getpid()
        return self._fs

    def close(self) -> None:
        """Close this process's client session and end its event-loop thread (both made again on next use)."""
        fs, loop, self._fs, self._loop = self._fs, self._loop, None, None
        if fs is None or self._pid != os.getpid():
            return
        with contextlib.suppress(Exception):
            s3 = getattr(fs, "_s3", None)
            if s3 is not None:
                from fsspec.asyn import sync

                sync(loop.loop, s3.__aexit__, None, None, None)
                fs._s3 = None
        loop.stop()

    @staticmethod
    def _key(ref) -> str:
        """`bucket/key` of a reference."""
        ref = as_ref(ref)
        return ref.split("://", 1)[1].strip("/") if "://" in ref else ref.strip("/")

    @classmethod
    def _bucket_key(cls, ref) -> tuple[str, str]:
        bucket, _, key = cls._key(ref).partition("/")
        return bucket, key

    def _call(self, method: str, **kwargs):
        """One S3 request (botocore's and s3fs's retries with backoff included); an error names the object."""
        try:
            return self.fs.call_s3(method, **kwargs)
        except OSError as e:
            raise _naming(e, f"{method} {self.scheme}://{kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}") from e

    # ---- reading ------------------------------------------------------------------------------------------------
    def list(self, ref: str) -> dict[str, int | None]:
        try:
            entries = self.fs.ls(self._key(ref), detail=True, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry["name"].rstrip("/") == self._key(ref):  # the prefix itself listed as a file
                continue
            if not listed_name(name, as_ref(ref)):
                continue
            out[name] = None if entry["type"] == "directory" else int(entry["size"])
        return out

    def size(self, ref: str) -> int | None:
        bucket, key = self._bucket_key(ref)
        if not key:
            return None
        try:
            head = self._call("head_object", Bucket=bucket, Key=key)
        except (FileNotFoundError, PermissionError):
            return None
        return int(head["ContentLength"])

    def is_folder(self, ref: str) -> bool:
        bucket, key = self._bucket_key(ref)
        listed = self._call("list_objects_v2", Bucket=bucket, Prefix=key.rstrip("/") + "/" if key else "", MaxKeys=1)
        return bool(listed.get("KeyCount") or listed.get("Contents") or listed.get("CommonPrefixes"))

    def read(self, ref: str, offset: int = 0, length: int | None = None) -> bytes:
        """One GET (ranged unless the whole file is asked for)."""
        bucket, key = self._bucket_key(ref)
        if length == 0:
            return b""
        kwargs = {}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            kwargs["Range"] = f"bytes={offset}-{end}"
        try:
            response = self._call("get_object", Bucket=bucket, Key=key, **kwargs)
        except FileNotFoundError:
            raise FileNotFoundError(f"no such object: {as_ref(ref)}") from None
        from fsspec.asyn import sync

        body = response["Body"]
        try:
            data = sync(self.fs.loop, body.read)
        finally:
            body.close()
        if length is not None and len(data) != length:
            raise short_read(as_ref(ref), offset, length, len(data))
        return data

    # ---- writing ------------------------------------------------------------------------------------------------
    def put(self, ref: str, data: bytes, exclusive: bool = False) -> None:
        """One PUT (atomic in S3). `exclusive`: only if no object has that key (`If-None-Match: *`); else
        FileExistsError."""
        bucket, key = self._bucket_key(ref)
        kwargs = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
            self._call("put_object", Bucket=bucket, Key=key, Body=body, **kwargs)
        except OSError as e:
            if exclusive and _code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise FileExistsError(f"{as_ref(ref)} already exists (a conditional put was refused: another "
                                      "writer committed this checkpoint first)") from e
            raise

    def write_whole(self, ref: str, ranges: Iterable[Range], size: int, direct_io: bool = False) -> list[Written]:
        """Streamed as a multipart upload of PART_SIZE parts (one PUT when the file is smaller than a part); a
        failure aborts the upload, leaving no object."""
        return stream_upload(self, ref, ranges, size)

    def start_upload(self, ref: str) -> str:
        """Begin a multipart upload of `ref`; its upload ID, which every rank may upload parts to."""
        bucket, key = self._bucket_key(ref)
        return self._call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

    def write_part(self, ref: str, upload: str, number: int, data) -> str:
        """Upload part `number` (1-based, in offset order) of `ref` in `upload`; its ETag."""
        bucket, key = self._bucket_key(ref)
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        return self._call("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                          Body=body)["ETag"]

    def finish_upload(self, ref: str, upload: str, parts: list[tuple[int, str]]) -> None:
        """Complete `upload` from its (number, ETag) parts: the object appears whole, at once."""
        bucket, key = self._bucket_key(ref)
        listed = [{"PartNumber": n, "ETag": etag} for n, etag in sorted(parts)]
        self._call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                   MultipartUpload={"Parts": listed})

    def abort_upload(self, ref: str, upload: str) -> None:
        bucket, key = self._bucket_key(ref)
        with contextlib.suppress(FileNotFoundError):
            self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """The unfinished multipart uploads under `prefix`: (object URL, upload ID)."""
        bucket, key = self._bucket_key(prefix)
        found, marker = [], {}
        while True:
            listed = self._call("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/", **marker)
            found += [(f"{self.scheme}://{bucket}/{u['Key']}", u["UploadId"]) for u in listed.get("Uploads") or []]
            if not listed.get("IsTruncated"):
                return found
            marker = {"KeyMarker": listed["NextKeyMarker"], "UploadIdMarker": listed["NextUploadIdMarker"]}

    def abort_uploads(self, prefix: str, keep: Iterable[str] = ()) -> list[str]:
        """Abort the multipart uploads under `prefix` (left by a save that crashed), except upload IDs in `keep`;
        the URLs of those aborted."""
        aborted = []
        for ref, upload in self.uploads(prefix):
            if upload not in set(keep):
                self.abort_upload(ref, upload)
                aborted.append(ref)
        return aborted

    def check_writable(self, probe: str) -> None:
        """Raise unless the bucket of `probe` exists and object `probe` can be put and deleted (some servers create
        a missing bucket on a put: the bucket is asked for first)."""
        bucket, _ = self._bucket_key(probe)
        try:
            self._call("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist") from None
        probe_write(self, probe)

    def sync(self, ref: str) -> None:
        """A completed PUT or multipart upload is durable: nothing more to do."""

    def move(self, src: str, dst: str) -> None:
        """A copy then a delete (S3 has no rename)."""
        self.fs.copy(self._key(src), self._key(dst))
        self.fs.rm_file(self._key(src))

    def make_folder(self, ref: str) -> None:
        """Nothing: a prefix exists when an object lies under it."""

    def remove(self, ref: str) -> None:
        key = self._key(ref)
        if self.size(ref) is not None:
            self.fs.rm_file(key)
            return
        if self.is_folder(ref):
            self.fs.rm(key + "/", recursive=True)
        bucket, prefix = self._bucket_key(ref)
        if prefix:  # servers with real directories (SeaweedFS) keep listing an emptied one until its marker goes
            with contextlib.suppress(FileNotFoundError):
                self._call("delete_object", Bucket=bucket, Key=prefix.rstrip("/") + "/")


class _LoopThread:
    """An asyncio event loop running in a daemon thread of its own, until `stop`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hf_unified_ckpt-s3", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


def _naming(error: OSError, what: str) -> OSError:
    """`error` again (same class: FileNotFoundError stays one), its message led by `what`."""
    message = f"{what}: {error.strerror or error}"
    try:
        return type(error)(error.errno, message) if error.errno is not None else type(error)(message)
    except TypeError:
        return OSError(error.errno, message)


def _code(error: BaseException) -> str | None:
    """The S3 error code behind an s3fs error (s3fs raises OSError from botocore's ClientError)."""
    while error is not None:
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
        error = error.__cause__
    return None


def refuse_scheme(scheme: str):
    """The factory of URL schemes with no store yet (Google Cloud Storage, Azure Blob): a clear refusal."""
    raise ValueError(f"{scheme}:// checkpoints are not supported yet: only s3:// object storage is (S3 and "
                     "S3-compatible servers: MinIO, Ceph, SeaweedFS; Google Cloud Storage answers the S3 API at "
                     "https://storage.googleapis.com with HMAC keys, through AWS_ENDPOINT_URL_S3). Use an s3:// URL "
                     "or a local or mounted folder.")
