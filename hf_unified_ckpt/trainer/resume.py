"""Which folder a Trainer resumes from, checked before anything trains: `resolve` picks it (`True`: the newest
checkpoint the machines together hold completely), verifies a unified one (copying its small files into every
machine's folder first), refuses what cannot be loaded, and says what the plugin loads itself (`Resume`)."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.folder.layout import (DEEPSPEED, FSDP, HF_TRAINER, UNIFIED, UNIFIED_INCOMPLETE, Layout, detect_layout,
                                 newest_complete)
from ..checkpoint.load.loading import fetch_small_files, verify_checkpoint
from ..checkpoint.load.placement import Placement, judge_path, newest_across_machines, placement_of
from ..checkpoint.folder.rng import read_rng_file, rng_file_name
from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                      UnifiedCheckpointError, UnsupportedCheckpointError)
from ..legacy import check_readable, open_legacy
from ..store import as_ref, canonical, join, parent_of, read_bytes
from ..store.pickles import load_pickle
from .capture import SCALER_FILE, SCHEDULER_FILE, TRAINER_STATE_FILE
from .engines import engine_of
from .storage import checkpoint_root, is_remote, memory_root

logger = logging.getLogger(__name__)

#: `train(resume_from_checkpoint=RESUME_AUTO)`: the newest complete checkpoint of the run (in `output_dir`, or
#: `unified_checkpoint_storage`) when there is one, else a fresh start: what a job that a scheduler requeues after
#: a preemption wants on every start, its first too.
RESUME_AUTO = "auto"


@dataclass(frozen=True)
class Resume:
    """What `train` resolved: a verified unified folder (manifest) or a legacy folder read offline (legacy)."""

    layout: Layout
    manifest: dict | None = None
    legacy: object | None = None
    placement: Placement | None = None

    @property
    def saved_world_size(self) -> int:
        if self.legacy is not None:
            return self.legacy.world_size
        return int(self.manifest.get("saved_by", {}).get("world_size", 1))


def resolve(trainer, value) -> tuple[str | None, Resume | None]:
    """The folder `trainer` resumes from (`resume_from_checkpoint`: None, True, `RESUME_AUTO` or a path), checked, and what this
    plugin loads itself from it (None: the Trainer's own resume loads it); each rank looks at its own copy of the
    path, and a unified checkpoint counts when the machines' folders together hold all of it. Refuses what cannot be
    loaded, before anything trains. Collective: all ranks must call it."""
    if value is None or value is False:
        return None, None
    if value is True or value == RESUME_AUTO:
        run_dir, step, verdict, skipped = newest_across_tiers(trainer)
        for newer, why in skipped:
            if dist.rank() == 0:
                logger.warning("Skipping %s when resuming: %s", join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{newer}"),
                               why.reason)
        if verdict is None and value == RESUME_AUTO:
            if dist.rank() == 0:
                logger.info("resume_from_checkpoint='auto': %s holds no complete checkpoint yet; starting fresh.",
                            run_dir)
            return None, None
        if verdict is None:
            raise CheckpointNotFoundError(
                f"No valid checkpoint found in output directory ({run_dir}): resume_from_checkpoint=True, but it holds "
                "no complete checkpoint-N folder (unified or legacy). Start without resuming, pass a path, or pass "
                f"resume_from_checkpoint={RESUME_AUTO!r} (resume when there is one, else start fresh).")
        path = join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    else:
        path = as_ref(value)
        verdict = judge_path(path)
    if verdict.kind == UNIFIED:
        refuse_without_trainer_state(path, verdict)
        return path, check_unified(path, verdict, show_progress=not trainer.args.disable_tqdm)
    layout = detect_layout(path)
    check_loadable(layout)
    engine = engine_of(trainer)
    if layout.kind == HF_TRAINER and engine.native_folder_refusal:
        raise UnsupportedCheckpointError(engine.native_folder_refusal.format(path=path))
    if not verdict.complete:  # this rank sees it whole, another does not
        raise IncompleteCheckpointError(f"{path}: {verdict.reason}.")
    resume, trust = None, trainer.args.unified_checkpoint_options.trust_pickles
    if layout.kind == FSDP:  # always read offline: works from and into every engine and world size
        resume = Resume(layout, legacy=open_legacy(layout, trust_pickles=trust))
    elif layout.kind == DEEPSPEED:  # its pickles read (or refused) here, also where DeepSpeed then loads it
        legacy = open_legacy(layout, trust_pickles=trust)
        if legacy.topology() == engine.topology(trainer):
            legacy.vet_for_deepspeed()  # DeepSpeed loads it itself, unpickling every file whole
        else:
            check_readable(legacy)
            resume = Resume(layout, legacy=legacy)  # resharded offline; native DeepSpeed refuses
            if dist.rank() == 0:
                logger.info("%s was written by DeepSpeed %s; this run differs, so it is read offline and "
                            "resharded (the next save is unified).", layout.path, legacy.topology())
    return layout.path, resume


def newest_across_tiers(trainer) -> tuple[str, int | None, object, list]:
    """The run folder, step, verdict and skipped newer steps of the newest checkpoint the ranks together hold
    completely, in durable storage or (with `flash`) in the machines' memory; memory wins a tie (it is faster to
    read). Collective: all ranks must call it."""
    durable = checkpoint_root(trainer)
    step, verdict, skipped = newest_across_machines(durable)
    memory = memory_root(trainer)
    if memory is None:
        return durable, step, verdict, skipped
    in_memory = newest_across_machines(memory)
    if in_memory[1] is not None and (verdict is None or in_memory[0] >= step):
        if dist.rank() == 0:
            logger.info("Resuming from memory: %s holds checkpoint-%d (durable storage: %s).", memory, in_memory[0],
                        f"checkpoint-{step}" if verdict is not None else "none")
        return memory, *in_memory
    return durable, step, verdict, skipped


def check_unified(path: str, verdict, show_progress: bool = True) -> Resume:
    """A unified checkpoint, perhaps spread over machine-local folders: refuse it if the union is
    incomplete, copy the small files into every folder, verify every file on a rank that sees it.
    Collective: all ranks call it."""
    if not verdict.complete:
        raise CorruptCheckpointError(verdict.refusal(path))
    placement = fetch_small_files(path, verdict.manifest, placement_of(verdict))
    manifest = verify_checkpoint(path, show_progress=show_progress, placement=placement,
                                 checked_on_read=is_remote(path))  # object storage: blocks checked as read
    refuse_unsafe_pickles(path, manifest["files"])
    if not placement.everywhere and dist.rank() == 0:
        logger.info("Resuming from %s, whose files are spread over the machines' folders: ranks read the "
                    "tensors they lack from ranks that hold them.", path)
    layout = Layout(UNIFIED, path, True, manifest.get("global_step"), manifest=manifest)
    return Resume(layout, manifest=manifest, placement=placement)


def refuse_unsafe_pickles(path: str, listed) -> None:
    """Unpickle now, with the loaders the resume uses later (`weights_only` and their allow-lists: nothing runs),
    the pickled small files this rank will read (the scheduler's and the scaler's state, its own RNG state and rank
    0's, which ranks without their own use), so that one needing another global is refused before anything loads,
    not after the weights are in. Collective: all ranks call it (one all-reduce of a status; the messages are
    gathered only on a refusal); a refusal on one rank is raised on every rank."""
    error = None
    try:
        for name in (SCHEDULER_FILE, SCALER_FILE):
            if name in listed:
                load_pickle(io.BytesIO(read_bytes(join(path, name))), str(join(path, name)))
        for name in dict.fromkeys((rng_file_name(dist.rank()), rng_file_name(0), "rng_state.pth")):
            if name in listed:
                read_rng_file(join(path, name))
    except UnifiedCheckpointError as e:  # shared below, so that no rank loads on after another refused
        error = e
    if dist.all_reduce_ints([int(error is not None)]) == [0]:  # 8 bytes per rank; the messages only on a refusal
        return
    failures = [f for f in dist.all_gather_object(None if error is None else f"rank {dist.rank()}: {error}") if f]
    if error is not None:
        raise error
    if failures:
        raise UnsupportedCheckpointError(f"{path} was refused on other ranks:\n" + "\n".join(failures))


def check_loadable(layout: Layout) -> None:
    """Refuse a folder that is not a complete checkpoint this library knows, saying what it is and what to do."""
    if layout.kind == UNIFIED:  # committed: damage is reported file by file by verify_checkpoint
        return
    if layout.unsupported:
        raise UnsupportedCheckpointError(layout.reason.removeprefix("manifest unusable: "))
    if layout.kind == UNIFIED_INCOMPLETE:
        newest = newest_complete(parent_of(layout.path))
        raise IncompleteCheckpointError(
            f"{layout.path} is not a complete unified checkpoint: {layout.reason}. "
            + (f"The newest complete checkpoint next to it is {newest.path}." if newest else
               "There is no complete checkpoint next to it.")
            + " Resume from a complete one (resume_from_checkpoint=True picks it)."
        )
    if layout.kind in (HF_TRAINER, DEEPSPEED, FSDP):
        if not layout.complete:
            raise IncompleteCheckpointError(f"{layout.path} ({layout.kind}) is incomplete: {layout.reason}.")
        return
    raise CheckpointNotFoundError(f"Can't find a valid checkpoint at {layout.path}: it is not a checkpoint this "
                                  f"library knows ({layout.reason}).")


def refuse_without_trainer_state(path: str, verdict) -> None:
    """A complete unified folder converted from a model folder (`Trainer.save_model`) has weights and optimizer
    state but no trainer state: training cannot resume from it. The same on every rank (same manifest)."""
    if verdict.complete and TRAINER_STATE_FILE not in verdict.manifest["files"]:
        raise UnsupportedCheckpointError(
            f"{path} holds no {TRAINER_STATE_FILE} (it was converted from a model folder written by "
            "Trainer.save_model), so training cannot resume from it; load it with from_pretrained to start a new run "
            "from its weights, or resume from a checkpoint-N folder.")


def same_ref(a, b) -> bool:
    """Whether two references name the same checkpoint (local paths compared normalised)."""
    return canonical(a) == canonical(b)
