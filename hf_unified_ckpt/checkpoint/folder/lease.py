"""One job per output_dir: the lease a `train()` call takes on the folder (or URL prefix) its checkpoints go to,
before its first step, and gives back when it ends (`trainer/session.py` drives it).

Two jobs writing one folder delete each other's files and may commit a torn checkpoint; a second job is refused
instead, naming the first. The lease is a small JSON record, `_hf_unified_ckpt-lease-<generation>.json`, created
with an exclusive put (a hard link on a local or mounted folder, `If-None-Match: *` on S3): of two jobs starting
together exactly one creates it. It records who holds it (`store.node.Process`: machine, boot, pid namespace, pid,
start time) and when it was last renewed; the holder renews it from a daemon thread every `timeout / 4` seconds (at
most every 5 s, at least every 0.5 s).

A lease is stale, and is taken over, when its holder is gone: on the same machine (same boot and pid namespace) its
pid is dead or belongs to a process started at another time; elsewhere its last renewal is older than the lease
timeout (`unified_checkpoint_lease_timeout`: the machines' clocks must agree within it). A take-over creates the next
generation with the same exclusive put, so of two jobs taking over one stale lease exactly one wins; the holder's
renewal notices a newer generation and says so. A live lease makes `acquire` wait up to `unified_checkpoint_lease_wait`
seconds for it to end (a requeued job whose predecessor still saves), then refuse (`OutputDirInUseError`).

A store that ignores the exclusive put (an S3 server without conditional writes) is found by putting the new lease
exclusively a second time: where that succeeds, the folder is unprotected against two jobs starting together,
said once. Locks are not used: a lease must also work on object storage and across machines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from datetime import datetime

from ... import dist
from ...errors import OutputDirInUseError, UnifiedCheckpointError
from ...options import LeaseOptions
from ...store import join, store_for
from ...store.node import Process

logger = logging.getLogger(__name__)

PREFIX = "_hf_unified_ckpt-lease-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)\.json$")
#: Seconds between two looks at a live lease while waiting for it.
POLL = 0.5
_warned_unprotected: set[str] = set()


def lease_name(generation: int) -> str:
    return f"{PREFIX}{generation}.json"


class Lease:
    """The lease of one job on `root` (see the module docstring). Every rank of the job has one, with the job's
    `job` token; `held` on the ranks that created the record (rank 0, or each machine-local folder's first)."""

    def __init__(self, root: str, job: str, options: LeaseOptions):
        self.root, self.job, self.options = root, job, options
        self.held: str | None = None  # the record this process created and renews
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said_lost = False

    # ---- the record ------------------------------------------------------------------------------------------------
    def _record(self) -> bytes:
        return json.dumps({"job": self.job, **dataclasses.asdict(Process.this()), "renewed": time.time()}).encode()

    def current(self) -> tuple[int, str | None, dict | None]:
        """(generation, reference, record) of the newest lease under `root`: (0, None, None) when there is none; a
        record that cannot be read as a lease is {}."""
        store = store_for(self.root)
        while True:
            generations = [int(m.group(1)) for m in map(_NAME.match, store.list(self.root)) if m]
            if not generations:
                return 0, None, None
            ref = join(self.root, lease_name(max(generations)))
            try:
                record = json.loads(store.read(ref))
            except FileNotFoundError:
                continue  # released or taken over meanwhile: look again
            except (OSError, ValueError):
                record = {}
            return max(generations), ref, record if isinstance(record, dict) else {}

    def live(self, record: dict) -> bool:
        """Whether the job of `record` still holds it (see the module docstring)."""
        try:
            holder = Process(**{f.name: record[f.name] for f in dataclasses.fields(Process)})
            renewed = float(record["renewed"])
        except (KeyError, TypeError, ValueError):
            logger.warning("The lease record of %s cannot be read (%s); it is taken for a stale one.", self.root,
                           record)
            return False
        alive = holder.alive()
        if alive is None:
            return time.time() - renewed <= self.options.timeout
        return alive

    # ---- taking and giving back -------------------------------------------------------------------------------------
    def try_take(self) -> dict | None:
        """Take the lease unless another live job holds it: None when this job holds it now (created here, or by
        another process of this job), else the other job's record. Local."""
        store = store_for(self.root)
        store.make_folder(self.root)
        for _ in range(20):
            generation, ref, record = self.current()
            if record is not None and record.get("job") == self.job:
                return None
            if record is not None and self.live(record):
                return record
            mine = join(self.root, lease_name(generation + 1))
            data = self._record()
            try:
                store.put(mine, data, exclusive=True)
            except FileExistsError:
                continue  # another job took it first: look at what it wrote
            self.held = mine
            self._check_exclusive(mine, data)
            if ref is not None:
                logger.info("Took over the stale lease of %s (%s).", self.root, describe(record))
                self._remove_older(generation + 1)
            return None
        raise UnifiedCheckpointError(f"could not take the lease of {self.root}: it kept changing hands.")

    def acquire(self) -> None:
        """`try_take`, waiting up to `options.wait` seconds for a live lease to end; `OutputDirInUseError` naming
        its job when it does not. Local."""
        deadline = time.monotonic() + self.options.wait
        said = False
        while True:
            other = self.try_take()
            if other is None:
                return
            if time.monotonic() >= deadline:
                raise OutputDirInUseError(refusal(self.root, other, self.options))
            if not said:
                said = True
                logger.warning("%s is leased by another job (%s); waiting up to %.0f s for it to end "
                               "(unified_checkpoint_lease_wait).", self.root, describe(other), self.options.wait)
            time.sleep(min(POLL, max(0.0, deadline - time.monotonic())))

    def start_heartbeat(self) -> None:
        """Renew the held record from a daemon thread until `release`."""
        if self.held is None or self._thread is not None:
            return
        interval = max(0.5, min(5.0, self.options.timeout / 4))
        self._thread = threading.Thread(target=self._beat, args=(interval,), name="hf_unified_ckpt-output-lease",
                                        daemon=True)
        self._thread.start()

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.renew()
            except Exception as e:  # a failed renewal is retried at the next beat
                logger.warning("Could not renew the lease %s: %s", self.held, e)

    def renew(self) -> bool:
        """Write the held record again with the time now, unless another job took the lease over (said once, as an
        error: it judged this job gone). Local."""
        if self.held is None:
            return False
        _, ref, record = self.current()
        if ref != self.held or record is None or record.get("job") != self.job:
            if not self._said_lost:
                self._said_lost = True
                logger.error("The lease of %s was taken over by another job (%s): it took this job for gone (no "
                             "renewal for %.0f s). Two jobs may now write this folder; stop one of them.", self.root,
                             describe(record or {}), self.options.timeout)
            return False
        store_for(self.held).put(self.held, self._record())
        return True

    def release(self) -> None:
        """Stop renewing and remove the held record if it is still this job's. Local."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        held, self.held = self.held, None
        if held is None:
            return
        try:
            _, ref, record = self.current()
            if ref == held and record is not None and record.get("job") == self.job:
                store_for(held).remove(held)
        except OSError as e:
            logger.warning("Could not remove the lease %s (%s); the next job takes it for stale once this process "
                           "is gone.", held, e)

    def _remove_older(self, generation: int) -> None:
        store = store_for(self.root)
        for name in store.list(self.root):
            match = _NAME.match(name)
            if match and int(match.group(1)) < generation:
                store.remove(join(self.root, name))

    def _check_exclusive(self, ref: str, data: bytes) -> None:
        """Put `ref` exclusively again: a store that accepts it ignores exclusive puts (said once per store)."""
        try:
            store_for(ref).put(ref, data, exclusive=True)
        except FileExistsError:
            return
        scheme = ref.split("://", 1)[0] if "://" in ref else "local"
        if scheme not in _warned_unprotected:
            _warned_unprotected.add(scheme)
            logger.warning("The storage of %s ignores conditional writes (an exclusive put of an existing object "
                           "succeeded): two jobs started together on it are not kept apart. Give every job its own "
                           "output_dir / unified_checkpoint_storage.", self.root)


def take_lease(root: str, options: LeaseOptions) -> Lease:
    """Take the lease of `root` for this job before its first step: rank 0 takes it (waiting as `acquire` does) and
    every rank learns the verdict; where some ranks do not see rank 0's record (machines with their own local
    folders), the first of each such folder takes the lease there too. Raises `OutputDirInUseError` (or the error
    taking it met) on every rank; nothing is held then. Collective: all ranks call it."""
    lease = Lease(root, dist.broadcast_object(uuid.uuid4().hex if dist.rank() == 0 else None), options)
    verdict = _attempt(lease) if dist.rank() == 0 else None
    verdict = dist.broadcast_object(verdict)
    if verdict is None and dist.world_size() > 1 and not store_for(root).capabilities.seen_by_all_ranks:
        local = _attempt(lease) if dist.rank() != 0 else None  # a rank seeing rank 0's record finds it is the job's
        verdict = next((v for v in dist.all_gather_object(local) if v is not None), None)
    if verdict is not None:
        lease.release()
        kind, message = verdict
        raise (OutputDirInUseError if kind == "in use" else UnifiedCheckpointError)(message)
    lease.start_heartbeat()
    return lease


def _attempt(lease: Lease) -> tuple[str, str] | None:
    try:
        lease.acquire()
    except OutputDirInUseError as e:
        return "in use", str(e)
    except Exception as e:  # reported on every rank
        return "error", (f"could not take the lease of {lease.root} before training ({type(e).__name__}: {e}). "
                         "Check that the folder can be written; nothing was trained or saved.")
    return None


def describe(record: dict) -> str:
    """`host <h>, pid <p>, started <time>` of a lease record, for people."""
    started = record.get("started")
    when = datetime.fromtimestamp(started).isoformat(sep=" ", timespec="seconds") if isinstance(
        started, (int, float)) else "at an unknown time"
    renewed = record.get("renewed")
    ago = f", renewed {time.time() - renewed:.0f} s ago" if isinstance(renewed, (int, float)) else ""
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started {when}{ago}"


def refusal(root: str, record: dict, options: LeaseOptions) -> str:
    """The message of `OutputDirInUseError`: who holds `root`, and the ways out."""
    generation = max([int(m.group(1)) for m in map(_NAME.match, store_for(root).list(root)) if m], default=1)
    return (f"{root} is in use by another job ({describe(record)}): two jobs writing one output_dir delete each "
            f"other's files and can commit a torn checkpoint, so this one stops before its first step; nothing was "
            f"trained or written. Give this job another output_dir (or unified_checkpoint_storage); or wait for that "
            f"job to end (unified_checkpoint_lease_wait={options.wait:g} s now: a requeued job waits that long for "
            f"its predecessor); or, if you are sure that job is gone (e.g. its machine is), remove "
            f"{join(root, lease_name(generation))}.")
