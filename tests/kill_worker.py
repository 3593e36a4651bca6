"""Train 9 steps saving at 3 and 6; die (os._exit, no clean-up: what SIGKILL leaves) at POINT during the
step-6 save, once per POINT, each run in ROOT/POINT:   python tests/kill_worker.py ROOT POINT [POINT ...]

The training stack is imported once; each run is a child process forked from this one (nothing has trained here and
no process group exists), so each dies alone; its exit status is written to ROOT/POINT.status."""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_unified_ckpt.checkpoint.save.async_save as async_save  # noqa: E402
import hf_unified_ckpt.trainer.session as session  # noqa: E402
import hf_unified_ckpt.checkpoint.save.persist as persist  # noqa: E402
import hf_unified_ckpt.checkpoint.save.saving as save  # noqa: E402
import hf_unified_ckpt.store.local as local_store  # noqa: E402
import hf_unified_ckpt.checkpoint.write.writer as writer  # noqa: E402
from _runs import freeze_imports, train  # noqa: E402

KILLED = 137
state = {"saves": 0}
ORIGINAL_WRITE_RANGES = writer.write_ranges


def die():
    sys.stdout.flush()
    os._exit(KILLED)


def during_second_save(fn, on_call=1, before=None):
    def wrapper(*args, **kwargs):
        if state["saves"] == 2:
            state[fn.__name__] = state.get(fn.__name__, 0) + 1
            if state[fn.__name__] == on_call:
                (before or (lambda *a, **k: die()))(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


def half_file_then_die(path, file, rank, tensors, **kwargs):
    """In the middle of writing a shared file in place: the file exists at its final size with its header and the
    first half of its ranges; the rest is never written."""
    ORIGINAL_WRITE_RANGES(path, dataclasses.replace(file, layout=file.layout[: len(file.layout) // 2]), rank,
                          tensors, **kwargs)
    die()


def rotation_killer(real_rmtree):
    """Kill while rotation deletes checkpoint-3 (after checkpoint-6 was committed): the folder itself or its hidden
    `.deleting` name (not the hook folder of the save at step 3, `.checkpoint-3.hooks.<tag>.incomplete`)."""
    def rmtree(path, *a, **k):
        name = os.path.basename(str(path))
        if name == "checkpoint-3" or (name.startswith(".checkpoint-3.") and name.endswith(".deleting")):
            for name in sorted(os.listdir(path))[:3]:
                os.remove(os.path.join(path, name))
            die()
        return real_rmtree(path, *a, **k)
    return rmtree


def async_points() -> dict:
    """The same kill points inside the background writer of an async save."""
    def patch(name, wrapper):
        return lambda: setattr(writer, name, wrapper(getattr(writer, name)))
    return {
        "async-between-shards": patch("write_ranges", lambda f: during_second_save(f, 3)),
        "async-mid-file": patch("write_ranges", lambda f: during_second_save(f, 2, before=half_file_then_die)),
        "async-before-manifest": lambda: setattr(save, "write_manifest", during_second_save(save.write_manifest)),
        "async-before-rename": lambda: setattr(save, "commit", during_second_save(save.commit)),
    }


def count_saves(fn):
    def wrapper(*args, **kwargs):
        state["saves"] += 1
        return fn(*args, **kwargs)
    return wrapper


POINTS = {
    "before-first-shard": lambda: setattr(writer, "write_ranges", during_second_save(writer.write_ranges, 1)),
    "between-shards": lambda: setattr(writer, "write_ranges", during_second_save(writer.write_ranges, 3)),
    "mid-file": lambda: setattr(writer, "write_ranges", during_second_save(writer.write_ranges, 2,
                                                                            before=half_file_then_die)),
    "before-extras": lambda: setattr(persist, "write_small_files", during_second_save(persist.write_small_files)),
    "before-index": lambda: setattr(save, "write_index", during_second_save(save.write_index, 1)),
    "between-indexes": lambda: setattr(save, "write_index", during_second_save(save.write_index, 2)),
    "before-manifest": lambda: setattr(save, "write_manifest", during_second_save(save.write_manifest)),
    "before-rename": lambda: setattr(save, "commit", during_second_save(save.commit)),
    "during-rotation": lambda: setattr(local_store.shutil, "rmtree", rotation_killer(local_store.shutil.rmtree)),
}


ASYNC_POINTS = async_points()
#: The same kills in a run saving O1-compressed optimizer moments ("o1-" + a point).
COMPRESSED_POINTS = ("o1-mid-file", "o1-async-mid-file")
#: The same kills in a run keeping an EMA of the weights ("ema-" + a point).
EMA_POINTS = ("ema-mid-file", "ema-async-mid-file", "ema-before-manifest")

def run(run_dir: str, point: str) -> None:
    """Train into `run_dir` and die at `point` (in this process: the forked child)."""
    quant = "O1" if point.startswith("o1-") else "O0"
    words = ["ema"] if point.startswith("ema-") else []
    point = point.removeprefix("o1-").removeprefix("ema-")
    {**POINTS, **ASYNC_POINTS}[point]()
    session.save_checkpoint = count_saves(session.save_checkpoint)
    async_save.AsyncSaver.start = count_saves(async_save.AsyncSaver.start)
    limit = 1 if point == "during-rotation" else None
    words += ["async_save"] if point.startswith("async-") else []
    train(run_dir, max_steps=9, save_steps=3, save_total_limit=limit, unified_checkpoint_max_shard_size="40KB",
          unified_checkpoint_config=" ".join(words), ckpt_quant_stage=quant)
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
