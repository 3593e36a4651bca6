"""The only module that touches `transformers.Trainer` internals (checked against transformers 5.x).

`attach(trainer)` gives one Trainer instance (Trainer, SFTTrainer, DPOTrainer, ...) the unified save and
resume paths by switching that instance to a subclass with `UnifiedCheckpointMixin` first in its bases, and
adds a `UnifiedCheckpointCallback`. Nothing is patched globally. The mixin overrides:

- `train`: refuses what a save could not handle (before anything trains), resolves `resume_from_checkpoint`
  (True -> newest *complete* checkpoint), tells the folder's kind and verifies a unified folder's files before
  anything is loaded; refuses what it cannot load, loudly;
- `_load_from_checkpoint` / `_prepare_for_training`: a unified folder is loaded after the engine is prepared
  (`super()._prepare_for_training(..., None)` keeps the Trainer's own trainer-state restore and data skip); the
  prepared engine is described once as a save would, so its refusals come before the first step;
- `_load_rng_state`: per-rank RNG with one warning when the world size changed;
- `_save_checkpoint`: replaces the native checkpoint write by the unified one (not written twice);
- `_load_best_model`: `load_best_model_at_end` from a unified checkpoint into any engine;
- `save_model`: under DeepSpeed and FSDP, weights that `from_pretrained` loads, whatever the stage or state-dict
  type (one process and DDP keep the Trainer's own).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import io
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.async_save import AsyncSaver
from ..format.components import MASTER, MODEL, OPTIMIZER
from ..engines.base import LoadSources
from ..engines.replicated import ReplicatedEngine
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError
from ..checkpoint.layout import DEEPSPEED, FSDP, HF_TRAINER, UNIFIED, UNIFIED_INCOMPLETE, Layout, detect_layout, newest_complete
from ..legacy import check_readable, legacy_components, open_legacy
from ..format.lineage import error_half_life, options_for_save, restored_step
from ..checkpoint.ema import BackgroundUpdates, ExponentialAverage, WithEma
from ..checkpoint.load import fetch_small_files, load_checkpoint, verify_checkpoint
from ..format.optim_state import fit_scheduler_state, group_param_names, match_groups
from ..checkpoint.placement import Placement, judge_path, newest_across_machines, placement_of
from ..checkpoint.retention import rotate_checkpoints
from ..checkpoint.rng import capture_rng_state, restore_rng_state, rng_file_name
from ..checkpoint.save import SaveRequest, save_checkpoint, save_model_weights
from ..store import as_ref, canonical, is_file, is_folder, join, parent_of, read_bytes
from ..store.capture import files_written_by, torch_bytes

logger = logging.getLogger(__name__)

SUPPORTED_TRANSFORMERS_MAJOR = 5
_REQUIRED_METHODS = ("train", "_prepare_for_training", "_load_from_checkpoint", "_load_rng_state",
                     "_save_checkpoint", "_get_output_dir", "store_flos", "_load_scaler", "_load_best_model",
                     "save_model", "push_to_hub")
SCHEDULER_FILE, TRAINER_STATE_FILE, ARGS_FILE, SCALER_FILE = (
    "scheduler.pt", "trainer_state.json", "training_args.bin", "scaler.pt")


@dataclass(frozen=True)
class _Resume:
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


_NATIVE_TP_REFUSAL = (
    "{path} was written by the Trainer's own save, and this run's model is sharded at load time (tensor "
    "parallelism). For such a model transformers saves only the weights (save_only_model=True: its optimizer state "
    "cannot be gathered; a forced optimizer.pt holds rank 0's shards only), so training cannot resume from it "
    "exactly. Start a new run from its weights: from_pretrained('{path}', tp_plan='auto'). Checkpoints this run "
    "saves are unified and resume at any TP degree or engine.")


class UnifiedCheckpointMixin:
    """Trainer mixin with the unified save and resume paths. Prefer `attach(trainer)` to subclassing, except for a
    model sharded at load time (tensor parallelism: `from_pretrained(..., tp_plan="auto")` or a
    `DistributedConfig`): `Trainer.__init__` refuses to checkpoint its optimizer state before any callback runs, so
    build it from a subclass, `class TPTrainer(UnifiedCheckpointMixin, Trainer)`, which lifts that refusal while
    the Trainer is built (unified checkpoints save every rank's shards) and attaches itself."""

    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        with _optimizer_state_checkpointable(model, training_args):
            super().__init__(*args, **kwargs)
        attach(self)

    # ---- resume -----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, with the resume folder resolved and verified first. Collective: all ranks call it."""
        self._uc_resume = None
        self._uc_quantized_restore = None  # lineage guard (lineage.py): step of the latest compressed restore
        options = self.args.unified_checkpoint_options
        self._uc_average = ExponentialAverage(options.ema_decay, options.ema_interval) if (
            options.enabled and options.ema) else None
        self._uc_updates = BackgroundUpdates(self._uc_average) if self._uc_average is not None else None
        self._uc_fragments = None
        self._uc_refuse_unsupported()
        path = self._uc_resolve(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=path, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                             **kwargs)

    def _uc_resolve(self, value) -> str | None:
        """Pick and check the folder to resume from; each rank looks at its own copy of the path, and a unified
        checkpoint counts when the machines' folders together hold all of it. Collective: all ranks call it."""
        if value is None or value is False:
            return None
        if value is True:
            step, verdict, skipped = newest_across_machines(self.args.output_dir)
            run_dir = as_ref(self.args.output_dir)
            for newer, why in skipped:
                if dist.rank() == 0:
                    logger.warning("Skipping %s when resuming: %s", join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{newer}"),
                                   why.reason)
            if verdict is None:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no complete "
                                 "checkpoint-N folder (unified or legacy). Start without resuming, or pass a path.")
            path = join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        else:
            path = as_ref(value)
            verdict = judge_path(path)
        if verdict.kind == UNIFIED:
            _refuse_without_trainer_state(path, verdict)
            self._uc_resume = self._uc_check_unified(path, verdict)
            return str(path)
        layout = detect_layout(path)
        self._uc_check_loadable(layout)
        if layout.kind == HF_TRAINER and _engine_of(self).name == "tensor_parallel":
            raise UnsupportedCheckpointError(_NATIVE_TP_REFUSAL.format(path=path))
        if not verdict.complete:  # this rank sees it whole, another does not
            raise IncompleteCheckpointError(f"{path}: {verdict.reason}.")
        if layout.kind == FSDP:  # always read offline: works from and into every engine and world size
            self._uc_resume = _Resume(layout, legacy=open_legacy(layout))
        elif layout.kind == DEEPSPEED:
            legacy = open_legacy(layout)
            if legacy.topology() != _engine_of(self).topology(self):
                check_readable(legacy)
                self._uc_resume = _Resume(layout, legacy=legacy)  # resharded offline; native DeepSpeed refuses
                if dist.rank() == 0:
                    logger.info("%s was written by DeepSpeed %s; this run differs, so it is read offline and "
                                "resharded (the next save is unified).", layout.path, legacy.topology())
        return str(layout.path)

    def _uc_check_unified(self, path: str, verdict) -> _Resume:
        """A unified checkpoint, perhaps spread over machine-local folders: refuse it if the union is
        incomplete, copy the small files into every folder, verify every file on a rank that sees it.
        Collective: all ranks call it."""
        if not verdict.complete:
            raise CorruptCheckpointError(verdict.refusal(path))
        placement = fetch_small_files(path, verdict.manifest, placement_of(verdict))
        manifest = verify_checkpoint(path, show_progress=not self.args.disable_tqdm, placement=placement)
        if not placement.everywhere and dist.rank() == 0:
            logger.info("Resuming from %s, whose files are spread over the machines' folders: ranks read the "
                        "tensors they lack from ranks that hold them.", path)
        layout = Layout(UNIFIED, path, True, manifest.get("global_step"), manifest=manifest)
        return _Resume(layout, manifest=manifest, placement=placement)

    def _uc_check_loadable(self, layout: Layout) -> None:
        if layout.kind == UNIFIED:  # committed: damage is reported file by file by verify_checkpoint
            return
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
        raise UnsupportedCheckpointError(f"{layout.path} is not a checkpoint this library knows: {layout.reason}.")

    def _uc_refuse_unsupported(self) -> None:
        """Refuse here, before anything trains, what a save would refuse later; warn once (rank 0) when FSDP was
        asked for but the engine is another (accelerate falls back to DDP on CPU without a word)."""
        options = self.args.unified_checkpoint_options
        if options.async_save and self.args.push_to_hub:
            raise UnsupportedCheckpointError("async_save with push_to_hub is not supported yet: the upload would run "
                                             "before the background save commits. Drop one of them.")
        refusal = _engine_of(self).refusal(self)
        if refusal:
            raise UnsupportedCheckpointError(refusal)
        kind = _engine_of(self).name
        asked = self.args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
        if asked and kind != "fsdp" and dist.rank() == 0:
            logger.warning("FSDP was requested (the fsdp argument or an accelerate FSDP config) but the model is "
                           "trained with %s: accelerate "
                           "applies FSDP only on accelerators and falls back to DDP on CPU. Checkpoints are saved "
                           "for the engine that runs.",
                           {"deepspeed": "DeepSpeed", "tensor_parallel": "tensor parallelism"}.get(
                               kind, "DDP" if dist.world_size() > 1 else "one process"))

    def _uc_resuming(self, checkpoint) -> _Resume | None:
        resume = getattr(self, "_uc_resume", None)
        if resume is not None and checkpoint is not None and same_ref(checkpoint, resume.layout.path):
            return resume
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._uc_resuming(resume_from_checkpoint):
            return None  # loaded into the prepared engine in _prepare_for_training
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        resume = self._uc_resuming(resume_from_checkpoint)
        if resume is None:
            prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
            self._uc_preflight()
            return prepared
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        self._uc_preflight()
        folder, engine = resume.layout.path, self._uc_engine()
        if resume.legacy is not None:
            sources = legacy_components(resume.legacy, for_loading=True)
            engine.load(LoadSources(sources, resume.legacy.global_step))
            optimizer = sources.get(OPTIMIZER.name)
            saved_groups = group_param_names(optimizer.metadata) if optimizer is not None else None
        else:
            saved_groups = load_checkpoint(folder, engine, resume.manifest, self.args.unified_checkpoint_options,
                                           placement=resume.placement)
            self._uc_quantized_restore = restored_step(resume.manifest)
        if self._uc_average is not None and not self._uc_average.parts and dist.rank() == 0:
            logger.warning("Resuming from %s, which holds no EMA of the weights: the EMA starts again from the "
                           "weights at its first update.", folder)
        self._uc_load_scheduler(folder, saved_groups, engine)
        self._load_scaler(str(folder))
        logger.info("Resumed from %s checkpoint %s", resume.layout.kind, folder)
        return model, train_dataloader

    def _uc_load_scheduler(self, folder: str, saved_groups: list[list[str]] | None, engine) -> None:
        """Load the scheduler the checkpoint holds, its per-group values fitted to this optimizer's param groups
        (DeepSpeed drops the empty groups that DDP and FSDP keep). Collective under FSDP: all ranks call it."""
        if self.lr_scheduler is None or not is_file(join(folder, SCHEDULER_FILE)):
            return
        saved = torch.load(io.BytesIO(read_bytes(join(folder, SCHEDULER_FILE))), weights_only=True)
        if saved_groups is not None:
            matched = match_groups(saved_groups, engine.param_group_names())
            saved = fit_scheduler_state(saved, self.lr_scheduler.state_dict(), matched)
        self.lr_scheduler.load_state_dict(saved)

    def _uc_preflight(self) -> None:
        """Describe the prepared engine's model the way every save will, so whatever a save would refuse (an
        engine or model it cannot handle) is refused before the first step. Collective: all ranks call it."""
        options = self.args.unified_checkpoint_options
        if options.enabled:
            engine = self._uc_engine()
            engine.specs(MODEL.name)
            if options.ema:
                engine.parameter_fragments()  # refuses an engine the EMA cannot follow (FSDP1)
                _engine_of(self).step_barrier(self, self._uc_wait_for_copies)
            if options.residual_master_weight and MASTER not in engine.components() and dist.rank() == 0:
                logger.warning("residual_master_weight has no effect in this run: it keeps no fp32 master weights "
                               "apart from its weights (only DeepSpeed bf16 training does), so there is nothing to "
                               "store as a residual.")

    def _load_best_model(self):
        """`load_best_model_at_end`: a unified best checkpoint is loaded into whatever the engine is (weights, and
        fp32 master weights where the engine keeps them; not the optimizer), verified first. Collective."""
        path = as_ref(self.state.best_model_checkpoint)
        verdict = judge_path(path)
        if verdict.kind != UNIFIED:
            return super()._load_best_model()
        best = self._uc_check_unified(path, verdict)
        load_checkpoint(path, self._uc_engine(), best.manifest, self.args.unified_checkpoint_options,
                        load_optimizer=False, placement=best.placement)
        if dist.rank() == 0:
            logger.info("Loaded the best model from %s (%s: %s).", path, self.args.metric_for_best_model,
                        self.state.best_metric)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Under DeepSpeed and FSDP with `unified_checkpoint=True`: write weights that `from_pretrained` loads
        (assembled by name on rank 0), with configs, tokenizer and training args, whatever the ZeRO stage or FSDP
        state-dict type. One process and DDP keep the Trainer's own `save_pretrained`. Collective under DeepSpeed
        and FSDP: all ranks call it, as the Trainer requires there."""
        if not self.args.unified_checkpoint_options.enabled or _engine_of(self).name == "replicated":
            return super().save_model(output_dir, _internal_call)
        folder = as_ref(output_dir if output_dir is not None else self.args.output_dir)
        engine = self._uc_engine()
        small = {**engine.config_files(), **self._uc_processing_class_files(), ARGS_FILE: torch_bytes(self.args)}
        save_model_weights(engine, folder, self.args.unified_checkpoint_options.max_shard_size, small,
                           show_progress=not self.args.disable_tqdm)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _uc_processing_class_files(self) -> dict[str, bytes]:
        """The tokenizer's (or processor's) files, as its `save_pretrained` writes them: name -> bytes."""
        if self.processing_class is None or not hasattr(self.processing_class, "save_pretrained"):
            return {}
        return files_written_by(self.processing_class.save_pretrained)

    def _load_rng_state(self, checkpoint):
        resume = self._uc_resuming(checkpoint)
        if resume is None:
            return super()._load_rng_state(checkpoint)
        lost = restore_rng_state(checkpoint, dist.rank(), resume.saved_world_size, dist.world_size())
        if lost and dist.rank() == 0:
            logger.warning("Resuming from %s: %s", checkpoint, lost)

    # ---- save -------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        """Write a unified checkpoint instead of the native one. Collective: all ranks call it."""
        options = self.args.unified_checkpoint_options
        if not options.enabled:
            return super()._save_checkpoint(model, trial)
        options = self._uc_save_options(options)
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = as_ref(self._get_output_dir(trial=trial))
        output_dir = join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        saver = _saver(self)
        saver.wait()  # one save in flight: the previous one commits (or raises) before this one starts
        self._uc_ema_ready()
        self._uc_track_best(run_dir)
        self._uc_export_callback_states()
        request = SaveRequest(output_dir, self.state.global_step, options,
                              include_optimizer=not self.args.save_only_model,
                              show_progress=not self.args.disable_tqdm)
        engine = self._uc_engine()
        best = self.state.best_model_checkpoint

        def rotate():  # run by the rank that committed each folder (one per machine-local folder)
            rotate_checkpoints(run_dir, self.args.save_total_limit, protect=[best, output_dir])

        small = self._uc_small_files(engine)
        if options.async_save:
            _engine_of(self).step_barrier(self, self._uc_wait_for_copies)
            saver.start(engine, request, small, after_commit=rotate)
            return
        save_checkpoint(engine, request, small, after_commit=rotate)
        if self.args.push_to_hub:
            self._push_from_checkpoint(str(output_dir))

    def _uc_save_options(self, options):
        """The options of this save: the lineage guard may write it at O0 (lineage.py), said once per run."""
        restore = getattr(self, "_uc_quantized_restore", None)
        half_life = error_half_life(self.optimizer.param_groups if self.optimizer is not None else [])
        chosen = options_for_save(options, self.state.global_step, restore, half_life)
        if chosen.quant_stage_requested and not getattr(self, "_uc_guard_said", False) and dist.rank() == 0:
            self._uc_guard_said = True
            logger.info("Checkpoint compression: saves are written at O0 (not %s) until the quantisation error of "
                        "the restore at step %d has halved (%.0f steps for this optimizer's slowest moment), so "
                        "errors never stack.", options.quant_stage, restore, half_life)
        return chosen

    def _uc_engine(self):
        """The adapter of the engine this trainer runs (a new one per save or load), with the EMA component when
        the EMA is on."""
        engine = _engine_of(self).build(self)
        average = getattr(self, "_uc_average", None)
        return engine if average is None else WithEma(engine, average)

    def _uc_ema_step(self, step: int) -> None:
        """Start folding this rank's weights into the EMA, in the background, when an update is due after
        optimizer step `step`. Local only."""
        average = getattr(self, "_uc_average", None)
        if average is not None and average.due(step):
            self._uc_updates.submit(self._uc_ema_fragments())

    def _uc_ema_fragments(self) -> dict:
        if self._uc_fragments is None:
            self._uc_fragments = _engine_of(self).build(self).parameter_fragments()
        return self._uc_fragments

    def _uc_ema_ready(self) -> None:
        """Before a save: the update in flight is folded in; a save before the first update starts the average
        from the weights there."""
        if getattr(self, "_uc_average", None) is not None:
            self._uc_updates.wait()
            if not self._uc_average.parts:
                self._uc_average.update(self._uc_ema_fragments())

    def _uc_wait_for_copies(self) -> None:
        """Before an optimizer step: the async save's snapshot and the EMA's copy of the weights are taken."""
        _saver(self).wait_for_snapshot()
        if getattr(self, "_uc_updates", None) is not None:
            self._uc_updates.wait_for_copy()

    def _uc_small_files(self, engine) -> dict[str, bytes]:
        """This rank's non-tensor files, captured now as bytes (an async save writes them later, in the
        background): its RNG state; on rank 0 also the trainer state, scheduler and scaler, configs, tokenizer and
        training args."""
        full = not self.args.save_only_model
        out = {rng_file_name(dist.rank()): torch_bytes(capture_rng_state())} if full else {}
        if dist.rank() != 0:
            return out
        out.update(engine.config_files())
        out.update(self._uc_processing_class_files())
        out[ARGS_FILE] = torch_bytes(self.args)
        scaler = getattr(self.accelerator, "scaler", None)
        if full and self.lr_scheduler is not None:
            out[SCHEDULER_FILE] = torch_bytes(self.lr_scheduler.state_dict())
        if full and scaler is not None:
            out[SCALER_FILE] = torch_bytes(scaler.state_dict())
        out[TRAINER_STATE_FILE] = trainer_state_bytes(self.state)
        return out

    def _uc_track_best(self, run_dir: str) -> None:
        """Same bookkeeping as the native `_save_checkpoint` for `best_model_checkpoint`."""
        if self.args.save_strategy in ("steps", "epoch", "best") and self.state.best_global_step:
            dist.barrier()
            best = join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if is_folder(best):
                self.state.best_model_checkpoint = best

    def _uc_export_callback_states(self) -> None:
        """Same as the native `_save_checkpoint`: store `ExportableState` callbacks in the trainer state."""
        from transformers.trainer_callback import ExportableState

        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = type(cb).__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state


def _master_policy(options) -> str:
    if options.remove_master_weight:
        return "remove"
    return "as_model" if options.skip_save_model_weight else "save"


def _refuse_without_trainer_state(path: str, verdict) -> None:
    """A complete unified folder converted from a model folder (`Trainer.save_model`) has weights and optimizer
    state but no trainer state: training cannot resume from it. The same on every rank (same manifest)."""
    if verdict.complete and TRAINER_STATE_FILE not in verdict.manifest["files"]:
        raise UnsupportedCheckpointError(
            f"{path} holds no {TRAINER_STATE_FILE} (it was converted from a model folder written by "
            "Trainer.save_model), so training cannot resume from it; load it with from_pretrained to start a new run "
            "from its weights, or resume from a checkpoint-N folder.")


def _no_topology(trainer) -> None:
    return None


def _nothing_refused(trainer) -> str | None:
    return None


def _callback_waits(trainer, wait) -> None:
    """The optimizer step runs outside backward: `UnifiedCheckpointCallback.on_pre_optimizer_step` waits."""


@dataclass(frozen=True)
class _Engine:
    """What the integration needs to know about one training engine, answered from the Trainer. Registered in
    `_ENGINES` (the first that matches is the one running); nothing else in this module branches on engines."""

    name: str
    matches: Callable[[object], bool]
    build: Callable[[object], object]  # the EngineAdapter for this trainer's prepared engine
    topology: Callable[[object], dict | None] = _no_topology  # what a legacy folder must match to load natively
    step_barrier: Callable[[object, Callable[[], None]], None] = _callback_waits  # async snapshot vs optimizer step
    refusal: Callable[[object], str | None] = _nothing_refused  # why this run cannot be checkpointed, checked in train()


def _build_deepspeed(trainer):
    from ..engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(trainer.model_wrapped, _master_policy(trainer.args.unified_checkpoint_options))


def _deepspeed_topology(trainer) -> dict:
    """World size, ZeRO stage and bf16 of this DeepSpeed run (a legacy DeepSpeed folder that matches them is loaded
    by DeepSpeed itself)."""
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return {"world_size": dist.world_size(), "zero_stage": int(config.get("zero_optimization", {}).get("stage", 0)),
            "bf16": bool(trainer.args.bf16), "autotp_size": _autotp_size(config)}


def _deepspeed_step_barrier(trainer, wait) -> None:
    """DeepSpeed steps inside backward, where no callback runs: its optimizer's own step waits."""
    from ..engines.deepspeed import wait_before_steps

    wait_before_steps(trainer.model_wrapped, wait)


