"""The memory tier of one `train()` call (`flash`), the trainer's side of it: where saves go, the persister, the
lease, eviction, and what training's end waits for. It knows nothing of the Trainer (`trainer/session.py` drives
it). The persister itself is `persister.py`; the records both sides read are `layout.py`.

- `open` (when `train()` starts): finds which ranks share a memory folder (one per machine) and takes the lease;
- `start` (before the first step): writes the run's record, starts the machine's persister unless one serves the
  run already (a restarted job), and keeps the lease's heartbeat in a thread;
- `fits` (before the first step): memory must hold one checkpoint's share of this machine and the snapshot of it
  (MemAvailable, the cgroup's room and the folder's free bytes, whichever is least); else saves go to durable
  storage as without `flash`, said once with the numbers;
- every save: `final_dir` in memory, `after_commit` (on each machine's lowest rank): the save's `SaveInfo` for
  the persister, then eviction beyond `keep` (never one not durable yet, nor the best);
- `end_training`: the last and the best checkpoints made durable, waited for; the lease ended, so the
  persister frees the memory and exits; `close` stops the heartbeat however `train()` ends.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid

from .. import dist
from ..checkpoint.folder.commit import COMMIT_FILE, list_checkpoints
from ..checkpoint.folder.layout import detect_layout
from ..checkpoint.write.memory_tier import spare_sets
from ..errors import UnsupportedCheckpointError
from ..format.components import MODEL, Role
from ..options import FlashOptions
from ..store import is_file, join, name_of, parent_of, read_bytes, remove, store_for
from ..store.node import is_locked, memory_room, open_log, pid_alive, private_folder, remove_if_empty, touch
from .layout import (CHECKPOINTS, DURABLE, FAILED, LEASE_FILE, LOCK_FILE, LOG_FILE, PID_FILE, RUN_FILE, SAVES, SPARE,
                     SPARE_SETS, SaveInfo, checkpoint_name, copy_lock, copy_lock_of, run_folder, save_info,
                     write_record)
from .orphans import clear, holds_checkpoints, orphaned_runs

logger = logging.getLogger(__name__)

MEMBERS = "members"
#: How often `end_training` says what it still waits for.
REPORT_EVERY = 30.0


class FlashTier:
    """See the module docstring. `active` is False once saves fell back to durable storage."""

    def __init__(self, options: FlashOptions, durable_root: str, direct_io: bool = True):
        self.options = options
        self.durable_root = durable_root
        self.direct_io = direct_io  # how the persister writes durable files (`unified_checkpoint_direct_io`)
        self.run = run_folder(options.memory_dir, durable_root)
        self.root = join(self.run, CHECKPOINTS)
        self.active = True
        self.started = False
        self.saves = 0
        self.job = uuid.uuid4().hex
        self.node, self.nodes, self.local_pids = 0, (0,), (os.getpid(),)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._process: subprocess.Popen | None = None

    @property
    def is_machine_leader(self) -> bool:
        return dist.rank() == self.node

    # ---- start ---------------------------------------------------------------------------------------------------
    def open(self) -> None:
        """When `train()` starts, before it looks for a checkpoint to resume: find the machines and take the lease
        (a persister waiting for a restarted job keeps the memory from then on). The run folder is made this
        user's own (owner-only) first, or refused when another user owns it. Collective."""
        private_folder(self.run)
        self._find_machines()
        self._refuse_unshared_durable()
        if self.is_machine_leader:
            self._clear_orphans()
            self._write_lease(ended=False)

    def _clear_orphans(self) -> None:
        """Run folders in this machine's memory that no live job or persister owns (`flash.orphans`): removed, or
        served by a persister of their own when they hold memory checkpoints (made durable, then freed). This run's
        own folder is left to this job (it may resume from it). Local."""
        for run in orphaned_runs(self.options.memory_dir):
            if run == self.run:
                continue
            if holds_checkpoints(run):
                logger.warning("flash: %s holds memory checkpoints that no process serves (its job and persister were "
                               "killed?); starting a persister that makes the newest durable, then frees it.", run)
                _spawn_persister(run)
            else:
                clear(run)

    def start(self, checkpoint_bytes: int) -> bool:
        """Before the first step: if every machine's memory holds a checkpoint of `checkpoint_bytes` (`fits`), write
        the run's records and start or reuse each machine's persister; else give the lease up. Returns `active`.
        Collective."""
        if not self.fits(checkpoint_bytes):
            if self.is_machine_leader:
                self._give_up()
            return False
        self.started = True
        if self.is_machine_leader:
            for folder in (CHECKPOINTS, SAVES, DURABLE, FAILED):
                store_for(self.run).make_folder(join(self.run, folder))
            write_record(join(self.run, RUN_FILE), {"durable_root": self.durable_root, "direct_io": self.direct_io,
                                                    "lease_timeout": self.options.lease_timeout})
            self._write_lease(ended=False)
            self._ensure_persister()
            self._heartbeat = threading.Thread(target=self._beat, name="hf_unified_ckpt-lease", daemon=True)
            self._heartbeat.start()
        return True

    def _refuse_unshared_durable(self) -> None:
        """With several machines the durable folder must be one that every machine sees: the leader's persister
        commits once every machine's persister copied its share there. Rank 0 leaves a mark in it; a machine that
        does not see the mark (its own local disk) refuses the run here, before the first step, on every rank,
        leaving nothing in memory. Collective."""
        if len(self.nodes) < 2:
            return
        mark = join(self.durable_root, f".flash-probe-{self.job}")
        if dist.rank() == 0:
            store_for(self.durable_root).make_folder(self.durable_root)
            store_for(mark).put(mark, b"")
        dist.barrier()
        blind = [r for r in dist.all_gather_object(dist.rank() if self.is_machine_leader and not is_file(mark)
                                                   else None) if r is not None]
        if dist.rank() == 0:
            remove(mark)
        if not blind:
            return
        if self.is_machine_leader:
            remove_if_empty(self.run)
            remove_if_empty(parent_of(self.run))
        raise UnsupportedCheckpointError(
            f"flash on {len(self.nodes)} machines needs a durable folder that every machine sees (a shared "
            f"filesystem or a bucket), but the machine of rank {blind[0]} does not see {self.durable_root} as rank 0 "
            "writes it (a folder on each machine's own disk?): every checkpoint would wait for shares that never "
            "arrive. Point output_dir (or unified_checkpoint_storage) at storage every machine sees, or leave "
            "'flash' out of unified_checkpoint_config.")

    def _find_machines(self) -> None:
        """Which ranks share this rank's memory folder (its machine): each rank leaves a mark, then reads the
        others'. Collective."""
        self.job = dist.broadcast_object(self.job)
        store_for(self.run).make_folder(join(self.run, MEMBERS))
        store_for(self.run).put(join(self.run, MEMBERS, str(dist.rank())), self.job.encode())
        dist.barrier()
        sharing = [r for r in range(dist.world_size()) if _read(join(self.run, MEMBERS, str(r))) == self.job]
        pids = dist.all_gather_object(os.getpid())
        self.node, self.local_pids = min(sharing), tuple(pids[r] for r in sharing)
        self.nodes = tuple(sorted(set(dist.all_gather_object(self.node))))
        remove(join(self.run, MEMBERS, str(dist.rank())))
        dist.barrier()
        if self.is_machine_leader:
            remove(join(self.run, MEMBERS))

    def _give_up(self) -> None:
        """This run saves to durable storage: a persister serving the run's memory (an earlier job's) finishes and
        frees it; memory nobody serves is left as it is, an empty run folder removed."""
        if is_locked(join(self.run, LOCK_FILE)):
            self._write_lease(ended=True)
            return
        remove(join(self.run, LEASE_FILE))
        remove_if_empty(self.run)
        remove_if_empty(parent_of(self.run))

    def _write_lease(self, ended: bool) -> None:
        write_record(join(self.run, LEASE_FILE), {"job": self.job, "pids": list(self.local_pids), "ended": ended})

    def _ensure_persister(self) -> None:
        if is_locked(join(self.run, LOCK_FILE)):
            return  # a persister serves this run already (a restarted job): it reads the new lease
        self._process = _spawn_persister(self.run)
        deadline = time.monotonic() + 30
        while not is_locked(join(self.run, LOCK_FILE)) and self._process.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def _beat(self) -> None:
        interval = max(0.5, min(5.0, self.options.lease_timeout / 4))
        while not self._stop.wait(interval):
            touch(join(self.run, LEASE_FILE))

    def fits(self, checkpoint_bytes: int) -> bool:
        """Whether every machine's memory holds its share of a checkpoint of `checkpoint_bytes` and the snapshot of
        it; if one does not, saves go to durable storage from now on (said once, with the numbers). Collective."""
        share = checkpoint_bytes * len(self.local_pids) // max(1, dist.world_size())
        room = memory_room(self.options.memory_dir) if self.is_machine_leader else {}
        limit = min([v for v in room.values() if v is not None], default=None)
        short = dist.all_gather_object((self.node, 2 * share, room) if limit is not None and limit < 2 * share
                                       else None)
        short = [s for s in short if s is not None]
        if short:
            self.active = False
            if dist.rank() == 0:
                node, needed, room = short[0]
                logger.warning("flash: the memory of the machine of rank %d cannot hold a checkpoint and its snapshot "
                               "(%s needed; %s). Saves go to durable storage (%s) as without flash.", node,
                               _gb(needed), ", ".join(f"{k} {_gb(v)}" for k, v in room.items() if v is not None),
                               self.durable_root)
        return self.active

    # ---- saves ---------------------------------------------------------------------------------------------------
    def final_dir(self, step: int) -> str:
        return join(self.root, checkpoint_name(step))

    def after_commit(self, step: int, durable_final: str, best: str | None, save_total_limit: int | None) -> None:
        """On each machine's lowest rank, once the memory save committed: the save's record for the persister (made
        durable every `persist_every`-th save), a new persister if the machine's died, then eviction. Local."""
        self.saves += 1
        protect = (join(self.durable_root, name_of(best)),) if best else ()
        info = SaveInfo(step, self.saves % self.options.persist_every == 0, durable_final, self.node, self.nodes,
                        save_total_limit, protect)
        write_record(join(self.run, SAVES, f"{checkpoint_name(step)}.json"), info.to_bytes())
        if not is_locked(join(self.run, LOCK_FILE)):  # killed (out of memory, by hand): saves would wait for the end
            logger.warning("flash: the persister of %s is not running (it was killed?); starting a new one.", self.run)
            self._ensure_persister()
        self.evict(best)

    def evict(self, best: str | None) -> list[int]:
        """Remove memory checkpoints beyond the newest `keep`, except the best and those not durable yet. Local."""
        committed = [step for step, path in list_checkpoints(self.root) if detect_layout(path).committed]
        best_name = name_of(best) if best else None
        evicted = []
        for step in committed[:-self.options.keep]:
            name = checkpoint_name(step)
            info = save_info(self.run, step)
            pending = info is not None and info.persist and not is_file(join(self.run, DURABLE, name))
            if name == best_name or pending or is_file(join(self.run, FAILED, name)):
                continue
            if self._evict_unless_copied(step):
                evicted.append(step)
        return evicted

    def _evict_unless_copied(self, step: int) -> bool:
        """Evict checkpoint-`step` holding its copy lock (`layout.copy_lock`), unless the persister holds it: a
        checkpoint being made durable (an earlier job's newest, copied when that job died) stays until a later save.
        Uncommitting it under the lock keeps a copy from starting on it afterwards. Local."""
        lock = copy_lock_of(self.run, step)
        if not lock.acquire():
            logger.debug("flash: checkpoint-%d is being made durable; evicted at a later save.", step)
            return False
        try:
            name = checkpoint_name(step)
            self._keep_as_spare(join(self.root, name))
            for record in (join(self.run, SAVES, f"{name}.json"), join(self.run, DURABLE, name)):
                remove(record)
        finally:
            lock.release()
        remove(copy_lock(self.run, step))  # after uncommitting: a copier that locks a new file finds it evicted
        return True

    @property
    def spare(self) -> str:
        """Where the tensor files of evicted memory checkpoints (a folder each) wait for the next saves to overwrite
        them (`SaveRequest.spare`: their memory is reused rather than freed and taken again)."""
        return join(self.run, SPARE)

    def _keep_as_spare(self, checkpoint: str) -> None:
        """Evict `checkpoint`: uncommit it (manifest first), keep its tensor files as a set of spare files (the
        newest `SPARE_SETS` sets are kept, older and emptied ones removed), remove the rest. Local."""
        store = store_for(checkpoint)
        store.remove(join(checkpoint, COMMIT_FILE))
        sets = spare_sets(self.spare)
        full = [n for n in sets if store.list(join(self.spare, n))]
        for name in [n for n in sets if n not in full] + full[:max(len(full) - SPARE_SETS + 1, 0)]:
            store.remove(join(self.spare, name))
        kept = join(self.spare, name_of(checkpoint))
        store.make_folder(kept)
        for name, size in store.list(checkpoint).items():
            if size is not None and name.endswith(".safetensors"):
                store.move(join(checkpoint, name), join(kept, name))
        store.retire(checkpoint, COMMIT_FILE)

    # ---- the end -------------------------------------------------------------------------------------------------
    def end_training(self, steps: list[int]) -> None:
        """Training ended: the memory checkpoints of `steps` (the last, the best) are made durable and waited for;
        then the lease ends and the persister frees the memory and exits. Collective."""
        if not self.started:
            return
        if self.is_machine_leader:
            waiting = [s for s in steps if self._request(s)]
            self._wait_durable(waiting)
        dist.barrier()
        self.close(ended=True)

    def _request(self, step: int) -> bool:
        info = save_info(self.run, step)
        if info is None:
            return False
        if not info.persist:
            write_record(join(self.run, SAVES, f"{checkpoint_name(step)}.json"),
                         SaveInfo(**{**info.__dict__, "persist": True}).to_bytes())
        return True

    def _wait_durable(self, steps: list[int]) -> None:
        started = reported = time.monotonic()
        while True:
            left = [s for s in steps if not is_file(join(self.run, DURABLE, checkpoint_name(s)))
                    and not is_file(join(self.run, FAILED, checkpoint_name(s)))]
            if not left:
                break
            if not is_locked(join(self.run, LOCK_FILE)):
                self._ensure_persister()  # the persister died (killed): a new one takes over
            if time.monotonic() - reported > REPORT_EVERY:
                reported = time.monotonic()
                logger.info("flash: waiting for %s to be made durable (%.0f s).", left, reported - started)
            time.sleep(0.1)
        for s in steps:
            failed = join(self.run, FAILED, checkpoint_name(s))
            if is_file(failed):
                logger.error("flash: checkpoint-%d could not be made durable (%s); its memory copy stays at %s.", s,
                             _read(failed), join(self.root, checkpoint_name(s)))

    def close(self, ended: bool = False, wait: bool = True) -> None:
        """Stop the heartbeat; with `ended`, end the lease and (with `wait`) wait up to a minute for the persister
        to exit. Local. The tier takes no save after this (a save after `train()` goes to durable storage)."""
        self.active = False
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if not (ended and self.is_machine_leader):
            return
        pid = _read(join(self.run, PID_FILE))
        self._write_lease(ended=True)
        if not wait:
            return
        if self._process is not None:
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                logger.warning("flash: the persister (pid %d) is still running after training ended; see %s.",
                               self._process.pid, join(self.run, LOG_FILE))
            return
        deadline = time.monotonic() + 60  # a persister an earlier job started (not this process's child)
        while pid and pid.isdigit() and pid_alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)


