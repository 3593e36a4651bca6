"""S3 benchmark (issue 31): unified checkpoints saved into and resumed from object storage, one process, no Trainer.

    python bench/bench_s3.py [--reps 5] [--size 50m] [--json] [--out PATH]

LOOPBACK FIGURES: the S3 server is SeaweedFS (`weed server -s3`), started by this script on 127.0.0.1 in a temporary
folder and stopped at the end; client and server share this machine's CPU cores (2 here) and disk. These are not a
per-node S3 (AWS) figure: no network, no S3 throttling, and the server's CPU competes with the client's.

The state: a plain torch stack of nn.Linear layers of odd sizes (2047 x 2039, alternating) with `--size` parameters
(20m, 50m, 100m, ...; fp32), and AdamW after one step (exp_avg, exp_avg_sq): 12 bytes a parameter, ~600 MB at 50m.
It is saved with `parse_options(unified_checkpoint=True)` (default max shard size) through `save_checkpoint` with
`ReplicatedEngine` (one process: every part of every file is uploaded by this process, `MultipartWriter`).

After one warm-up round (not counted; its checkpoint is the one every load reads), each repetition runs every
contender once, the order rotated by one each repetition; medians over `--reps`:

(a) our save into the bucket (`s3://bench/ours-<rep>/checkpoint-1`) / s3fs's own parallel multipart upload of the
    same bytes: one `S3FileSystem.pipe_file` per file of our checkpoint (sizes from our manifest's 'files' table),
    from bytes already in memory, with the same part size (store.s3.PART_SIZE) and the same parts in flight
    (`max_concurrency` = store.uploads.UPLOAD_CONCURRENCY; s3fs uploads `max_concurrency` parts at once with
    asyncio.gather). Target >= 0.9 (reported, never fails).
(b) our save into the bucket / our save of the same state into a local temporary folder (fsync included). Reported.
(c) bytes the S3 store fetched while loading (`S3Store.read` of the store instance wrapped, summing what it
    returned; counted for `load_checkpoint` only, separately from `verify_checkpoint`) / bytes of the tensors
    loaded (nbytes of the loaded model and optimizer state). Target <= 1.1. Also printed: the whole resume's
    bytes (verify + load) with verify called as the Trainer calls it for a bucket (`checked_on_read=True` where
    `verify_checkpoint` has it: files with per-block CRC-32s are checked as they are read, not read by verify),
    and with a full verify (every byte read and checksummed first).
(d) verify + load straight from the bucket (verify as the Trainer calls it) / download of the whole checkpoint
    folder (s3fs `get`, recursive, `max_concurrency` = UPLOAD_CONCURRENCY, PART_SIZE chunks) then verify + load
    from the local copy. Reported (expected < 1); also with a full verify from the bucket. Loads go into a fresh
    model + optimizer (allocated outside the timing; the first load of each kind is checked bit-exact).
(e) torch.distributed.checkpoint's `HuggingFaceStorageWriter`, weights only: `dcp.save(model.state_dict(), ...)`
    vs our save of the same model weights only (`include_optimizer=False`). The writer as shipped writes through
    DCP's local `FileSystem` (an `s3://` path would become a local folder `s3:/...`), so it is run, if at all, with
    DCP's fsspec `FileSystem` swapped in (what `FsspecWriter` uses; fsync off: a completed PUT is durable); any
    error is recorded in the JSON and the benchmark goes on.

Before every timed call: gc, malloc_trim and os.sync() (the server writes into this machine's page cache, so that
the previous contender's write-back is not timed in the next one: a first 50m run without the sync had bucket saves
of 3.9-8.4 s, with it 3.7-4.7 s). Ratios are of the medians; the median of the ratios within each repetition is
printed beside them ("per repetition"). Also recorded: CPU seconds of this process and of the server process during
every timed call (time.process_time; /proc/<pid>/stat), the peak RSS growth of each save (VmHWM of /proc/self/status
after the save minus VmRSS before it, the high-water mark reset through /proc/self/clear_refs just before), the S3
requests of the warm-up save, verify and load by method, and the upload settings (PART_SIZE, UPLOAD_CONCURRENCY).
MB = 10^6 bytes.

Prints the figures and, with --json, one JSON object as the last stdout line (also written to --out).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

DIMS = (2047, 2039)  # odd layer widths
BUCKET = "bench"
SMALL_FILES = {"trainer_state.json": b"{}"}
TARGETS = {"save_vs_s3fs": (">=", 0.9), "fetched_vs_loaded": ("<=", 1.1)}
MB = 1e6


# ---- state ----------------------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([mk]?)", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"--size: a parameter count like 20m, 50m, 100m (got {text!r})")
    return int(float(m.group(1)) * {"m": 1e6, "k": 1e3, "": 1}[m.group(2)])


def n_layers(params: int) -> int:
    per = DIMS[0] * DIMS[1] + (DIMS[0] + DIMS[1]) / 2
    return max(2, round(params / per))


def build(layers: int, seed: int = 0, empty: bool = False):
    """The model and AdamW; with `empty`, uninitialised parameters and no optimizer state (a load's target)."""
    torch.manual_seed(seed)
    kw = {"device": "meta"} if empty else {}
    model = nn.Sequential(*[nn.Linear(DIMS[i % 2], DIMS[(i + 1) % 2], **kw) for i in range(layers)])
    if empty:
        model = model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if not empty:
        model(torch.randn(3, DIMS[0])).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def state_of(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v for k, v in s.items() if torch.is_tensor(v)})
    return out


