"""Train 9 steps saving at 3 and 6; die (os._exit, no clean-up: what SIGKILL leaves) at POINT during the
step-6 save, once per POINT, each run in ROOT/POINT:   python tests/support/workers/kill_worker.py ROOT POINT [POINT ...]

The training stack is imported once; each run is a child process forked from this one (nothing has trained here and
no process group exists), so each dies alone; its exit status is written to ROOT/POINT.status."""

import os
import re
import sys

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))  # tests/: `import support.x`

import hf_unified_ckpt.store.local as local_store  # noqa: E402
from support.env import freeze_imports  # noqa: E402
from support.trainers import train  # noqa: E402
from support.faulty_store import Call, KILLED, die, injected, nth, on  # noqa: E402

#: A reference inside the step-6 save's staging folder (not the Trainer hook files' `.checkpoint-6.hooks.` one).
IN_SAVE = re.compile(r"/\.checkpoint-6\.(?!hooks\.)[^/]*/(?P<name>[^/]+)$")


def in_save(suffix: str = "", but: tuple[str, ...] = ()):
    """A `when`: a call on a file of the step-6 save named `*suffix`, and not `*but`."""
    def match(call: Call) -> bool:
        found = IN_SAVE.search(call.ref)
        return found is not None and found["name"].endswith(suffix) and not found["name"].endswith(but)
    return match


def kill(call: Call):
    die()


def half_then_kill(call: Call):
    """In the middle of writing a shared file in place: the file exists at its final size with its header and the
    first half of this rank's ranges; the rest is never written."""
    ref, ranges, *rest = call.args
    ranges = list(ranges)
    call.proceed(ref, ranges[: max(1, len(ranges) // 2)], *rest)
    die()


def committing_six(call: Call) -> bool:
    return os.path.basename(os.path.normpath(str(call.args[1]))) == "checkpoint-6"


def rotation_killer(real_rmtree):
    """Kill while rotation deletes checkpoint-3 (after checkpoint-6 was committed): the folder itself or its hidden
    `.deleting` name (not the hook folder of the save at step 3, `.checkpoint-3.hooks.<tag>.incomplete`). Inside
    `LocalStore.retire`, between its rename and its removal: below the store, so rebound there."""
    def rmtree(path, *a, **k):
        name = os.path.basename(str(path))
        if name == "checkpoint-3" or (name.startswith(".checkpoint-3.") and name.endswith(".deleting")):
            for name in sorted(os.listdir(path))[:3]:
                os.remove(os.path.join(path, name))
            die()
        return real_rmtree(path, *a, **k)
    return rmtree


SMALL = (".index.json", "unified_checkpoint.json")  # the small files written after the tensors' (and the marks)
#: Store faults at each point of the step-6 save (the second), sync or async (the same calls, in the background).
STORE_POINTS = {
    "before-first-shard": on("write_at", nth(1, in_save()), kill),
    "between-shards": on("write_at", nth(3, in_save()), kill),
    "mid-file": on("write_at", nth(2, in_save()), half_then_kill),
    "before-extras": on("put", nth(1, lambda c: in_save(but=SMALL)(c) and ".writer-" not in c.ref), kill),
    "before-index": on("put", nth(1, in_save(".index.json")), kill),
    "between-indexes": on("put", nth(2, in_save(".index.json")), kill),
    "before-manifest": on("put", in_save("unified_checkpoint.json"), kill),
    "before-rename": on("publish", committing_six, kill),
}
POINTS = [*STORE_POINTS, "during-rotation"]
#: The same kill points inside the background writer of an async save.
ASYNC_POINTS = ["async-between-shards", "async-mid-file", "async-before-manifest", "async-before-rename"]

#: The same kills in a run saving O1-compressed optimizer moments ("o1-" + a point).
COMPRESSED_POINTS = ("o1-mid-file", "o1-async-mid-file")
#: The same kills in a run keeping an EMA of the weights ("ema-" + a point).
EMA_POINTS = ("ema-mid-file", "ema-async-mid-file", "ema-before-manifest")

def run(run_dir: str, point: str) -> None:
    """Train into `run_dir` and die at `point` (in this process: the forked child)."""
    quant = "O1" if point.startswith("o1-") else "O0"
    words = ["ema"] if point.startswith("ema-") else []
    point = point.removeprefix("o1-").removeprefix("ema-")
    words += ["async_save"] if point.startswith("async-") else []
    point = point.removeprefix("async-")
    if point == "during-rotation":
        local_store.shutil.rmtree = rotation_killer(local_store.shutil.rmtree)
    with injected(*([STORE_POINTS[point]] if point in STORE_POINTS else [])):
        train(run_dir, max_steps=9, save_steps=3, save_total_limit=1 if point == "during-rotation" else None,
              unified_checkpoint_max_shard_size="40KB", unified_checkpoint_config=" ".join(words),
              ckpt_quant_stage=quant)
    print("training finished without being killed", flush=True)


if __name__ == "__main__":
    root, points = sys.argv[1], sys.argv[2:]
    freeze_imports()
    for point in points:
        pid = os.fork()
        if pid == 0:
            try:
                run(os.path.join(root, point), point)
            finally:
                os._exit(3)  # not killed: a failure the test reports
        _, status = os.waitpid(pid, 0)
        with open(os.path.join(root, f"{point}.status"), "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