def _spawn_persister(run: str) -> subprocess.Popen:
    """Start the persister of memory folder `run`, in a session of its own (it outlives this process)."""
    with open_log(join(run, LOG_FILE)) as log:
        return subprocess.Popen([sys.executable, "-m", "hf_unified_ckpt.flash.persister", run],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


def checkpoint_bytes(engine, include_optimizer: bool = True, optimizer_has_state: bool = True) -> int:
    """The bytes of one checkpoint of `engine`'s state, from the shapes and dtypes it would save (an estimate: a
    codec makes the optimizer's smaller). An optimizer without state yet (before the first step) is not asked for
    its tensors -- under FSDP that creates its state by a step on zero gradients (torch DCP's `_init_optim_state`),
    which changes the first real step's bias correction -- and counts as two fp32 moments per trained weight."""
    total = 0
    for component in engine.components():
        if component.role is Role.OPTIMIZER:
            if include_optimizer and optimizer_has_state:
                total += sum(spec.nbytes for spec in engine.specs(component.name))
            elif include_optimizer:
                total += sum(8 * spec.nbytes // spec.dtype.itemsize for spec in engine.specs(MODEL.name))
        else:
            total += sum(spec.nbytes for spec in engine.specs(component.name))
    return total


def _read(ref: str) -> str | None:
    try:
        return read_bytes(ref).decode()
    except (OSError, UnicodeDecodeError):
        return None


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"

