"""Where a Trainer's checkpoints live: `output_dir`, or the object-store prefix of `unified_checkpoint_storage`
(every `checkpoint-N` of the run goes there; logs, `save_model` and the Trainer's other outputs stay in
`output_dir`).

- `checkpoint_root`: the folder (or URL prefix) holding the run's `checkpoint-N`s;
- `check_writable`: before the first step, a small put and delete under it (read-only credentials, a missing
  bucket or an unreachable endpoint are refused there, not at the first save);
- `LocalAlias`: the Trainer's own resume code (and a trainer class's load hooks) open `trainer_state.json`, the
  scaler and the other small files by local path, so a checkpoint in object storage is given a local stand-in
  holding those small files; the plugin loads the tensors from the bucket itself.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid

from .. import dist
from ..checkpoint.folder.files import read_json
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..store import as_ref, is_file, join, local_paths_of, put_bytes, read_bytes, remove, store_for
from .capture import SCALER_FILE, TRAINER_STATE_FILE

logger = logging.getLogger(__name__)


def checkpoint_root(trainer, trial=None) -> str:
    """The folder or URL prefix of `trainer`'s `checkpoint-N`s (a hyperparameter-search trial: its run folder's
    name under the prefix)."""
    storage = trainer.args.unified_checkpoint_options.storage
    run_dir = as_ref(trainer._get_output_dir(trial=trial))
    if storage is None:
        return run_dir
    relative = os.path.relpath(run_dir, as_ref(trainer.args.output_dir))
    return storage if relative == "." else join(storage, *relative.split(os.sep))


def memory_root(trainer, trial=None) -> str | None:
    """With `flash`: the folder of this machine's memory checkpoints of the run (else None)."""
    from ..flash.layout import CHECKPOINTS, run_folder

    options = trainer.args.unified_checkpoint_options
    if not (options.enabled and options.flash.enabled):
        return None
    return join(run_folder(options.flash.memory_dir, checkpoint_root(trainer, trial)), CHECKPOINTS)


def is_remote(ref: str) -> bool:
    """Whether `ref` lies in a store other libraries cannot open by path (object storage)."""
    return local_paths_of(store_for(ref)) is None


def check_writable(root: str) -> None:
    """Rank 0 puts and deletes a small object under `root`; a failure is raised on every rank, naming the URL and
    the store's answer. Collective: all ranks must call it."""
    outcome = None
    if dist.rank() == 0:
        probe = join(root, f".hf_unified_ckpt-write-check-{uuid.uuid4().hex[:12]}")
        try:
            store_for(probe).check_writable(probe)
        except Exception as e:  # any failure: reported on every rank below
            outcome = f"{type(e).__name__}: {e}"
    outcome = dist.broadcast_object(outcome)
    if outcome is not None:
        raise UnsupportedCheckpointError(
            f"unified_checkpoint_storage={root!r}: a test write under it failed before training ({outcome}). Check "
            "that the bucket exists and that the credentials may write and delete there (AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or ~/.aws/credentials; AWS_ENDPOINT_URL_S3 for a server other than AWS). Nothing "
            "was trained or saved.")


def close_store(ref: str) -> None:
    """End the client session of `ref`'s store, where it keeps one (object stores). Local."""
    store_for(ref).close()


class LocalAlias:
    """A local stand-in for a checkpoint in object storage, for the Trainer's own resume code (see the module
    docstring): a temporary folder per process with its trainer state (the best checkpoint taken out of it: the
    Trainer would drop a URL it cannot `os.path.isdir`; `best_model_checkpoint` is put back by the plugin), and
    the other small files `manifest` lists (the scaler, the files a class's `_save_checkpoint` wrote, which its load
    hooks read; not the tensor files, their indexes nor the ranks' RNG states, which the plugin reads from the
    bucket itself). Removed by `close`."""

    def __init__(self, remote: str, manifest: dict | None = None):
        self.remote = as_ref(remote)
        self.path = tempfile.mkdtemp(prefix="hf_unified_ckpt-resume-")
        state = read_json(join(self.remote, TRAINER_STATE_FILE), "trainer state")
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"{join(self.remote, TRAINER_STATE_FILE)} is not a JSON object.")
        self.best_model_checkpoint = state.get("best_model_checkpoint")
        state["best_model_checkpoint"] = None
        put_bytes(join(self.path, TRAINER_STATE_FILE), json.dumps(state).encode())
        listed = (manifest or {}).get("files", {SCALER_FILE: None})
        tensors = {f for entry in (manifest or {}).get("components", {}).values()
                   for f in [*entry.get("files", []), entry.get("index")] if f}
        for name in sorted(n for n in set(listed) - tensors - {TRAINER_STATE_FILE} if not n.startswith("rng_state")):
            if is_file(join(self.remote, name)):
                put_bytes(join(self.path, name), read_bytes(join(self.remote, name)))

    def close(self) -> None:
        remove(self.path)