def _autotp_size(config: dict) -> int:
    return int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def _deepspeed_refusal(trainer) -> str | None:
    """DeepSpeed AutoTP is supported with ZeRO-1/2 (`engines/autotp.py`); with ZeRO-3 each rank's partition is of
    its TP slice, which the ZeRO-3 reader does not follow."""
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    size, stage = _autotp_size(config), int(config.get("zero_optimization", {}).get("stage", 0))
    if size > 1 and stage == 3:
        return (f"DeepSpeed AutoTP (tensor_parallel.autotp_size={size}) with ZeRO stage 3 is not supported by unified "
                "checkpoints: use AutoTP with ZeRO stage 1 or 2, ZeRO-3 without autotp_size, or transformers' tensor "
                "parallelism (from_pretrained(..., tp_plan='auto')).")
    return None


def _build_fsdp(trainer):
    from ..engines.fsdp import FSDPEngine

    return FSDPEngine(trainer.model_wrapped, trainer.optimizer)


def _sharded_at_load(trainer) -> bool:
    """transformers sharded the model itself when loading it (tensor parallelism, alone or with FSDP2: `tp_plan`,
    `DistributedConfig`); the Trainer then leaves it unwrapped, with DTensor parameters."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))


def _build_tensor_parallel(trainer):
    from ..engines.fsdp import FSDPEngine

    return FSDPEngine(trainer.model_wrapped, trainer.optimizer, kind="tensor_parallel")


_ENGINES = (
    _Engine("deepspeed", lambda t: getattr(t, "is_deepspeed_enabled", False), _build_deepspeed,
            topology=_deepspeed_topology, step_barrier=_deepspeed_step_barrier, refusal=_deepspeed_refusal),
    _Engine("fsdp", lambda t: getattr(t, "is_fsdp_enabled", False), _build_fsdp),
    _Engine("tensor_parallel", _sharded_at_load, _build_tensor_parallel),
    _Engine("replicated", lambda t: True, lambda t: ReplicatedEngine(t.model_wrapped, t.optimizer)),
)


def _engine_of(trainer) -> _Engine:
    return next(engine for engine in _ENGINES if engine.matches(trainer))


class UnifiedCheckpointCallback(TrainerCallback):
    """Gives a Trainer unified checkpoints. Either pass it to the Trainer (`callbacks=[UnifiedCheckpointCallback()]`:
    when the Trainer's `__init__` ends, the callback finds that Trainer and attaches it) or call
    `hf_unified_ckpt.attach(trainer)` (which adds it); both give the same trainer. A callback that reaches no
    Trainer (added some other way) stops `train()` before the first step with an error saying so."""

    def __init__(self):
        self.attached = False
        self.saver: AsyncSaver | None = None
        self.trainer = None

    @classmethod
    def attach(cls, trainer):
        return attach(trainer)

    def on_init_end(self, args, state, control, **kwargs):
        """Passed in `callbacks=[...]`: attach the Trainer whose `__init__` is ending (this instance only)."""
        if not self.attached:
            trainer = _trainer_holding(self)
            if trainer is not None:
                attach(trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """An in-flight async save, and an EMA update, copy live weights (and optimizer state): the step waits
        for those copies."""
        if self.trainer is not None:
            self.trainer._uc_wait_for_copies()
        elif self.saver is not None:
            self.saver.wait_for_snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        """After each optimizer step: the EMA of the weights, when due (before the step's save, if any)."""
        if self.trainer is not None:
            self.trainer._uc_ema_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        """The end of training waits for the in-flight async save and EMA update, and raises their errors."""
        if self.saver is not None:
            self.saver.wait()
        if self.trainer is not None and getattr(self.trainer, "_uc_updates", None) is not None:
            self.trainer._uc_updates.wait()

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.attached:
            raise RuntimeError(
                "UnifiedCheckpointCallback was added to a Trainer after its construction (add_callback), so it could "
                "not attach it and checkpoints would be written the native way. Pass it in "
                "Trainer(..., callbacks=[UnifiedCheckpointCallback()]) or call hf_unified_ckpt.attach(trainer).")


_SUBCLASSES: dict[type, type] = {}


@contextlib.contextmanager
def _optimizer_state_checkpointable(model, training_args):
    """While the Trainer is built: transformers refuses `save_only_model=False` for a model sharded at load time,
    because its own save keeps one rank's optimizer shards; unified checkpoints save all of them, so with
    `unified_checkpoint=True` the flag reads True during `Trainer.__init__` and is set back after."""
    options = getattr(training_args, "unified_checkpoint_options", None)
    lift = (options is not None and options.enabled and not training_args.save_only_model
            and getattr(model, "is_distributed_loading_by_transformers", False))
    if lift:
        training_args.save_only_model = True
    try:
        yield
    finally:
        if lift:
            training_args.save_only_model = False


def _trainer_holding(callback) -> object | None:
    """The Trainer whose `__init__` is running with `callback` among its callbacks: callbacks are not handed the
    Trainer, so look for it on the call stack (the `self` of `Trainer.__init__`, which called `on_init_end`)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None) if isinstance(candidate, transformers.Trainer) else None
            if handler is not None and any(c is callback for c in handler.callbacks):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def attach(trainer):
    """Give `trainer` (any `transformers.Trainer` subclass instance) unified checkpoints; returns it.

    Its `args` must carry the plugin's fields (`UnifiedCheckpointArguments`, or a config class made with
    `with_unified_checkpoint`, such as `hf_unified_ckpt.trl_configs.UnifiedSFTConfig`).
    """
    if getattr(trainer.args, "unified_checkpoint_options", None) is None:
        raise TypeError(
            f"trainer.args is a {type(trainer.args).__name__} without the unified-checkpoint fields; build it with "
            "hf_unified_ckpt.UnifiedCheckpointArguments (or with_unified_checkpoint(YourConfigClass)).")
    _check_transformers(trainer)
    cls = type(trainer)
    if not isinstance(trainer, UnifiedCheckpointMixin):
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Unified{cls.__name__}", (UnifiedCheckpointMixin, cls),
                                    {"__module__": cls.__module__, "__doc__": cls.__doc__})
        trainer.__class__ = _SUBCLASSES[cls]
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, UnifiedCheckpointCallback)), None)
    if callback is None:
        callback = UnifiedCheckpointCallback()
        trainer.add_callback(callback)
    callback.attached = True
    callback.trainer = trainer
    if callback.saver is None:
        callback.saver = AsyncSaver()
        atexit.register(callback.saver.close)
    return trainer


def _saver(trainer) -> AsyncSaver:
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, UnifiedCheckpointCallback))
    return callback.saver


def _check_transformers(trainer) -> None:
    major = int(transformers.__version__.split(".")[0])
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(trainer, m, None))]
    if major != SUPPORTED_TRANSFORMERS_MAJOR or missing:
        raise RuntimeError(
            f"hf_unified_ckpt {__import__('hf_unified_ckpt').__version__} supports transformers "
            f"{SUPPORTED_TRANSFORMERS_MAJOR}.x (found {transformers.__version__}"
            + (f", Trainer lacks {missing}" if missing else "") + ").")


def trainer_state_bytes(state) -> bytes:
    """`TrainerState.save_to_json`'s bytes."""
    return (json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n").encode("utf-8")


def same_ref(a, b) -> bool:
    """Whether two references name the same checkpoint (local paths compared normalised)."""
    return canonical(a) == canonical(b)
