"""Tell what a checkpoint folder is from file names, JSON and safetensors headers alone (no tensor data).

Kinds: `unified` (manifest present and valid), `unified-incomplete` (unified files but no valid manifest: an
interrupted save), `hf-trainer` (the plain Trainer's model + optimizer.pt + trainer_state.json), `deepspeed`
(`global_step*/` ZeRO partitions), `fsdp` (`pytorch_model_fsdp*` / `optimizer_0`), `unknown`.

A legacy `checkpoint-N` folder is complete only with its trainer_state.json (the Trainer writes it last). One
exception: a DeepSpeed folder whose name does not start with `checkpoint-` and that lacks it is what
`Trainer.save_model(dir)` writes under ZeRO-3 without `stage3_gather_16bit_weights_on_model_save` (config.json, the
ZeRO partitions, no weights file): a model folder, complete for conversion, with `trainer_state=False` (not
resumable).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ...errors import CorruptCheckpointError, NotRegularFileError, UnifiedCheckpointError, UnsupportedCheckpointError
from ...store import as_ref, is_folder, join, listing, name_of, read_bytes, store_for
from .commit import CHECKPOINT_RE, STAGING_SUFFIX, list_checkpoints
from .files import read_json
from .manifest import MANIFEST_NAME, read_manifest
from .safetensors_header import read_safetensors_header

UNIFIED, UNIFIED_INCOMPLETE, HF_TRAINER, DEEPSPEED, FSDP, UNKNOWN = (
    "unified", "unified-incomplete", "hf-trainer", "deepspeed", "fsdp", "unknown")
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
SAVE_MODEL_NOTE = (f"written by Trainer.save_model (DeepSpeed ZeRO partitions, no weights file, no {TRAINER_STATE}): "
                   "a model folder, not a Trainer checkpoint; `hf-unified-ckpt convert` turns it into a unified "
                   "folder that from_pretrained loads")
_DEEPSPEED_TAG_RE = re.compile(r"^global_step(\d+)$")
_UNIFIED_ONLY = ("optimizer", "master_weights", "ema")
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class Layout:
    """What `detect_layout` found. `complete` is structural (files present, sizes/headers sane); checksums are
    checked by `verify`."""

    kind: str
    path: str  # a store reference
    complete: bool
    global_step: int | None = None
    reason: str = ""
    manifest: dict | None = field(default=None, repr=False)
    #: The folder holds the Trainer's state (trainer_state.json): a complete one can be resumed. A complete folder
    #: without it is a model folder written by `Trainer.save_model` (convert it) or a unified folder converted from one.
    trainer_state: bool = True
    #: The manifest is of a format version this library does not read (`UnsupportedCheckpointError`, raised by a
    #: resume from this folder; the folder is skipped when looking for the newest complete one).
    unsupported: bool = False

    @property
    def committed(self) -> bool:
        """Written to the end: a unified folder with a valid manifest (even if its files are spread over several
        machines' folders), or a complete legacy folder."""
        return self.kind == UNIFIED or self.complete

    @property
    def not_unified_why(self) -> str:
        """Why this is no complete unified checkpoint, in words (a complete legacy folder has no `reason`)."""
        if self.kind in (DEEPSPEED, FSDP, HF_TRAINER) and self.complete:
            return (f"a complete legacy {self.kind} checkpoint: training resumes from it as it is, and "
                    "`hf-unified-ckpt convert` writes a unified copy")
        return self.reason


def detect_layout(path: str | os.PathLike) -> Layout:
    """What folder `path` is (see the module docstring). Never raises for what the folder holds: a folder that
    cannot be listed, a malformed or hostile manifest, a special file are described in `reason`."""
    path = as_ref(path)
    try:
        entries = store_for(path).list(path)
    except OSError as e:  # not readable (permissions)
        return Layout(UNKNOWN, path, False, reason=f"{path} cannot be listed: {e}")
    if not entries and not is_folder(path):
        return Layout(UNKNOWN, path, False, reason=f"{path} is not a directory")
    names = set(entries)
    if MANIFEST_NAME in names:
        return _unified(path, entries)
    if name_of(path).endswith(STAGING_SUFFIX) or any(n.startswith(_UNIFIED_ONLY) and n.endswith((".safetensors", ".json"))
                                                     for n in names):
        return Layout(UNIFIED_INCOMPLETE, path, False, _step(path),
                      f"{MANIFEST_NAME} is missing: the save was interrupted before it was committed")
    if any(n.startswith("global_step") and entries[n] is None for n in names):
        return _legacy(path, DEEPSPEED, _deepspeed_problem(path, names), entries)
    if any(n.startswith(("pytorch_model_fsdp", "optimizer_0")) or n == "optimizer.bin" for n in names):
        return _legacy(path, FSDP, None, entries)
    if TRAINER_STATE in names or names & set(_HF_WEIGHTS):
        return _legacy(path, HF_TRAINER, _hf_problem(path, names), entries)
    return Layout(UNKNOWN, path, False, _step(path),
                  f"no checkpoint files found (expected {MANIFEST_NAME}, {TRAINER_STATE}, model weights, "
                  f"global_step*/ or pytorch_model_fsdp*); found: {sorted(names)[:10]}")


def _unified(path: str, entries: dict[str, int | None]) -> Layout:
    try:
        manifest = read_manifest(path)
    except (UnifiedCheckpointError, OSError) as e:
        return Layout(UNIFIED_INCOMPLETE, path, False, _step(path), f"manifest unusable: {e}",
                      unsupported=isinstance(e, UnsupportedCheckpointError))
    missing = [n for n, rec in manifest["files"].items() if entries.get(n) != rec["size"]]
    reason = (f"files missing or of the wrong size: {missing[:10]}{'...' if len(missing) > 10 else ''} (if it was "
              "saved by a job whose machines each had a local folder, the other machines hold them)") if missing else ""
    return Layout(UNIFIED, path, not missing, manifest.get("global_step"), reason, manifest,
                  trainer_state=TRAINER_STATE in manifest["files"])


def _legacy(path: str, kind: str, problem: str | None, entries: dict[str, int | None]) -> Layout:
    problem = problem or _special_file(path, entries)
    trainer_state = entries.get(TRAINER_STATE) is not None
    if problem is None and not trainer_state:
        if kind == DEEPSPEED and not name_of(path).startswith(CHECKPOINT_PREFIX):
            return Layout(kind, path, True, _deepspeed_step(path, entries), SAVE_MODEL_NOTE, trainer_state=False)
        problem = f"{TRAINER_STATE} is missing (the Trainer writes it last; the save did not finish)"
    return Layout(kind, path, problem is None, _step(path), problem or "", trainer_state=trainer_state)


def _special_file(path: str, entries: dict[str, int | None]) -> str | None:
    """The first file of a legacy folder (its own entries and those of its sub-folders) that is not a regular file
    (a FIFO, a device, a link to a file): such a folder is not read (legacy readers open files by path), so nothing
    hangs on it."""
    store = store_for(path)
    for name, size in sorted(entries.items()):
        try:
            if size is not None:
                store.size(join(path, name))
                continue
            for inner, inner_size in sorted(store.list(join(path, name)).items()):
                if inner_size is not None:
                    store.size(join(path, name, inner))
        except NotRegularFileError as e:
            return str(e)
        except OSError:  # not readable: the reader names it
            continue
    return None


def _deepspeed_problem(path: str, names: set[str]) -> str | None:
    for d in sorted(n for n in names if n.startswith("global_step")):
        try:
            files = listing(join(path, d))
        except OSError:  # not readable
            continue
        if any(f.endswith("optim_states.pt") for f in files) and any(f.endswith("model_states.pt") for f in files):
            return None
    return "no global_step*/ folder holds both *model_states.pt and *optim_states.pt"


def _hf_problem(path: str, names: set[str]) -> str | None:
    weights = names & set(_HF_WEIGHTS)
    if not weights:
        return f"no model weights ({', '.join(_HF_WEIGHTS)})"
    for name in weights:
        if name.endswith(".safetensors"):
            try:
                read_safetensors_header(join(path, name))
            except CorruptCheckpointError as e:
                return str(e)
    return None


def _deepspeed_step(path: str, entries: dict[str, int | None]) -> int | None:
    """The N of the DeepSpeed tag `global_stepN` that the `latest` file names (else of the only `global_step*`
    folder); None for another tag."""
    try:
        tag = read_bytes(join(path, "latest")).decode().strip()
    except (OSError, UnicodeDecodeError):
        tags = [n for n, size in entries.items() if _DEEPSPEED_TAG_RE.match(n) and size is None]
        tag = tags[0] if len(tags) == 1 else ""
    match = _DEEPSPEED_TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def _step(path: str) -> int | None:
    try:
        step = read_json(join(path, TRAINER_STATE), "trainer state")["global_step"]
        if isinstance(step, int) and not isinstance(step, bool):
            return step
        raise TypeError(step)
    except (OSError, UnifiedCheckpointError, KeyError, TypeError):
        match = CHECKPOINT_RE.match(name_of(path).removeprefix(".").removesuffix(STAGING_SUFFIX))
        return int(match.group(1)) if match else None


def newest_complete(run_dir: str | os.PathLike) -> Layout | None:
    """The complete checkpoint (unified or legacy) with the highest step in `run_dir`, or None."""
    for _, path in reversed(list_checkpoints(run_dir)):
        layout = detect_layout(path)
        if layout.complete:
            return layout
    return None
