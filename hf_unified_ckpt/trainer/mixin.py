"""`UnifiedCheckpointMixin`: the Trainer methods the plugin overrides (save, resume, RNG, best model, save_model),
each delegating to the engine- and store-agnostic algorithms of `checkpoint/`.

- `train`: refuses what a save could not handle (before anything trains), resolves `resume_from_checkpoint`
  (`resume.resolve`: True -> newest *complete* checkpoint; a unified folder verified before anything is loaded);
- `_load_from_checkpoint` / `_prepare_for_training`: a unified folder is loaded after the engine is prepared
  (`super()._prepare_for_training(..., None)` keeps the Trainer's own trainer-state restore and data skip); the
  prepared engine is described once as a save would, so its refusals come before the first step;
- `_load_rng_state`: per-rank RNG with one warning when the world size changed;
- `_save_checkpoint`: replaces the native checkpoint write by the unified one (not written twice); the small state
  is captured as bytes (`capture.small_files`);
- `_load_best_model`: `load_best_model_at_end` from a unified checkpoint into any engine;
- `save_model`: under DeepSpeed and FSDP, weights that `from_pretrained` loads, whatever the stage or state-dict
  type (one process and DDP keep the Trainer's own);
- preemption (the step boundary, `train`'s two ends, DataLoader workers): inherited from `PreemptionMixin`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import time

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.async_save import Fallback
from ..checkpoint.ema import BackgroundUpdates, ExponentialAverage, WithEma
from ..checkpoint.load import load_checkpoint
from ..checkpoint.placement import judge_path
from ..checkpoint.retention import rotate_checkpoints
from ..checkpoint.rng import restore_rng_state
from ..checkpoint.save import SaveRequest, save_checkpoint, save_model_weights
from ..checkpoint.layout import UNIFIED, detect_layout
from ..engines.base import LoadSources
from ..engines.conversion import WithConversion, live_groups, weight_conversion
from ..errors import TrainingPreempted, UnsupportedCheckpointError
from ..format.components import MASTER, MODEL, OPTIMIZER
from ..format.lineage import error_half_life, options_for_save, restored_step
from ..format.optim_state import fit_scheduler_state, group_param_names, match_groups
from ..legacy import legacy_components
from ..legacy.trainer_folder import load_converted_weights
from ..store import as_ref, is_file, is_folder, join, name_of, parent_of, read_bytes
from ..store.capture import torch_bytes
from .capture import ARGS_FILE, SCHEDULER_FILE, processing_class_files, small_files
from .engines import engine_of
from ..flash.tier import FlashTier, checkpoint_bytes
from .preempt_mixin import PreemptionMixin
from .resume import Resume, check_unified, resolve, same_ref
from .storage import LocalAlias, check_writable, checkpoint_root, close_store, is_remote

logger = logging.getLogger(__name__)


class UnifiedCheckpointMixin(PreemptionMixin):
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
        from .attach import attach  # here: attach() builds subclasses of this class

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
        self._uc_saved_step = self._uc_save_seconds = None
        self._uc_preempting = False
        self._uc_alias = None
        self._uc_flash = FlashTier(options.flash, checkpoint_root(self, trial)) if (
            options.enabled and options.flash.enabled) else None
        self._uc_refuse_unsupported()
        if options.enabled and options.storage is not None:
            check_writable(checkpoint_root(self, trial))
        if self._uc_flash is not None:
            self._uc_flash.open()
        path, self._uc_resume = resolve(self, resume_from_checkpoint)
        if self._uc_resume is not None and is_remote(path):  # the Trainer's own code opens its small files by path
            self._uc_alias = LocalAlias(path)
            path = self._uc_alias.path
        self._uc_preemption = self._uc_watch_preemption()
        try:
            output = super().train(resume_from_checkpoint=path, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            self._uc_after_training(trial)
            return output
        except TrainingPreempted:  # its save went to durable storage: the persister ends what is pending and frees
            if getattr(self, "_uc_flash", None) is not None:  # the memory (a spot VM's RAM goes with the VM anyway)
                self._uc_flash.close(ended=True, wait=False)
            raise
        finally:
            self._uc_leave_train()

    def _uc_leave_train(self) -> None:
        """However `train()` ends: the signal handlers put back, the vote in flight dropped, the plugin's own gloo
        groups destroyed (created again when needed), so nothing of the run outlives it. Local."""
        watch, self._uc_preemption = getattr(self, "_uc_preemption", None), None
        if watch is not None:
            watch.close()
        alias, self._uc_alias = getattr(self, "_uc_alias", None), None
        if alias is not None:
            alias.close()
        if getattr(self, "_uc_flash", None) is not None:
            self._uc_flash.close()
        if not self._uc_saver.in_flight:
            self._uc_saver.release_mappings()
            dist.release_groups()
            storage = self.args.unified_checkpoint_options.storage
            if storage is not None:  # its client session ends with the run (made again on next use)
                close_store(storage)

    def _uc_refuse_unsupported(self) -> None:
        """Refuse here, before anything trains, what a save would refuse later; warn once (rank 0) when FSDP was
        asked for but the engine is another (accelerate falls back to DDP on CPU without a word)."""
        options = self.args.unified_checkpoint_options
        if (options.async_save or options.flash.enabled) and self.args.push_to_hub:
            raise UnsupportedCheckpointError(f"{'flash' if options.flash.enabled else 'async_save'} with push_to_hub "
                                             "is not supported yet: the upload would run before the background save "
                                             "commits. Drop one of them.")
        if options.storage is not None and self.args.push_to_hub:
            raise UnsupportedCheckpointError("unified_checkpoint_storage with push_to_hub is not supported yet: the "
                                             "Hub upload reads checkpoints from output_dir. Drop one of them.")
        slashed = [n for n, _ in self.model.named_parameters() if "/" in n] if options.enabled else []
        if slashed:
            raise UnsupportedCheckpointError(
                f"parameter name(s) {slashed[:5]} contain '/', which unified checkpoints reserve for optimizer keys "
                "(`<parameter name>/<state name>`). Register the parameter under a name without '/', or train "
                "without unified_checkpoint.")
        engine = engine_of(self)
        refusal = engine.refusal(self)
        if refusal:
            raise UnsupportedCheckpointError(refusal)
        self._uc_take_over_jit_checkpoint()
        asked = self.args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
        if asked and not engine.fsdp and dist.rank() == 0:
            logger.warning("FSDP was requested (the fsdp argument or an accelerate FSDP config) but the model is "
                           "trained with %s: accelerate "
                           "applies FSDP only on accelerators and falls back to DDP on CPU. Checkpoints are saved "
                           "for the engine that runs.", engine.label())

    def _uc_resuming(self, checkpoint) -> Resume | None:
        resume, alias = getattr(self, "_uc_resume", None), getattr(self, "_uc_alias", None)
        if resume is None or checkpoint is None:
            return None
        if same_ref(checkpoint, resume.layout.path) or (alias is not None and same_ref(checkpoint, alias.path)):
            return resume
        return None

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
        alias = getattr(self, "_uc_alias", None)
        self._load_scaler(alias.path if alias is not None else str(folder))
        if alias is not None and alias.best_model_checkpoint and is_folder(alias.best_model_checkpoint):
            self.state.best_model_checkpoint = alias.best_model_checkpoint  # the stand-in's state left it out
        self._uc_find_memory_best()
        logger.info("Resumed from %s checkpoint %s", resume.layout.kind, folder)
        return model, train_dataloader

    def _uc_find_memory_best(self) -> None:
        """With `flash`, a resumed best checkpoint saved in memory is that memory folder: gone after a restart on
        another machine (the Trainer then drops it), its durable copy is the same checkpoint. Collective."""
        flash = getattr(self, "_uc_flash", None)
        best = self.state.best_model_checkpoint
        if flash is not None and self.state.best_global_step and (best is None or not is_folder(best)):
            self.state.best_model_checkpoint = self._uc_locate_best(flash.durable_root) or best

    def _uc_load_scheduler(self, folder: str, saved_groups: list[list[str]] | None, engine) -> None:
        """Load the scheduler the checkpoint holds, its per-group values fitted to this optimizer's param groups
        (DeepSpeed drops the empty groups that DDP and FSDP keep). Collective under FSDP: all ranks call it."""
        if self.lr_scheduler is None or not is_file(join(folder, SCHEDULER_FILE)):
            return
        saved = torch.load(io.BytesIO(read_bytes(join(folder, SCHEDULER_FILE))), weights_only=True)
        if saved_groups is not None:
            matched = match_groups(live_groups(engine, saved_groups), engine.param_group_names())
            saved = fit_scheduler_state(saved, self.lr_scheduler.state_dict(), matched)
        self.lr_scheduler.load_state_dict(saved)

    def _uc_preflight(self) -> None:
        """Describe the prepared engine's model the way every save will, so whatever a save would refuse (an
        engine or model it cannot handle) is refused before the first step. Collective: all ranks call it."""
        options = self.args.unified_checkpoint_options
        if options.enabled:
            engine = self._uc_engine()
            engine.specs(MODEL.name)
            if self._uc_flash is not None:
                fresh = self.optimizer is not None and not getattr(self.optimizer, "state", True)  # no step yet
                self._uc_flash.start(checkpoint_bytes(engine, include_optimizer=not self.args.save_only_model,
                                                      optimizer_has_state=not fresh))
            if options.ema:
                engine.parameter_fragments()  # refuses an engine the EMA cannot follow (FSDP1)
                engine_of(self).step_barrier(self, self._uc_wait_for_copies)
            if options.residual_master_weight and MASTER not in engine.components() and dist.rank() == 0:
                logger.warning("residual_master_weight has no effect in this run: it keeps no fp32 master weights "
                               "apart from its weights (only DeepSpeed bf16 training does), so there is nothing to "
                               "store as a residual.")

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """A unified checkpoint was loaded into the prepared engine already (`_prepare_for_training`). A checkpoint
        the plain Trainer wrote (single process, DDP), for a model whose weights are converted when
        loaded (Mixture-of-Experts: per-expert files, experts fused at run time): the weights are put together by
        the conversion (`legacy.trainer_folder`), where the Trainer's own load skips the experts without an error
        (transformers #48805); the rest of the resume is the Trainer's. Local only."""
        if self._uc_resuming(resume_from_checkpoint):
            return None  # loaded into the prepared engine in _prepare_for_training
        module = model if model is not None else self.model
        if not (self.args.unified_checkpoint_options.enabled
                and load_converted_weights(module, str(resume_from_checkpoint))):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        return None

    def _load_best_model(self):
        """`load_best_model_at_end`: a unified best checkpoint is loaded into whatever the engine is (weights, and
        fp32 master weights where the engine keeps them; not the optimizer), verified first. Collective."""
        path = as_ref(self.state.best_model_checkpoint)
        verdict = judge_path(path)
        if verdict.kind != UNIFIED:
            return super()._load_best_model()
        best = check_unified(path, verdict, show_progress=not self.args.disable_tqdm)
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
        if not self.args.unified_checkpoint_options.enabled or engine_of(self).native_save_model:
            return super().save_model(output_dir, _internal_call)
        folder = as_ref(output_dir if output_dir is not None else self.args.output_dir)
        engine = self._uc_engine()
        small = {**engine.config_files(), **processing_class_files(self), ARGS_FILE: torch_bytes(self.args)}
        save_model_weights(engine, folder, self.args.unified_checkpoint_options.max_shard_size, small,
                           show_progress=not self.args.disable_tqdm)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_rng_state(self, checkpoint):
        resume = self._uc_resuming(checkpoint)
        if resume is None:
            return super()._load_rng_state(checkpoint)
        lost = restore_rng_state(resume.layout.path, dist.rank(), resume.saved_world_size, dist.world_size())
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
        run_dir = checkpoint_root(self, trial)
        output_dir = join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._uc_wait()  # one save in flight: the previous one commits (or raises) before this one starts
        self._uc_ema_ready()
        flash = getattr(self, "_uc_flash", None)
        background = not getattr(self, "_uc_preempting", False)
        into_memory = flash is not None and flash.active and background
        before = self._uc_track_best(run_dir, flash.final_dir(self.state.global_step) if into_memory else output_dir)
        self._uc_export_callback_states()
        request = SaveRequest(output_dir, self.state.global_step, options,
                              include_optimizer=not self.args.save_only_model,
                              show_progress=not self.args.disable_tqdm)
        engine = self._uc_engine()
        best = self.state.best_model_checkpoint

        def rotate():  # run by the rank that committed each folder (one per machine-local folder)
            rotate_checkpoints(run_dir, self.args.save_total_limit, protect=[best, output_dir])

        small = small_files(self, engine)
        self._uc_saved_step = self.state.global_step
        try:
            if into_memory:
                self._uc_flash_save(flash, engine, request, small, rotate)
            elif options.async_save and background:
                engine_of(self).step_barrier(self, self._uc_wait_for_copies)
                self._uc_saver.start(engine, request, small, after_commit=rotate)
            else:
                started = time.monotonic()
                save_checkpoint(engine, request, small, after_commit=rotate)
                self._uc_save_seconds = time.monotonic() - started
        except BaseException:
            self.state.best_model_checkpoint = before  # the folder it may name was not committed
            raise
        self._uc_best_before = (before,) if self._uc_saver.in_flight else None
        if self.args.push_to_hub and not self._uc_saver.in_flight:
            self._push_from_checkpoint(str(output_dir))

    def _uc_wait(self) -> None:
        """Wait for the in-flight save and raise its error; a save that failed leaves `best_model_checkpoint` as it
        was before that save (it may name the folder that was never committed). Local (`AsyncSaver.wait`)."""
        try:
            self._uc_saver.wait()
        except BaseException:
            undo = getattr(self, "_uc_best_before", None)
            if undo is not None:
                self.state.best_model_checkpoint = undo[0]
            raise
        finally:
            self._uc_best_before = None

    def _finalize_training(self, trial, num_train_samples, start_time):
        """After the last step, before the Trainer's end steps that read checkpoint folders (`_load_best_model`,
        the `save_total_limit=1` clean-up): the in-flight save commits, and with `flash` the last and the best
        checkpoints are made durable (the best then names the durable folder). Collective."""
        self._uc_wait()
        self._uc_flash_finish()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _uc_flash_save(self, flash, engine, request: SaveRequest, small, rotate) -> None:
        """A save into the memory tier: snapshot as `async_save` does, written to memory in the background; the
        persister makes it durable at `request.final_dir` if it is due; a full memory folder saves it there
        directly. Collective."""
        durable, best, limit = request.final_dir, self.state.best_model_checkpoint, self.args.save_total_limit
        step = request.global_step

        def said(why: str) -> None:
            flash.active = False
            if dist.rank() == 0:
                logger.warning("flash: the memory folder %s is full (%s); checkpoint-%d was saved to %s instead, and "
                               "so are the next saves of this run.", flash.run, why, step, durable)

        memory = dataclasses.replace(request, final_dir=flash.final_dir(step), spare=flash.spare)
        engine_of(self).step_barrier(self, self._uc_wait_for_copies)
        self._uc_saver.start(engine, memory, small, after_commit=lambda: flash.after_commit(step, durable, best, limit),
                             fallback=Fallback(durable, rotate, said))

    def _uc_flash_finish(self) -> None:
        """Training ended: its last checkpoint and the best are made durable before `train()` returns (waited for),
        then the persister frees the memory. Collective."""
        flash = getattr(self, "_uc_flash", None)
        if flash is None:
            return
        self._uc_wait()
        best = self.state.best_model_checkpoint
        steps = [s for s in (self._uc_saved_step, self.state.best_global_step if best else None) if s]
        flash.finish(sorted(set(steps)) if flash.active else [])
        if best and same_ref(parent_of(best), flash.root):  # the memory copy is gone: point at the durable one
            durable = join(flash.durable_root, name_of(best))
            self.state.best_model_checkpoint = durable if is_folder(durable) else None

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
        engine = engine_of(self).build(self)
        average = getattr(self, "_uc_average", None)
        engine = engine if average is None else WithEma(engine, average)
        conversion = self._uc_weight_conversion(engine)
        return engine if conversion is None else WithConversion(engine, conversion)

    def _uc_weight_conversion(self, engine):
        """The model's weight conversion (`engines.conversion`: fused Mixture-of-Experts tensors saved per expert,
        as save_pretrained writes them), worked out once per run; None when it has none."""
        if not hasattr(self, "_uc_conversion"):
            self._uc_conversion = weight_conversion(engine.module, engine.specs(MODEL.name))
        return self._uc_conversion

    def _uc_ema_step(self, step: int) -> None:
        """Start folding this rank's weights into the EMA, in the background, when an update is due after
        optimizer step `step`. Local only."""
        average = getattr(self, "_uc_average", None)
        if average is not None and average.due(step):
            self._uc_updates.submit(self._uc_ema_fragments())

    def _uc_ema_fragments(self) -> dict:
        if self._uc_fragments is None:
            self._uc_fragments = engine_of(self).build(self).parameter_fragments()
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
        self._uc_saver.wait_for_snapshot()
        if getattr(self, "_uc_updates", None) is not None:
            self._uc_updates.wait_for_copy()

    def _uc_track_best(self, run_dir: str, final_dir: str) -> str | None:
        """The native `_save_checkpoint`'s bookkeeping of `best_model_checkpoint`, decided before this save's small
        files are captured, so its `trainer_state.json`, rotation's protected set and the memory tier's hold the
        same value: the folder of `best_global_step` -- this save's own `final_dir` when the best evaluation is
        this step's (native records it once the model files exist; a unified save writes them with everything
        else), else that step's committed folder (`_uc_locate_best`), else unchanged. Returns the value before,
        which a failed save puts back. Collective: all ranks call it."""
        before = self.state.best_model_checkpoint
        step = self.state.best_global_step
        if self.args.save_strategy in ("steps", "epoch", "best") and step:
            here = step == self.state.global_step
            self.state.best_model_checkpoint = final_dir if here else (self._uc_locate_best(run_dir) or before)
        return before

    def _uc_locate_best(self, run_dir: str) -> str | None:
        """The committed folder of `best_global_step`: in `run_dir`, else (`flash`) in the memory tier; None if
        neither holds it. Rank 0 looks, every rank gets its answer. Collective: all ranks call it."""
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
        flash = getattr(self, "_uc_flash", None)
        roots = [run_dir] + ([flash.root] if flash is not None else [])
        found = next((join(r, name) for r in roots if detect_layout(join(r, name)).committed),
                     None) if dist.rank() == 0 else None
        return dist.broadcast_object(found)

    def _uc_export_callback_states(self) -> None:
        """Same as the native `_save_checkpoint`: store `ExportableState` callbacks in the trainer state."""
        from transformers.trainer_callback import ExportableState

        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = type(cb).__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state


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
