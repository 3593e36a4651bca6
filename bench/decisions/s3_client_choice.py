"""Which S3 client the object-store backend uses (issue 31): s3fs or obstore, measured on the test server.

    python bench/decisions/s3_client_choice.py [--mib 256] [--reps 5] [--json]     (obstore: pip install obstore)

Starts SeaweedFS on loopback (tests/support/s3_server.py), then per repetition, contenders alternating, uploads the same
bytes from memory as one object: s3fs `pipe_file` (multipart, 16 MiB parts, 4 in flight) and obstore `put`
(multipart, the same part size and concurrency); then a ranged GET of 8 MiB at 32 random offsets with each. Prints
the medians and obstore / s3fs. Then checks what the plugin needs beyond speed: can a *second process* upload a
part into an upload the first one began (a shared upload ID)? s3fs exposes S3's API (`call_s3("upload_part",
UploadId=...)`); obstore's public API is listed and searched for a way to do it.

LOOPBACK FIGURES against SeaweedFS on this machine (client and server share its cores), not a per-node S3 figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the test support package: `support.s3_server`

PART = 16 * 2**20
CONCURRENCY = 4


def _timed(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from support.s3_server import SeaweedS3

    import s3fs

    try:
        import obstore
        from obstore.store import S3Store as ObStore
    except ImportError:
        obstore = None
    with tempfile.TemporaryDirectory(prefix="s3-client-choice-") as tmp:
        server = SeaweedS3(Path(tmp) / "weed").start()
        try:
            server.make_bucket("choice")
            opts = server.storage_options()
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
            ob = ObStore("choice", endpoint=server.endpoint, access_key_id=opts["key"],
                         secret_access_key=opts["secret"], region="us-east-1",
                         client_options={"allow_http": True}) if obstore else None
            data = os.urandom(args.mib * 2**20)
            times: dict[str, list[float]] = {"s3fs_put": [], "obstore_put": [], "s3fs_get": [], "obstore_get": []}
            offsets = [random.Random(i).randrange(0, len(data) - 8 * 2**20) for i in range(32)]
            for rep in range(args.reps):
                order = ["s3fs", "obstore"] if rep % 2 == 0 else ["obstore", "s3fs"]
                for who in order:
                    if who == "s3fs":
                        times["s3fs_put"].append(_timed(lambda: fs.pipe_file(f"choice/s3fs-{rep}", data,
                                                                             chunksize=PART,
                                                                             max_concurrency=CONCURRENCY)))
                        times["s3fs_get"].append(_timed(lambda: [fs.cat_file(f"choice/s3fs-{rep}", start=o,
                                                                             end=o + 8 * 2**20) for o in offsets]))
                    elif ob is not None:
                        times["obstore_put"].append(_timed(lambda: obstore.put(ob, f"ob-{rep}", data, chunk_size=PART,
                                                                               max_concurrency=CONCURRENCY)))
                        times["obstore_get"].append(_timed(lambda: [obstore.get_range(ob, f"ob-{rep}", start=o,
                                                                                      length=8 * 2**20)
                                                                    for o in offsets]))
            medians = {k: statistics.median(v) for k, v in times.items() if v}
            out = {"bench": "s3_client_choice", "loopback": True, "mib": args.mib, "reps": args.reps,
                   "part_size": PART, "concurrency": CONCURRENCY, "s3fs": s3fs.__version__,
                   "obstore": getattr(obstore, "__version__", None), "medians_s": medians}
            for op in ("put", "get"):
                if f"obstore_{op}" in medians:
                    out[f"obstore_over_s3fs_{op}_time"] = medians[f"obstore_{op}"] / medians[f"s3fs_{op}"]
            out["shared_upload_id"] = {"s3fs": _shared_upload_s3fs(server, opts),
                                       "obstore": _shared_upload_obstore(obstore)}
        finally:
            server.stop()
    print(f"loopback, SeaweedFS, {args.mib} MiB object, {PART >> 20} MiB parts, {CONCURRENCY} in flight, "
          f"medians of {args.reps}:")
    for key, value in out["medians_s"].items():
        print(f"  {key:12s} {value:7.3f} s")
    for op in ("put", "get"):
        if f"obstore_over_s3fs_{op}_time" in out:
            print(f"  obstore / s3fs {op} time: {out[f'obstore_over_s3fs_{op}_time']:.2f}")
    print(f"  a second process uploads a part by upload ID: {out['shared_upload_id']}")
    if args.json:
        print(json.dumps(out))


def _shared_upload_s3fs(server, opts) -> str:
    """Begin an upload in this process, upload part 1 from a child process by its ID, complete it here."""
    import multiprocessing

    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    upload = fs.call_s3("create_multipart_upload", Bucket="choice", Key="shared")["UploadId"]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        tag = pool.apply(_child_part, (opts, upload))
    fs.call_s3("complete_multipart_upload", Bucket="choice", Key="shared", UploadId=upload,
               MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": tag}]})
    return "yes (call_s3: create_multipart_upload / upload_part / complete_multipart_upload)" if \
        fs.info("choice/shared")["size"] == 1000 else "no"


def _child_part(opts, upload) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    return fs.call_s3("upload_part", Bucket="choice", Key="shared", UploadId=upload, PartNumber=1,
                      Body=b"x" * 1000)["ETag"]


def _shared_upload_obstore(obstore) -> str:
    if obstore is None:
        return "not installed"
    names = sorted(n for n in dir(obstore) if not n.startswith("_"))
    found = [n for n in names if "multipart" in n.lower() or "part" in n.lower() or "upload" in n.lower()]
    return (f"no public call takes an upload ID (public API: {', '.join(names)})" if not found
            else f"candidates: {found}")


if __name__ == "__main__":
    main()