# ---- measuring ------------------------------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def settle() -> None:
    """Collect garbage, give free heap back (malloc_trim), and flush dirty pages (os.sync: the server's writes of
    the previous contender are not written back during the next one's timing)."""
    gc.collect()
    os.sync()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: The S3 server's process id (its CPU seconds are read around every timed call) and the last call's CPU seconds.
SERVER_PID: int | None = None
LAST_CPU: dict[str, float] = {}


def server_cpu() -> float:
    """CPU seconds (user + system) the server process has used so far."""
    if SERVER_PID is None:
        return 0.0
    with open(f"/proc/{SERVER_PID}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, rss: bool = False) -> tuple[float, int | None]:
    """Seconds of `fn()` and, with `rss`, its peak RSS growth (VmHWM after - VmRSS before, HWM reset first). The CPU
    seconds of this process and of the server during the call are left in LAST_CPU."""
    settle()
    before = None
    if rss:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _status("VmRSS")
    cpu, server = time.process_time(), server_cpu()
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    LAST_CPU.update(client=time.process_time() - cpu, server=server_cpu() - server)
    return took, (_status("VmHWM") - before if rss else None)


class Counting:
    """Wraps `read` and `_call` of the S3 store instance: bytes returned by `read` and requests by method, counted
    while `active`."""

    def __init__(self, store):
        self.store, self.active = store, False
        self.bytes = self.reads = 0
        self.calls: collections.Counter = collections.Counter()
        read, call = store.read, store._call

        def counted_read(ref, offset=0, length=None):
            data = read(ref, offset, length)
            if self.active:
                self.bytes += len(data)
                self.reads += 1
            return data

        def counted_call(method, **kwargs):
            if self.active:
                self.calls[method] += 1
            return call(method, **kwargs)

        store.read, store._call = counted_read, counted_call

    def __enter__(self):
        self.bytes = self.reads = 0
        self.calls = collections.Counter()
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


# ---- the bench ------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, tmp: Path, server):
        from hf_unified_ckpt.checkpoint.load.loading import load_checkpoint, verify_checkpoint
        from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint
        from hf_unified_ckpt.engines.replicated import ReplicatedEngine
        from hf_unified_ckpt.options import parse_options
        from hf_unified_ckpt.store import store_for
        from hf_unified_ckpt.store.s3 import PART_SIZE
        try:
            from hf_unified_ckpt.store.uploads import UPLOAD_CONCURRENCY
        except ImportError:  # a checkout from before the store was narrowed (issue 48)
            from hf_unified_ckpt.store.s3 import UPLOAD_CONCURRENCY

        self._save, self._request, self._engine = save_checkpoint, SaveRequest, ReplicatedEngine
        self._verify, self._load = verify_checkpoint, load_checkpoint
        import inspect

        self.checked_on_read = "checked_on_read" in inspect.signature(verify_checkpoint).parameters
        self.options = parse_options(unified_checkpoint=True)
        self.part_size, self.concurrency = PART_SIZE, UPLOAD_CONCURRENCY
        self.tmp, self.server = tmp, server
        self.bucket = server.make_bucket(BUCKET)
        self.store = store_for(self.bucket)
        self.counter = Counting(self.store)
        import s3fs

        # s3fs's own transfers: `max_concurrency` parts in flight per file (asyncio.gather of that many at a time)
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                    max_concurrency=UPLOAD_CONCURRENCY, **server.storage_options())
        self.layers = n_layers(args.size)
        self.model, self.opt = build(self.layers)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.payload: list[tuple[str, bytes]] = []
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.rss: dict[str, list[int]] = collections.defaultdict(list)
        self.cpu: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.extra: dict = {}

    # -- saves --
    def save_ours(self, final: str, include_optimizer: bool = True) -> str:
        return self._save(self._engine(self.model, self.opt),
                          self._request(final, 1, self.options, include_optimizer=include_optimizer,
                                        show_progress=False), SMALL_FILES)

    def save_s3fs(self, prefix: str) -> None:
        for name, data in self.payload:
            self.fs.pipe_file(f"{prefix}/{name}", data, chunksize=self.part_size, max_concurrency=self.concurrency)

    # -- loads --
    def verify(self, folder: str, mode: str = "full") -> dict:
        """`verify_checkpoint`; mode "trainer": as the Trainer's resume from object storage calls it
        (`checked_on_read=True` where this version has it: files with per-block CRCs are checked as they are read
        instead of read whole here); "full": every byte read and checksummed."""
        if mode == "trainer" and self.checked_on_read:
            return self._verify(folder, checked_on_read=True)
        return self._verify(folder)

    def verify_and_load(self, folder: str, mode: str = "trainer", count: bool = False):
        model, opt = build(self.layers, empty=True)
        engine = self._engine(model, opt)

        def run():
            if count:
                with self.counter as c:
                    manifest = self.verify(folder, mode)
                self.extra[f"{mode}_verify_fetch"] = {"bytes": c.bytes, "reads": c.reads, "requests": dict(c.calls)}
                with self.counter as c:
                    self._load(folder, engine, manifest, self.options)
                self.extra[f"{mode}_load_fetch"] = {"bytes": c.bytes, "reads": c.reads, "requests": dict(c.calls)}
            else:
                self._load(folder, engine, self.verify(folder, mode), self.options)

        took, _ = timed(run)
        return took, model, opt

    def download_and_load(self, folder: str, local: Path) -> float:
        model, opt = build(self.layers, empty=True)
        engine = self._engine(model, opt)
        key = folder.split("://", 1)[1]

        def run():
            self.fs.get(key + "/", str(local) + "/", recursive=True, max_concurrency=self.concurrency,
                        chunksize=self.part_size)
            self._load(str(local), engine, self._verify(str(local)), self.options)

        took, _ = timed(run)
        if not (local / "unified_checkpoint.json").is_file():
            raise RuntimeError(f"the download did not land where expected: {sorted(os.listdir(local))}")
        shutil.rmtree(local)
        return took

    # -- DCP --
    def dcp_probe(self) -> dict:
        """Whether HuggingFaceStorageWriter exists and takes an s3:// path (constructing it writes nothing)."""
        out = {"torch": torch.__version__}
        try:
            from torch.distributed.checkpoint import HuggingFaceStorageWriter
            from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
        except ImportError as e:
            out.update(available=False, error=f"{type(e).__name__}: {e}")
            return out
        writer = HuggingFaceStorageWriter(path=f"{self.bucket}/probe")
        out["available"] = True
        out["accepts_s3_url"] = isinstance(writer.fs, FsspecFileSystem)
        if not out["accepts_s3_url"]:
            out["why"] = (f"HuggingFaceStorageWriter is a FileSystemWriter over DCP's local FileSystem "
                          f"({type(writer.fs).__module__}.{type(writer.fs).__name__}): path 's3://...' becomes "
                          f"{str(writer.path)!r}, a local folder relative to the working directory (nothing "
                          "reaches the bucket). Run here with DCP's fsspec FileSystem swapped in instead.")
        return out

    def dcp_writer(self, path: str):
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

        writer = HuggingFaceStorageWriter(path=path)
        if not isinstance(writer.fs, FsspecFileSystem):
            writer.fs = FsspecFileSystem()
            writer.path = writer.fs.init_path(path, **self.server.storage_options())
            writer.sync_files = False  # fsync of an S3 stream would fall back to os.sync() of the local disk
        return writer

    def save_dcp(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.model.state_dict(), storage_writer=self.dcp_writer(path))

    # -- bucket housekeeping --
    def remove(self, ref: str) -> None:
        self.store.remove(ref)

    def files_of(self, folder: str) -> dict:
        from hf_unified_ckpt.store import read_bytes

        return json.loads(read_bytes(f"{folder}/unified_checkpoint.json"))["files"]


