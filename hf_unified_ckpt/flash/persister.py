"""The persister: one process per machine and run, started by the trainer in a session of its own so that it
outlives every trainer process (a kill -9 of the workers and of their launcher leaves it running).

    python -m hf_unified_ckpt.flash.persister <run memory folder>

It holds the run's lock (one persister per run and machine; a second one exits at once) and, every `POLL`
seconds:

1. makes durable, oldest first, every committed memory checkpoint whose `SaveInfo` asks for it (`copy.py`), then
   marks it `durable/` (or `failed/`, with why: its memory is then never freed by this process);
2. watches the lease: the trainer is gone when none of its processes lives or its heartbeat is older than the
   lease timeout. Then it makes the newest memory checkpoint durable (unless a newer durable one exists), and
   waits up to the lease timeout for a restarted job to take the lease over (it then serves that job);
3. when training ended (the lease says so) and nothing is pending, or the trainer stayed gone for the lease
   timeout, it removes the run's memory folder and exits.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from ..checkpoint.folder.commit import list_checkpoints
from ..checkpoint.folder.layout import detect_layout, newest_complete
from ..store import is_file, join, listing, parent_of, put_bytes, remove
from ..store.node import Lock, age, pid_alive, private_folder, remove_if_empty
from .copy import persist_checkpoint
from .layout import (CHECKPOINTS, DURABLE, FAILED, LEASE_FILE, LOCK_FILE, PID_FILE, RUN_FILE, SAVES, SaveInfo,
                     checkpoint_name, copy_lock_of, read_record, save_info, write_record)

logger = logging.getLogger(__name__)
POLL = 0.2


class Persister:
    """The loop of the module docstring, for the run whose memory folder is `run`."""

    def __init__(self, run: str):
        self.run = run
        config = read_record(join(run, RUN_FILE)) or {}
        self.durable_root = config["durable_root"]
        self.lease_timeout = float(config.get("lease_timeout", 600.0))
        self.direct_io = bool(config.get("direct_io", True))
        self.gone_since: float | None = None
        self.job_seen_gone: str | None = None

    # ---- the trainer ----------------------------------------------------------------------------------------------
    def lease(self) -> tuple[dict | None, bool]:
        """(the lease, whether its trainer lives)."""
        lease = read_record(join(self.run, LEASE_FILE))
        if not lease:
            return None, False
        heartbeat = age(join(self.run, LEASE_FILE))
        alive = any(pid_alive(p) for p in lease.get("pids", ())) and heartbeat is not None \
            and heartbeat < self.lease_timeout
        return lease, alive

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def committed(self) -> list[int]:
        return [step for step, path in list_checkpoints(join(self.run, CHECKPOINTS)) if detect_layout(path).committed]

    def settled(self, step: int) -> bool:
        name = checkpoint_name(step)
        return is_file(join(self.run, DURABLE, name)) or is_file(join(self.run, FAILED, name))

    def pending(self) -> list[SaveInfo]:
        infos = [save_info(self.run, step) for step in self.committed()]
        return [i for i in infos if i is not None and i.persist and not self.settled(i.step)]

    def persist(self, info: SaveInfo, still_wanted=lambda: True) -> None:
        """Make checkpoint `info.step` durable, holding its copy lock (`layout.copy_lock`) from before it checks that
        the checkpoint is still committed until its mark is written: a trainer evicts it only by taking the same
        lock (a restarted job's eviction leaves it to a later save instead of overwriting what this copy reads). A checkpoint
        evicted before the lock was taken is not copied."""
        name = checkpoint_name(info.step)
        lock = copy_lock_of(self.run, info.step)
        lock.acquire(wait=True)
        try:
            if info.step not in self.committed():
                logger.info("%s was evicted before its copy began; not made durable.", name)
                return
            self._copy(info, still_wanted)
        finally:
            lock.release()

    def _copy(self, info: SaveInfo, still_wanted) -> None:
        name = checkpoint_name(info.step)
        started = time.monotonic()
        try:
            persist_checkpoint(join(self.run, CHECKPOINTS, name), info, still_wanted, timeout=self.lease_timeout,
                               direct_io=self.direct_io)
        except Exception as e:  # recorded for the trainer; this checkpoint's memory is kept
            logger.error("Persisting %s failed: %s", name, e, exc_info=True)
            write_record(join(self.run, FAILED, name), f"{type(e).__name__}: {e}".encode())
            return
        put_bytes(join(self.run, DURABLE, name), info.durable_final.encode())
        logger.info("%s is durable at %s (%.2f s).", name, info.durable_final, time.monotonic() - started)

    def newest_unsaved(self) -> SaveInfo | None:
        """The newest memory checkpoint, when nothing durable is as new (to make durable once the trainer is
        gone)."""
        committed = self.committed()
        if not committed or self.settled(committed[-1]):
            return None
        step = committed[-1]
        durable = newest_complete(self.durable_root)
        if durable is not None and durable.global_step is not None and durable.global_step >= step:
            return None
        info = save_info(self.run, step) or SaveInfo(step, True, join(self.durable_root, checkpoint_name(step)))
        info = SaveInfo(**{**info.__dict__, "persist": True})
        # recorded where a restarted job reads it: a checkpoint due to be made durable is not evicted
        write_record(join(self.run, SAVES, f"{checkpoint_name(step)}.json"), info.to_bytes())
        return info

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One round; False once the run's memory is freed (the process then exits), or removed by someone else."""
        if not is_file(join(self.run, RUN_FILE)):
            logger.warning("%s was removed by another process; exiting.", self.run)
            return False
        for info in self.pending():
            self.persist(info, still_wanted=lambda: True)
        lease, alive = self.lease()
        if lease and lease.get("ended"):
            if not self.pending():
                return not self.free("training ended")
            return True
        if alive:
            self.gone_since = None
            return True
        if self.gone_since is None:
            self.gone_since = time.monotonic()
            newest = self.newest_unsaved()
            if newest is not None:
                logger.info("The trainer is gone; making its newest memory checkpoint (step %d) durable.",
                            newest.step)
                self.persist(newest)
        if time.monotonic() - self.gone_since > self.lease_timeout:
            return not self.free(f"no trainer took the run over within {self.lease_timeout:.0f} s")
        return True

    def free(self, why: str) -> bool:
        """Remove the run's memory unless a persist failed there (that memory is then the only copy). True when
        freed."""
        failed = sorted(listing(join(self.run, FAILED)))
        if failed:
            logger.error("%s, but persisting %s failed: their memory copies stay in %s.", why, failed, self.run)
            return True
        lease, alive = self.lease()
        if alive and not (lease or {}).get("ended"):  # a new job took the run over meanwhile
            return False
        logger.info("%s; removing %s.", why, self.run)
        remove(self.run)
        remove_if_empty(parent_of(self.run))
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run = argv[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s persister %(process)d %(levelname)s %(message)s")
    private_folder(run)  # this user's own, owner-only, before anything in it is read
    lock = Lock(join(run, LOCK_FILE))
    if not lock.acquire():
        logger.info("Another persister serves %s; exiting.", run)
        return 0
    put_bytes(join(run, PID_FILE), str(os.getpid()).encode())
    try:  # the copies take idle CPU cycles, not training's (the trainer waits for them only at its end)
        os.nice(19)
    except OSError:
        pass
    persister = Persister(run)
    logger.info("Serving %s (durable: %s).", run, persister.durable_root)
    try:
        while persister.step():
            time.sleep(POLL)
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
