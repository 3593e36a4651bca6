"""The memory tier of one run on one machine: where things are, and the records the trainer and the persister
leave each other. Names and small JSON records only (read and written through the store).

    <memory_dir>/hf_unified_ckpt/<run id>/
        run.json                 the durable root and the lease timeout (written by the trainer)
        lease.json               the trainer's job id and process ids; its modification time is the heartbeat;
                                 "ended": true once training ended
        checkpoints/checkpoint-N unified checkpoints, committed like any other (manifest last, then a rename)
        saves/checkpoint-N.json  one `SaveInfo` per committed flash save (whether to persist it, where, and how)
        durable/checkpoint-N     the persister's mark: checkpoint-N is durable (holds the durable reference)
        failed/checkpoint-N      the persister's mark: persisting it failed (holds why)
        copying/checkpoint-N     a lock (flock) the persister holds while it copies checkpoint-N and eviction
                                 takes before it removes checkpoint-N: a checkpoint is never evicted mid-copy
        persister.lock|.pid|.log the persister's lock (held while it runs), process id and output

The run id is derived from the durable root, so a restarted job of the same run finds its memory and two runs
never share one.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field

from ..errors import CorruptCheckpointError
from ..format.bounded_json import parse_json
from ..store import canonical, join, name_of, put_bytes, read_bytes, store_for

TIER_FOLDER = "hf_unified_ckpt"
RUN_FILE = "run.json"
LEASE_FILE = "lease.json"
CHECKPOINTS = "checkpoints"
SAVES = "saves"
DURABLE = "durable"
FAILED = "failed"
COPYING = "copying"
SPARE = "spare"  # the tensor files of evicted memory checkpoints (a folder each), overwritten by the next saves
#: Sets of spare files kept: two, so that a checkpoint still being persisted while the next saves commit (three
#: sets in use at once) does not make a later save take fresh memory once it is evicted with the one after it.
SPARE_SETS = 2
LOCK_FILE = "persister.lock"
PID_FILE = "persister.pid"
LOG_FILE = "persister.log"


def run_id(durable_root: str) -> str:
    """A name for the run whose checkpoints go to `durable_root`: readable, and unique to that root."""
    root = canonical(durable_root)
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", name_of(root))[:40] or "run"
    return f"{readable}-{hashlib.sha1(root.encode()).hexdigest()[:12]}"


def run_folder(memory_dir: str, durable_root: str) -> str:
    """This run's memory folder on this machine."""
    return join(memory_dir, TIER_FOLDER, run_id(durable_root))


@dataclass(frozen=True)
class SaveInfo:
    """One committed flash save, as the trainer tells the persister of this machine.

    Attributes:
        step: the global step (the memory checkpoint is `checkpoints/checkpoint-<step>`).
        persist: make it durable (every Mth save, the last, the best).
        durable_final: the durable `checkpoint-<step>` it becomes.
        node: the lowest rank whose folder this is (one folder per machine).
        nodes: every machine's `node`; the one that is 0 writes the durable manifest once all are durable.
        save_total_limit, protect: the durable rotation to run after its commit (the best checkpoint kept).
    """

    step: int
    persist: bool
    durable_final: str
    node: int = 0
    nodes: tuple[int, ...] = (0,)
    save_total_limit: int | None = None
    protect: tuple[str, ...] = ()
    saved_at: float = field(default_factory=time.time)

    @property
    def leader(self) -> bool:
        return self.node == 0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "SaveInfo":
        raw = parse_json(data, "a memory-tier save record")
        raw["nodes"], raw["protect"] = tuple(raw["nodes"]), tuple(raw["protect"])
        return cls(**raw)


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def write_record(ref: str, data: dict | bytes) -> None:
    put_bytes(ref, data if isinstance(data, bytes) else json.dumps(data, sort_keys=True).encode())


def read_record(ref: str) -> dict | None:
    """A JSON record, or None if it is missing or torn."""
    try:
        record = parse_json(read_bytes(ref), f"record {ref}")
    except (OSError, CorruptCheckpointError):
        return None
    return record if isinstance(record, dict) else None


def save_info(run: str, step: int) -> SaveInfo | None:
    try:
        return SaveInfo.from_bytes(read_bytes(join(run, SAVES, f"{checkpoint_name(step)}.json")))
    except (OSError, CorruptCheckpointError, TypeError, KeyError):
        return None


def copy_lock(run: str, step: int) -> str:
    """The lock that keeps checkpoint-`step` of `run` from being evicted while the persister copies it (and from
    being copied once eviction began): `copying/checkpoint-N`. Whoever holds it checks that the checkpoint is still
    committed (the copier) or uncommits it (eviction) before letting go."""
    return join(run, COPYING, checkpoint_name(step))


def copy_lock_of(run: str, step: int):
    """The `Lock` (not taken yet) on `copy_lock(run, step)`, its folder made first: what the copier and eviction
    both take."""
    from ..store.node import Lock

    store_for(run).make_folder(join(run, COPYING))
    return Lock(copy_lock(run, step))