def warm_up(b: Bench) -> dict:
    """One round not counted: our save (requests counted, kept for every load), the payload of the s3fs baseline
    from its manifest, one baseline upload, one local save, the counted load (checked exact) and the DCP probe."""
    import numpy as np

    warm = f"{b.bucket}/warm/checkpoint-1"
    with b.counter as c:
        b.save_ours(warm)
    b.extra["save_requests"] = dict(c.calls)
    files = b.files_of(warm)
    rng = np.random.default_rng(0)
    b.payload = [(name, rng.bytes(entry["size"])) for name, entry in sorted(files.items())]
    b.save_s3fs(f"{b.bucket}/s3fs-warm")
    b.remove(f"{b.bucket}/s3fs-warm")
    local = b.save_ours(str(b.tmp / "local-warm" / "checkpoint-1"))
    shutil.rmtree(Path(local).parent)
    want = state_of(b.model, b.opt)
    for mode in ("trainer", "full") if b.checked_on_read else ("full",):
        _, model, opt = b.verify_and_load(warm, mode, count=True)
        got = state_of(model, opt)
        exact = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        if not exact:
            raise RuntimeError(f"the checkpoint loaded from the bucket ({mode}) differs from the state saved")
        loaded = sum(t.nbytes for t in got.values())
        del model, opt, got
    if not b.checked_on_read:
        b.extra["trainer_verify_fetch"], b.extra["trainer_load_fetch"] = b.extra["full_verify_fetch"], \
            b.extra["full_load_fetch"]
    parts = [p[1] for e in files.values() for p in e.get("parts", [])]
    tensors = {n: e for n, e in files.items() if n.endswith(".safetensors")}
    return {"warm": warm, "files": files, "exact": exact, "loaded_bytes": loaded,
            "ckpt_bytes": sum(e["size"] for e in files.values()),
            "tensor_file_bytes": sum(e["size"] for e in tensors.values()), "tensor_files": len(tensors),
            "parts": len(parts), "largest_part": max(parts, default=0), "smallest_part": min(parts, default=0)}


def one_rep(b: Bench, rep: int, warm: str, dcp: dict) -> None:
    bucket = b.bucket

    def ours_s3():
        t, rss = timed(lambda: b.save_ours(f"{bucket}/ours-{rep}/checkpoint-1"), rss=True)
        b.times["ours_s3"].append(t)
        b.rss["ours_s3"].append(rss)
        b.remove(f"{bucket}/ours-{rep}")

    def s3fs_pipe():
        t, rss = timed(lambda: b.save_s3fs(f"{bucket}/s3fs-{rep}"), rss=True)
        b.times["s3fs_pipe"].append(t)
        b.rss["s3fs_pipe"].append(rss)
        b.remove(f"{bucket}/s3fs-{rep}")

    def ours_local():
        folder = b.tmp / f"local-{rep}"
        t, rss = timed(lambda: b.save_ours(str(folder / "checkpoint-1")), rss=True)
        b.times["ours_local"].append(t)
        b.rss["ours_local"].append(rss)
        shutil.rmtree(folder)

    def load_s3():  # as the Trainer resumes from a bucket
        b.times["load_s3"].append(b.verify_and_load(warm, "trainer")[0])

    def load_s3_full():  # every byte checksummed by verify first, then loaded
        b.times["load_s3_full"].append(b.verify_and_load(warm, "full")[0])

    def load_download():
        b.times["download_load"].append(b.download_and_load(warm, b.tmp / f"download-{rep}"))

    def weights_ours():
        t, _ = timed(lambda: b.save_ours(f"{bucket}/weights-{rep}/checkpoint-1", include_optimizer=False))
        b.times["weights_ours"].append(t)
        b.remove(f"{bucket}/weights-{rep}")

    def weights_dcp():
        if dcp.get("error") or not dcp.get("available"):
            return
        path = f"{bucket}/dcp-{rep}"
        try:
            t, _ = timed(lambda: b.save_dcp(path))
            b.times["weights_dcp"].append(t)
            if "bytes" not in dcp:
                listed = b.fs.du(path.split("://", 1)[1], total=False)
                dcp["files"] = {p.rsplit("/", 1)[1]: s for p, s in listed.items()}
                dcp["bytes"] = sum(dcp["files"].values())
        except Exception as e:  # optional: recorded, and the benchmark goes on
            dcp["error"] = f"{type(e).__name__}: {e}"[:2000]
        finally:
            try:
                b.fs.rm(path.split("://", 1)[1], recursive=True)
            except FileNotFoundError:
                pass

    contenders = [ours_s3, s3fs_pipe, ours_local, load_s3, load_download, weights_ours, weights_dcp]
    if b.checked_on_read:
        contenders.insert(4, load_s3_full)
    k = rep % len(contenders)
    order = contenders[k:] + contenders[:k]
    for run in order:
        LAST_CPU.clear()
        before = {k: len(v) for k, v in b.times.items()}
        run()
        for name, v in b.times.items():
            if len(v) > before.get(name, 0) and LAST_CPU:
                b.cpu[name].append((LAST_CPU["client"], LAST_CPU["server"]))
    last = {name: round(v[-1], 3) for name, v in b.times.items() if len(v) == rep + 1}
    print(f"rep {rep} ({', '.join(f.__name__ for f in order)}): {json.dumps(last)}", flush=True)


def _check(value: float, key: str) -> dict:
    op, target = TARGETS[key]
    return {"value": round(value, 4), "target": target, "op": op,
            "met": bool(value <= target if op == "<=" else value >= target)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", type=parse_size, default=parse_size("50m"), metavar="N",
                        help="parameters: 20m, 50m, 100m, ...")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    size_label = next((a.split("=", 1)[-1] for a in sys.argv if a.startswith("--size=")), None) or (
        sys.argv[sys.argv.index("--size") + 1] if "--size" in sys.argv else "50m")

    from support.s3_server import SeaweedS3, weed_binary

    global SERVER_PID
    code = code_state()
    tmp = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    server = SeaweedS3(tmp / "weed").start()
    SERVER_PID = server.proc.pid
    os.environ.update(server.environment())
    try:
        weed = subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout.strip()
        import s3fs

        b = Bench(args, tmp, server)
        header = (f"LOOPBACK figures: SeaweedFS ({weed.splitlines()[0] if weed else 'weed'}) on 127.0.0.1 of this "
                  f"machine ({os.cpu_count()} CPU cores shared by client and server), not a per-node S3 figure. "
                  f"{b.params / 1e6:.1f}M fp32 parameters ({b.layers} x nn.Linear {DIMS[0]}x{DIMS[1]} alternating) "
                  f"+ AdamW; one process; PART_SIZE {b.part_size // 2**20} MiB, UPLOAD_CONCURRENCY {b.concurrency}; "
                  f"s3fs {s3fs.__version__}, torch {torch.__version__}.")
        print(header, flush=True)
        info = warm_up(b)
        dcp = b.dcp_probe()
        print(f"warm-up done: checkpoint {info['ckpt_bytes'] / MB:.1f} MB in {len(info['files'])} files "
              f"({info['tensor_files']} safetensors); save requests {b.extra['save_requests']}", flush=True)
        for rep in range(args.reps):
            one_rep(b, rep, info["warm"], dcp)
        b.remove(info["warm"])
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in b.times.items() if v}
    nbytes = info["ckpt_bytes"]
    mbs = {k: nbytes / med[k] / MB for k in ("ours_s3", "s3fs_pipe", "ours_local", "load_s3", "load_s3_full",
                                             "download_load") if k in med}
    tv, tl = b.extra["trainer_verify_fetch"], b.extra["trainer_load_fetch"]
    fv, fl = b.extra["full_verify_fetch"], b.extra["full_load_fetch"]
    loaded = info["loaded_bytes"]
    ratios = {
        "save_vs_s3fs": _check(med["s3fs_pipe"] / med["ours_s3"], "save_vs_s3fs"),  # throughput ours / s3fs
        "save_s3_vs_local": {"value": round(med["ours_s3"] / med["ours_local"], 4)},
        "fetched_vs_loaded": _check(tl["bytes"] / loaded, "fetched_vs_loaded"),
        "resume_fetched_vs_loaded": {"value": round((tv["bytes"] + tl["bytes"]) / loaded, 4),
                                     "note": "verify + load, as the Trainer resumes from a bucket"},
        "load_direct_vs_download": {"value": round(med["load_s3"] / med["download_load"], 4)},
    }
    if "load_s3_full" in med:
        ratios["load_direct_full_verify_vs_download"] = {"value": round(med["load_s3_full"] / med["download_load"], 4)}
    if med.get("weights_dcp"):
        ratios["weights_ours_vs_dcp_hf"] = {"value": round(med["weights_ours"] / med["weights_dcp"], 4)}
    pairs = {"save_vs_s3fs": ("s3fs_pipe", "ours_s3"), "save_s3_vs_local": ("ours_s3", "ours_local"),
             "load_direct_vs_download": ("load_s3", "download_load"),
             "load_direct_full_verify_vs_download": ("load_s3_full", "download_load"),
             "weights_ours_vs_dcp_hf": ("weights_ours", "weights_dcp")}
    for key, (num, den) in pairs.items():  # the ratio within each repetition (the server's noise is shared)
        if key in ratios and len(b.times[num]) == len(b.times[den]):
            each = [x / y for x, y in zip(b.times[num], b.times[den])]
            ratios[key].update(paired_median=round(statistics.median(each), 4),
                               paired=[round(x, 3) for x in each])

    def paired(key):
        c = ratios[key]
        return (f"; per repetition: median {c['paired_median']:.2f}, {min(c['paired']):.2f}-{max(c['paired']):.2f}"
                if "paired" in c else "")

    cpu = {k: {"client": round(statistics.median([x for x, _ in v]), 3),
               "server": round(statistics.median([y for _, y in v]), 3)}
           for k, v in b.cpu.items() if v}
    rss = {k: int(statistics.median(v)) for k, v in b.rss.items()}
    bound = 2 * b.concurrency * b.part_size  # the parts in flight and the HTTP stack's copy of each (store.uploads)
    bound_parts = 2 * b.concurrency * info["largest_part"]
    trainer_mode = "checked_on_read=True" if b.checked_on_read else "this version has no checked_on_read: full"

    def mark(c):
        return f"target {c['op']} {c['target']}  {'met' if c['met'] else 'NOT MET'}"

    print(f"\n{header}\nmedians of {args.reps} rotating repetitions; checkpoint {nbytes / MB:.1f} MB "
          f"({len(info['files'])} files; {info['parts']} parts of {info['smallest_part'] / 2**20:.1f}-"
          f"{info['largest_part'] / 2**20:.1f} MiB):")
    c = ratios["save_vs_s3fs"]
    print(f"(a) throughput our bucket save / s3fs pipe_file of the same bytes = {c['value']:.2f}   "
          f"({med['ours_s3']:.2f} s, {mbs['ours_s3']:.0f} MB/s vs {med['s3fs_pipe']:.2f} s, "
          f"{mbs['s3fs_pipe']:.0f} MB/s; {b.part_size // 2**20} MiB chunks, {b.concurrency} in flight"
          f"{paired('save_vs_s3fs')})   {mark(c)}")
    print(f"(b) time our bucket save / our local-disk save = {ratios['save_s3_vs_local']['value']:.2f}   "
          f"({med['ours_s3']:.2f} s, {mbs['ours_s3']:.0f} MB/s vs {med['ours_local']:.2f} s, "
          f"{mbs['ours_local']:.0f} MB/s, fsync included{paired('save_s3_vs_local')})   reported")
    c = ratios["fetched_vs_loaded"]
    print(f"(c) bytes fetched / bytes loaded, load_checkpoint only = {c['value']:.4f}   ({tl['bytes'] / MB:.1f} MB in "
          f"{tl['reads']} reads vs {loaded / MB:.1f} MB of tensors loaded)   {mark(c)}")
    print(f"    whole resume as the Trainer does it (verify {trainer_mode} + load) = "
          f"{ratios['resume_fetched_vs_loaded']['value']:.4f}   (verify fetched {tv['bytes'] / MB:.1f} MB in "
          f"{tv['reads']} reads); with a full verify first: verify {fv['bytes'] / MB:.1f} MB + load "
          f"{fl['bytes'] / MB:.1f} MB = {(fv['bytes'] + fl['bytes']) / loaded:.4f}")
    print(f"(d) time verify+load from the bucket / download + verify+load locally = "
          f"{ratios['load_direct_vs_download']['value']:.2f}   ({med['load_s3']:.2f} s, {mbs['load_s3']:.0f} MB/s "
          f"(verify {trainer_mode}) vs {med['download_load']:.2f} s, {mbs['download_load']:.0f} MB/s"
          f"{paired('load_direct_vs_download')})   "
          f"reported (expected < 1)")
    if "load_s3_full" in med:
        print(f"    with a full verify from the bucket: {ratios['load_direct_full_verify_vs_download']['value']:.2f}   "
              f"({med['load_s3_full']:.2f} s, {mbs['load_s3_full']:.0f} MB/s"
              f"{paired('load_direct_full_verify_vs_download')})")
    if "weights_ours_vs_dcp_hf" in ratios:
        wb = dcp.get("bytes", 0)
        print(f"(e) time our weights-only bucket save / DCP HuggingFaceStorageWriter (fsspec FileSystem swapped in) "
              f"= {ratios['weights_ours_vs_dcp_hf']['value']:.2f}   ({med['weights_ours']:.2f} s, "
              f"{wb / med['weights_ours'] / MB:.0f} MB/s vs {med['weights_dcp']:.2f} s, "
              f"{wb / med['weights_dcp'] / MB:.0f} MB/s, {wb / MB:.1f} MB{paired('weights_ours_vs_dcp_hf')})   "
              "reported")
    else:
        print(f"(e) DCP HuggingFaceStorageWriter: not timed: {dcp.get('error') or dcp.get('why')}")
    if dcp.get("why"):
        print(f"    note: {dcp['why']}")
    if dcp.get("error") and "weights_ours_vs_dcp_hf" in ratios:
        print(f"    error in a later repetition: {dcp['error']}")
    print(f"peak RSS growth (VmHWM after - VmRSS before, HWM reset via /proc/self/clear_refs): our bucket save "
          f"{rss['ours_s3'] / 2**20:.0f} MiB (documented estimate 2 x UPLOAD_CONCURRENCY x PART_SIZE = "
          f"{bound / 2**20:.0f} MiB; with this save's largest part {bound_parts / 2**20:.0f} MiB), s3fs pipe_file "
          f"{rss['s3fs_pipe'] / 2**20:.0f} MiB, our local save {rss['ours_local'] / 2**20:.0f} MiB")
    print("CPU seconds (medians; this process / the server): "
          + ", ".join(f"{k} {v['client']:.2f} / {v['server']:.2f}" for k, v in cpu.items()))
    print(f"S3 requests: save {b.extra['save_requests']}; verify ({trainer_mode}) {tv['requests']}; "
          f"load {tl['requests']}")
    print(f"raw figures: {json.dumps({k: [round(x, 3) for x in v] for k, v in b.times.items()})}")

    result = {
        "bench": "s3", "loopback": True, "server": weed.splitlines()[0] if weed else "SeaweedFS",
        "note": "loopback figures against SeaweedFS on this machine, client and server sharing its CPU cores; "
                "not a per-node S3 figure",
        "cpu_cores": os.cpu_count(), "size": size_label, "params": b.params, "layers": b.layers, "reps": args.reps,
        "s3fs": s3fs.__version__, "torch": torch.__version__, "code": code,
        "upload_settings": {"PART_SIZE": b.part_size, "UPLOAD_CONCURRENCY": b.concurrency,
                            "parts": info["parts"], "largest_part": info["largest_part"],
                            "smallest_part": info["smallest_part"],
                            "s3fs_baseline": f"S3FileSystem.pipe_file(chunksize={b.part_size}, "
                                             f"max_concurrency={b.concurrency}) per file, files in turn",
                            "download": f"S3FileSystem.get(recursive=True, chunksize={b.part_size}, "
                                        f"max_concurrency={b.concurrency})"},
        "verify_mode_trainer": trainer_mode,
        "bytes": {"checkpoint": nbytes, "tensor_files": info["tensor_file_bytes"], "loaded": loaded,
                  "load_fetched": tl["bytes"], "verify_fetched_trainer": tv["bytes"],
                  "verify_fetched_full": fv["bytes"], "load_fetched_after_full_verify": fl["bytes"]},
        "files": {n: e["size"] for n, e in info["files"].items()},
        "medians_s": {k: round(v, 4) for k, v in med.items()},
        "mb_per_s": {k: round(v, 1) for k, v in mbs.items()},
        "ratios": ratios, "cpu_s": cpu,
        "peak_rss_growth_bytes": rss, "peak_rss_method": "VmHWM after - VmRSS before (/proc/self/status), VmHWM "
                                                          "reset by writing 5 to /proc/self/clear_refs",
        "rss_bound_bytes": {"documented": bound, "with_largest_part": bound_parts},
        "requests": {"save": b.extra["save_requests"], "verify_trainer": tv["requests"], "load": tl["requests"],
                     "verify_full": fv["requests"]},
        "load_exact": info["exact"], "dcp": dcp, "times": {k: [round(x, 4) for x in v] for k, v in b.times.items()},
        "rss_raw": dict(b.rss),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))


def code_state() -> dict:
    """The commit and whether the package had uncommitted changes when measured (the hash of `git diff`)."""
    import hashlib

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    diff = git("diff", "HEAD", "--", "hf_unified_ckpt")
    return {"commit": git("rev-parse", "HEAD").strip(), "package_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()
            if diff else None}


if __name__ == "__main__":
    main()
