"""`CheckpointSession`: the plugin's side of one Trainer, the one object its overrides and its callback call, as
torchtitan's trainer calls its checkpoint manager (load, wait for the snapshot, save, close). It owns the background
saver (`AsyncSaver`), the memory tier (`flash.tier.FlashTier`), the EMA (`checkpoint.save.ema.EmaRun`), the preemption
handling (`preempt.PreemptionRun`) and the resume state, and decides where each save goes: into memory (`flash`), in the
background (`async_save`) or written inline.

One session per Trainer, created by `hooks.equip` (from `attach` or the mixin's `__init__`) and held as
`trainer._uc_session`, the Trainer's only attribute of the plugin; what belongs to one `train()` call is set by
`open` and let go by `close`. The calls, in the order a run makes them:

- `train` (`Trainer.train`): `open` (refusals, the memory tier's lease, the resume folder resolved and verified,
  the preemption watch), the Trainer's own `train`, the vote after training, `close`;
- `prepare_for_training` (`_prepare_for_training`): the prepared engine described as a save would (what a save
  would refuse is refused before the first step; the memory tier started), then `load` of the resume folder into it;
- `load_from_checkpoint`, `load_rng_state`: what is left of the Trainer's own resume;
- `before_optimizer_step` / `after_optimizer_step` (the callback): `wait_for_snapshot` (the save's and the EMA's
  copy taken) and the preemption vote started; the EMA update when due;
- `step_boundary` (`_maybe_log_save_evaluate`): the preemption vote read;
- `save` (`_save_checkpoint`): flash, async or sync;
- `end_training` (`_finalize_training`): the save in flight committed; the memory tier's last and best made durable;
- `load_best_model`, `save_model`: unified under every engine.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections.abc import Callable

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.save.async_save import AsyncSaver, Fallback
from ..checkpoint.save.ema import EmaRun, ExponentialAverage, WithEma
from ..checkpoint.folder.layout import UNIFIED
from ..checkpoint.folder.lease import Lease, take_lease
from ..checkpoint.load.loading import load_checkpoint
from ..store.pickles import load_pickle
from ..checkpoint.load.placement import judge_path
from ..checkpoint.folder.retention import rotate_checkpoints
from ..checkpoint.folder.rng import restore_rng_state
from ..checkpoint.save.saving import SaveRequest, save_checkpoint, save_model_weights
from ..engines.base import LoadSources
from ..engines.conversion import WithConversion, live_groups, weight_conversion
from ..errors import TrainingPreempted
from ..flash.tier import FlashTier, checkpoint_bytes
from ..format.components import MASTER, MODEL, OPTIMIZER
from ..format.lineage import error_half_life, options_for_save, restored_step
from ..format.optim_state import fit_scheduler_state, group_param_names, match_groups
from ..legacy import legacy_components
from ..legacy.trainer_folder import load_converted_weights
from ..preemption.signals import ignore_in_workers
from ..store import as_ref, is_file, is_folder, join, name_of, parent_of, read_bytes, store_for
from ..store.capture import torch_bytes
from .best import locate_best, track_best
from .capture import ARGS_FILE, SCALER_FILE, SCHEDULER_FILE, export_callback_states, processing_class_files, small_files
from .engines import engine_of
from .chain import overrides_save, save_owner
from .hook_files import HookFolder, is_reserved, shared_hook_files
from .preempt import PreemptionRun, take_over_jit_checkpoint
from .refusals import refuse_unsupported, warn_engine_fallback
from .resume import Resume, check_unified, resolve, same_ref
from .storage import LocalAlias, check_writable, checkpoint_root, close_store, is_remote

logger = logging.getLogger(__name__)

#: `CheckpointSession.conversion` until the first save or load works it out.
NOT_YET = object()


@dataclasses.dataclass
class Planned:
    """A save planned where the class's chain reached the base Trainer's `_save_checkpoint` (`CheckpointSession.
    _plan`): written when the outermost call returns."""

    run_dir: str
    request: SaveRequest
    into_memory: bool
    before: str | None  # `best_model_checkpoint` before this save decided it


@dataclasses.dataclass
class ChainRun:
    """One outermost `_save_checkpoint` call: its hook folder, whether `_get_output_dir` resolves into it now, and
    the save planned by the base (None: not reached yet)."""

    hooks: HookFolder | None  # None: the class has no `_save_checkpoint` of its own
    redirect: bool = True
    planned: Planned | None = None


class CheckpointSession:
    """See the module docstring. `saver` and `conversion` last as long as the Trainer; the other state is one
    `train()` call's."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.saver = AsyncSaver(self.options.async_executor)  # where its saves' second half runs
        #: The model's weight conversion (`engines.conversion`), worked out once (None: it has none).
        self.conversion = NOT_YET
        #: `best_model_checkpoint` before the save in flight, put back if that save fails.
        self.best_before: tuple[str | None] | None = None
        self.guard_said = False  # the lineage guard's choice of O0 was said
        #: The outermost `_save_checkpoint` call in progress (`save`), None between saves.
        self.chain: ChainRun | None = None
        self._forget_run()

    @property
    def options(self):
        return self.trainer.args.unified_checkpoint_options

    def _forget_run(self) -> None:
        """The state of one `train()` call, empty until `begin` sets it."""
        self.resume: Resume | None = None
        self.lease: Lease | None = None
        self.alias: LocalAlias | None = None
        self.flash: FlashTier | None = None
        self.ema: EmaRun | None = None
        self.preemption: PreemptionRun | None = None
        self.quantized_restore: int | None = None  # lineage guard (lineage.py): step of the latest compressed restore
        self.saved_step: int | None = None
        self.save_seconds: float | None = None  # the last synchronous save's (what a preemption save may take)

    # ---- one train() call -----------------------------------------------------------------------------------------
    def train(self, native_train: Callable, resume_from_checkpoint, trial, **kwargs):
        """`Trainer.train` (`native_train`), with the resume folder resolved and verified first, and `close`d
        however it ends (the output_dir's lease given back, also when `open` refused). Collective: all ranks call
        it."""
        try:
            path = self.open(resume_from_checkpoint, trial)
            output = native_train(resume_from_checkpoint=path, trial=trial, **kwargs)
            if self.preemption is not None:
                self.preemption.after_training(trial)
            return output
        except TrainingPreempted:  # its save went to durable storage: the persister ends what is pending and frees
            if self.flash is not None:  # the memory (a spot VM's RAM goes with the VM anyway)
                self.flash.close(ended=True, wait=False)
            raise
        finally:
            self.close()

    def open(self, resume_from_checkpoint, trial) -> str | None:
        """A `train()` call starts: its state set up, what a save would refuse refused, the output_dir's lease
        taken (`checkpoint.folder.lease`: another job's live lease refuses this one here), the memory tier's lease
        taken, the resume folder resolved and verified (`resume.resolve`), the preemption watch started. Returns the
        folder the Trainer's own `train` resumes from (a local stand-in for one in object storage). Collective."""
        self._forget_run()
        options, trainer = self.options, self.trainer
        if options.enabled and options.ema:
            self.ema = EmaRun(ExponentialAverage(options.ema_decay, options.ema_interval), self._parameter_fragments)
        if options.enabled and options.flash.enabled:
            self.flash = FlashTier(options.flash, checkpoint_root(trainer, trial), options.direct_io)
        self._refuse(trial)
        if options.enabled:
            self.lease = take_lease(checkpoint_root(trainer, trial), options.lease)
        if self.flash is not None:
            self.flash.open()
        path = self._resolve(resume_from_checkpoint)
        if options.enabled and options.preemption.enabled:
            self.preemption = PreemptionRun.start(self, options.preemption)
        return path

    def _refuse(self, trial) -> None:
        """Before anything trains: what a save would refuse later, a storage that refuses a write, transformers'
        JIT checkpoint taken over; one warning for an engine other than the one asked for. Collective."""
        trainer = self.trainer
        refuse_unsupported(trainer)
        take_over_jit_checkpoint(trainer)
        warn_engine_fallback(trainer)
        if self.options.enabled and self.options.storage is not None:
            check_writable(checkpoint_root(trainer, trial))

    def _resolve(self, resume_from_checkpoint) -> str | None:
        """The folder resumed from (`resume.resolve`), and what the plugin loads itself. Collective."""
        path, self.resume = resolve(self.trainer, resume_from_checkpoint)
        if self.resume is not None and is_remote(path):  # the Trainer's own code opens its small files by path
            self.alias = LocalAlias(path, self.resume.manifest)
            path = self.alias.path
        return path

    def close(self) -> None:
        """However `train()` ends: the signal handlers put back, the vote in flight dropped, the resume's local
        stand-in removed, the memory tier's heartbeat stopped, the output_dir's lease given back, and with no save in
        flight the plugin's own gloo
        groups destroyed (created again when needed) and the store's client session ended, so nothing of the run
        outlives it. Local."""
        preemption, self.preemption = self.preemption, None
        if preemption is not None:
            preemption.close()
        alias, self.alias = self.alias, None
        if alias is not None:
            alias.close()
        if self.flash is not None:
            self.flash.close()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
        if not self.saver.in_flight:
            self.saver.release_mappings()
            dist.release_groups()
            storage = self.options.storage
            if storage is not None:  # its client session ends with the run (made again on next use)
                close_store(storage)

    # ---- load -----------------------------------------------------------------------------------------------------
    def prepare_for_training(self, native_prepare: Callable, max_steps, train_dataloader, resume_from_checkpoint):
        """`_prepare_for_training` (`native_prepare`): the engine prepared, then described as every save will
        describe it (`_preflight`), then the checkpoint the plugin loads itself loaded into it (`load`; the Trainer's
        own prepare is given no checkpoint then). Collective."""
        resume = self._resuming(resume_from_checkpoint)
        prepared = native_prepare(max_steps, train_dataloader, None if resume is not None else resume_from_checkpoint)
        self._preflight()
        if resume is not None:
            self.load(resume)
            self._load_hooks(resume_from_checkpoint)
        return prepared

    def _load_hooks(self, folder: str) -> None:
        """The trainer class's own load hooks, called where the native `_prepare_for_training` calls them, with the
        folder the Trainer resumes from (`folder`: a local stand-in for one in object storage): under FSDP
        `_load_from_checkpoint`, then `_load_optimizer_and_scheduler`; the base Trainer's loads do nothing there
        (`chain.NativeStandIn`: the plugin loaded the folder). Collective under FSDP."""
        trainer = self.trainer
        if trainer.is_fsdp_enabled:
            trainer._load_from_checkpoint(folder, trainer.model_wrapped)
        trainer._load_optimizer_and_scheduler(folder)

    def load_optimizer_and_scheduler(self, native_load: Callable, checkpoint) -> None:
        """The base Trainer's `_load_optimizer_and_scheduler` (`native_load`): nothing for a checkpoint
        `prepare_for_training` loaded. Local."""
        if self._resuming(checkpoint) is not None:
            return None
        return native_load(checkpoint)

    def _resuming(self, checkpoint) -> Resume | None:
        """What the plugin loads itself when the Trainer resumes from `checkpoint` (None: the Trainer's own code)."""
        resume, alias = self.resume, self.alias
        if resume is None or checkpoint is None:
            return None
        if same_ref(checkpoint, resume.layout.path) or (alias is not None and same_ref(checkpoint, alias.path)):
            return resume
        return None

    def _preflight(self) -> None:
        """Describe the prepared engine's model the way every save will, so whatever a save would refuse (an
        engine or model it cannot handle) is refused before the first step; start the memory tier; the optimizer
        step waits for the EMA's copy. Collective: all ranks call it."""
        options = self.options
        if not options.enabled:
            return
        engine = self.engine()
        engine.specs(MODEL.name)
        if self.flash is not None:
            self._start_memory_tier(engine)
        if self.ema is not None:
            engine.parameter_fragments()  # refuses an engine the EMA cannot follow (FSDP1)
            engine_of(self.trainer).step_barrier(self.trainer, self.wait_for_snapshot)
        if options.residual_master_weight and MASTER not in engine.components() and dist.rank() == 0:
            logger.warning("residual_master_weight has no effect in this run: it keeps no fp32 master weights "
                           "apart from its weights (only DeepSpeed bf16 training does), so there is nothing to "
                           "store as a residual.")

    def _start_memory_tier(self, engine) -> None:
        """Start the memory tier for checkpoints of `engine`'s size. Collective."""
        optimizer = self.trainer.optimizer
        fresh = optimizer is not None and not getattr(optimizer, "state", True)  # no step yet
        self.flash.start(checkpoint_bytes(engine, include_optimizer=not self.trainer.args.save_only_model,
                                          optimizer_has_state=not fresh))

    def load(self, resume: Resume) -> None:
        """Load the resumed checkpoint into the prepared engine (weights, optimizer, EMA; unified, or a legacy folder
        read offline), the scheduler fitted to this optimizer's groups, the scaler; the best checkpoint put back
        where the local stand-in or the memory tier lost it. Collective."""
        folder, engine = resume.layout.path, self.engine()
        saved_groups = self._load_state(resume, engine)
        if self.ema is not None and not self.ema.average.parts and dist.rank() == 0:
            logger.warning("Resuming from %s, which holds no EMA of the weights: the EMA starts again from the "
                           "weights at its first update.", folder)
        listed = resume.manifest["files"] if resume.manifest is not None else None  # nothing unlisted is read
        self.load_scheduler(folder, saved_groups, engine, listed)
        self._load_trainer_files(folder, listed)
        logger.info("Resumed from %s checkpoint %s", resume.layout.kind, folder)

    def _load_state(self, resume: Resume, engine) -> list[list[str]] | None:
        """Load the engine's state from `resume`; return the saved optimizer's parameter groups (names). Collective."""
        if resume.legacy is not None:
            sources = legacy_components(resume.legacy, for_loading=True)
            engine.load(LoadSources(sources, resume.legacy.global_step))
            optimizer = sources.get(OPTIMIZER.name)
            return group_param_names(optimizer.metadata) if optimizer is not None else None
        saved_groups = load_checkpoint(resume.layout.path, engine, resume.manifest, self.options,
                                       placement=resume.placement)
        self.quantized_restore = restored_step(resume.manifest)
        return saved_groups

    def load_scheduler(self, folder: str, saved_groups: list[list[str]] | None, engine, listed=None) -> None:
        """Load the scheduler the checkpoint holds, its per-group values fitted to this optimizer's param groups
        (DeepSpeed drops the empty groups that DDP and FSDP keep); `listed`: a unified folder's files (one it does
        not list is not read). Collective under FSDP: all ranks call it."""
        scheduler = self.trainer.lr_scheduler
        if scheduler is None or (listed is not None and SCHEDULER_FILE not in listed) \
                or not is_file(join(folder, SCHEDULER_FILE)):
            return
        path = join(folder, SCHEDULER_FILE)
        saved = load_pickle(io.BytesIO(read_bytes(path)), str(path))  # weights_only, as the Trainer reads it
        if saved_groups is not None:
            matched = match_groups(live_groups(engine, saved_groups), engine.param_group_names())
            saved = fit_scheduler_state(saved, scheduler.state_dict(), matched)
        scheduler.load_state_dict(saved)

    def _load_trainer_files(self, folder: str, listed=None) -> None:
        """The scaler (by local path: the stand-in's for a folder in object storage; not when a unified folder's
        manifest, `listed`, does not list it) and the best checkpoint the stand-in's trainer state left out, or
        (`flash`) the durable copy of a best memory checkpoint. Collective."""
        trainer, alias = self.trainer, self.alias
        if listed is None or SCALER_FILE in listed:
            trainer._load_scaler(alias.path if alias is not None else str(folder))
        if alias is not None and alias.best_model_checkpoint and is_folder(alias.best_model_checkpoint):
            trainer.state.best_model_checkpoint = alias.best_model_checkpoint  # the stand-in's state left it out
        self._find_memory_best()

    def _find_memory_best(self) -> None:
        """With `flash`, a resumed best checkpoint saved in memory is that memory folder: gone after a restart on
        another machine (the Trainer then drops it), its durable copy is the same checkpoint. Collective."""
        state = self.trainer.state
        best = state.best_model_checkpoint
        if self.flash is not None and state.best_global_step and (best is None or not is_folder(best)):
            state.best_model_checkpoint = locate_best(self.trainer, self._best_roots(self.flash.durable_root)) or best

    def load_from_checkpoint(self, native_load: Callable, resume_from_checkpoint, model=None) -> None:
        """`_load_from_checkpoint` (`native_load`): nothing for a checkpoint `prepare_for_training` loaded. A
        checkpoint the plain Trainer wrote (single process, DDP), for a model whose weights are converted when loaded
        (Mixture-of-Experts: per-expert files, experts fused at run time): the weights are put together by the conversion
        (`legacy.trainer_folder`), where the Trainer's own load skips the experts without an error (transformers
        #48805); the rest of the resume is the Trainer's. Local only."""
        if self._resuming(resume_from_checkpoint):
            return
        module = model if model is not None else self.trainer.model
        if not (self.options.enabled and load_converted_weights(module, str(resume_from_checkpoint))):
            native_load(resume_from_checkpoint, model)

    def load_rng_state(self, native_load: Callable, checkpoint) -> None:
        """`_load_rng_state` (`native_load`): per-rank RNG, with one warning (rank 0) when the world size changed.
        Local."""
        resume = self._resuming(checkpoint)
        if resume is None:
            return native_load(checkpoint)
        listed = resume.manifest["files"] if resume.manifest is not None else None
        lost = restore_rng_state(resume.layout.path, dist.rank(), resume.saved_world_size, dist.world_size(), listed)
        if lost and dist.rank() == 0:
            logger.warning("Resuming from %s: %s", checkpoint, lost)
        return None

    def load_best_model(self, native_load: Callable) -> None:
        """`_load_best_model` (`native_load` for a folder not unified): a unified best checkpoint is loaded into
        whatever the engine is (weights, and fp32 master weights where the engine keeps them; not the optimizer),
        verified first. Collective."""
        path = as_ref(self.trainer.state.best_model_checkpoint)
        verdict = judge_path(path)
        if verdict.kind != UNIFIED:
            return native_load()
        best = check_unified(path, verdict, show_progress=not self.trainer.args.disable_tqdm)
        load_checkpoint(path, self.engine(), best.manifest, self.options, load_optimizer=False,
                        placement=best.placement)
        if dist.rank() == 0:
            logger.info("Loaded the best model from %s (%s: %s).", path, self.trainer.args.metric_for_best_model,
                        self.trainer.state.best_metric)
        return None

    # ---- the engine -----------------------------------------------------------------------------------------------
    def engine(self):
        """The adapter of the engine the Trainer runs (a new one per save or load), with the EMA component when the
        EMA is on and the model's weight conversion when it has one."""
        engine = engine_of(self.trainer).build(self.trainer)
        engine = engine if self.ema is None else WithEma(engine, self.ema.average)
        conversion = self._weight_conversion(engine)
        return engine if conversion is None else WithConversion(engine, conversion)

    def _weight_conversion(self, engine):
        """The model's weight conversion (`engines.conversion`: fused Mixture-of-Experts tensors saved per expert,
        as save_pretrained writes them), worked out once; None when it has none."""
        if self.conversion is NOT_YET:
            self.conversion = weight_conversion(engine.module, engine.specs(MODEL.name))
        return self.conversion

    def _parameter_fragments(self) -> dict:
        """This rank's fragments of the trained weights (what the EMA averages)."""
        return engine_of(self.trainer).build(self.trainer).parameter_fragments()

    # ---- during training ------------------------------------------------------------------------------------------
    def wait_for_snapshot(self) -> None:
        """Before an optimizer step: the background save's snapshot and the EMA's copy of the weights are taken.
        Local."""
        self.saver.wait_for_snapshot()
        if self.ema is not None:
            self.ema.wait_for_snapshot()

    def before_optimizer_step(self) -> None:
        """`on_pre_optimizer_step`: `wait_for_snapshot`, then the ranks' vote on a preemption signal starts (read at
        the step's end). Collective: all ranks call it."""
        self.wait_for_snapshot()
        if self.preemption is not None:
            self.preemption.start_vote()

    def after_optimizer_step(self, step: int) -> None:
        """`on_step_end`: the EMA of the weights, when due (before the step's save, if any); after the run's first
        optimizer step, the background saves' host buffers made ahead (`warm_up_background_saves`). Collective
        (that warm-up plans a save): all ranks call it."""
        if self.ema is not None:
            self.ema.after_step(step)
        self.warm_up_background_saves()

    def warm_up_background_saves(self) -> None:
        """Once the optimizer holds its state: the host buffers of this run's first background save (`async_save`,
        `flash`) are made in the background (`AsyncSaver.warm_up`, once per run), so that the save does not wait
        for them. Collective: all ranks call it."""
        trainer, options = self.trainer, self.options
        if (self.saver.warmed_up or not options.enabled or trainer.args.save_strategy == "no" or self.saver.in_flight
                or not (options.async_save or (self.flash is not None and self.flash.active))):
            return
        engine, request = self.engine(), self._request_in(checkpoint_root(trainer), options, show_progress=False)
        on_cpu = trainer.args.device.type == "cpu"
        self.saver.warm_up(engine, request, trainer.args.device,
                           placed_whole=on_cpu and self.flash is not None and self.flash.active)

    def before_first_step(self) -> None:
        """`on_train_begin`: a preemption signal that came during set-up ends the run here. Collective."""
        if self.preemption is not None:
            self.preemption.before_first_step()

    def step_boundary(self, native: Callable[[], None], model, trial):
        """`_maybe_log_save_evaluate` (`native`, its arguments bound) with the ranks' vote on a preemption signal
        (`PreemptionRun.step_boundary`). Collective: all ranks call it."""
        if self.preemption is None:
            return native()
        return self.preemption.step_boundary(native, model, trial)

    def quiet_workers(self, loader):
        """`loader`, its DataLoader workers made to ignore the preemption signals (torchrun and SLURM signal the
        process group), so that the training process can save; they end with it."""
        preemption = self.options.preemption
        if self.options.enabled and preemption.enabled:
            return ignore_in_workers(loader, preemption.signals)
        return loader

    # ---- save -----------------------------------------------------------------------------------------------------
    def save(self, chain: Callable, model, trial) -> None:
        """The outermost `_save_checkpoint` (`chain`: the trainer class's own `_save_checkpoint` chain, down to
        `chain.NativeStandIn`): without `unified_checkpoint`, the native save. Else the chain runs with
        `_get_output_dir` resolving into this save's hook folder (`hook_files.HookFolder`); where it reaches the base
        Trainer's `_save_checkpoint` the unified save is planned (`save_base`); once it returns, the files it wrote
        under `checkpoint-N` are part of the save, written into memory (`flash`), in the background (`async_save`)
        or inline. Rotation, the push and the best checkpoint's decision happen once. Collective: all ranks call
        it."""
        if not self.options.enabled or self.chain is not None:  # a nested call runs as the class wrote it
            return chain(model, trial)
        hooks = None  # a class without a `_save_checkpoint` of its own writes nothing there
        if overrides_save(type(self.trainer)):
            hooks = HookFolder(as_ref(self.trainer._get_output_dir(trial=trial)), self.trainer.state.global_step)
        self.chain = run = ChainRun(hooks)
        try:
            chain(model, trial)
            self.chain = None
            if run.planned is None:
                return self._base_skipped(hooks)
            self._write(run.planned, hooks.files(save_owner(type(self.trainer))) if hooks is not None else None)
        except BaseException:
            if run.planned is not None:
                self.trainer.state.best_model_checkpoint = run.planned.before
            raise
        finally:
            self.chain = None
            if hooks is not None:
                hooks.remove()
        self.best_before = (run.planned.before,) if self.saver.in_flight else None
        if self.trainer.args.push_to_hub and not self.saver.in_flight:
            self.trainer._push_from_checkpoint(str(run.planned.request.final_dir))
        return None

    def save_base(self, native_save: Callable, model, trial) -> None:
        """The base Trainer's `_save_checkpoint` (`native_save`, without `unified_checkpoint`), reached through the
        class's chain: the unified save planned in its place (`_plan`: the Trainer's floating-point operations
        stored, the save in flight committed, the best checkpoint decided, the callbacks' state exported), written
        once the outermost call returns. Reached without it (called directly), the whole save. Collective: all ranks
        call it."""
        if not self.options.enabled:
            return native_save(model, trial)
        run = self.chain
        if run is None:
            return self.save(lambda m, t: self.save_base(native_save, m, t), model, trial)
        run.redirect = False  # the plugin's own folders are the real ones
        try:
            run.planned = self._plan(trial)
        finally:
            run.redirect = True
        return None

    def output_dir(self, native: Callable, trial) -> str:
        """`_get_output_dir` (`native`): while a class's `_save_checkpoint` chain runs, this save's hook root (its
        `checkpoint-N` is the hook folder); else the native folder."""
        run = self.chain
        if run is not None and run.redirect and run.hooks is not None:
            return run.hooks.root
        return native(trial)

    def _plan(self, trial) -> Planned:
        """Where the base Trainer's save stands: the request of this step's save, the save in flight committed, the
        EMA ready, the best checkpoint decided (put back if this save fails), the callbacks' state exported.
        Collective: all ranks call it."""
        run_dir, request = self._request(trial)
        self.wait()  # one save in flight: the previous one commits (or raises) before this one starts
        if self.ema is not None:
            self.ema.ready()
        into_memory = self.flash is not None and self.flash.active and self._background
        final_dir = self.flash.final_dir(request.global_step) if into_memory else request.final_dir
        before = track_best(self.trainer, self._best_roots(run_dir), final_dir)
        export_callback_states(self.trainer)
        return Planned(run_dir, request, into_memory, before)

    def _base_skipped(self, hooks: HookFolder | None) -> None:
        """The class's `_save_checkpoint` never called the base Trainer's: nothing is saved by the plugin, as
        natively; the files it wrote under `checkpoint-N` are left as a plain folder there (rank 0 says so)."""
        native = join(as_ref(self.trainer._get_output_dir(trial=None)), name_of(hooks.folder)) if hooks else None
        if hooks is not None and hooks.files(save_owner(type(self.trainer))) and not is_folder(native):
            store_for(native).move(hooks.folder, native)
        if dist.rank() == 0:
            logger.warning("%s._save_checkpoint did not call the base Trainer's _save_checkpoint at step %d: no "
                           "unified checkpoint was written (as natively, nothing but the files it wrote itself).",
                           save_owner(type(self.trainer)), self.trainer.state.global_step)
        return None

    @property
    def _background(self) -> bool:
        """Saves may go on in the background: no preemption was agreed (its save is written before it exits)."""
        return self.preemption is None or not self.preemption.agreed

    def _request(self, trial) -> tuple[str, SaveRequest]:
        """The run folder and the request of a save at this step (the options the lineage guard chose; the
        Trainer's floating-point operations stored first, as its own save does: summed over the ranks). Collective:
        all ranks call it."""
        trainer = self.trainer
        options = self._save_options()
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = checkpoint_root(trainer, trial)
        return run_dir, self._request_in(run_dir, options, show_progress=not trainer.args.disable_tqdm)

    def _request_in(self, run_dir: str, options, show_progress: bool) -> SaveRequest:
        """The request of a save of this step into `run_dir` with `options`. Local."""
        trainer, step = self.trainer, self.trainer.state.global_step
        return SaveRequest(join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"), step, options,
                           include_optimizer=not trainer.args.save_only_model, show_progress=show_progress,
                           direct_io=options.direct_io)

    def _save_options(self):
        """The options of this save: the lineage guard may write it at O0 (lineage.py), said once."""
        options, trainer = self.options, self.trainer
        half_life = error_half_life(trainer.optimizer.param_groups if trainer.optimizer is not None else [])
        chosen = options_for_save(options, trainer.state.global_step, self.quantized_restore, half_life)
        if chosen.quant_stage_requested and not self.guard_said and dist.rank() == 0:
            self.guard_said = True
            logger.info("Checkpoint compression: saves are written at O0 (not %s) until the quantisation error of "
                        "the restore at step %d has halved (%.0f steps for this optimizer's slowest moment), so "
                        "errors never stack.", options.quant_stage, self.quantized_restore, half_life)
        return chosen

    def _best_roots(self, run_dir: str) -> list[str]:
        """Where a committed best checkpoint may be: `run_dir`, then (`flash`) the memory tier."""
        return [run_dir] + ([self.flash.root] if self.flash is not None else [])

    def _rotation(self, run_dir: str, output_dir: str) -> Callable[[], None]:
        """Rotation once a save committed, run by the rank that committed each folder (one per machine-local
        folder): `save_total_limit` kept, never the best nor this save's folder. Local."""
        best, limit = self.trainer.state.best_model_checkpoint, self.trainer.args.save_total_limit
        return lambda: rotate_checkpoints(run_dir, limit, protect=[best, output_dir])

    def _write(self, planned: Planned, hooks: dict[str, bytes] | None) -> None:
        """Capture the small files, with the files the class's `_save_checkpoint` wrote (`hooks`; None: it has no
        `_save_checkpoint` of its own), and start (or make) the save; a save that fails to start puts `best_model_checkpoint` back to `before` (the folder it may
        name was not committed). Collective."""
        request = planned.request
        rotate = self._rotation(planned.run_dir, request.final_dir)
        engine = self.engine()
        small = small_files(self.trainer, engine)
        if hooks is not None:
            small.update(self._hook_files(hooks, small))
        self.saved_step = request.global_step
        try:
            self._dispatch(engine, request, small, rotate, planned.into_memory)
        except BaseException:
            self.trainer.state.best_model_checkpoint = planned.before
            raise

    def _hook_files(self, hooks: dict[str, bytes], small: dict) -> dict[str, bytes]:
        """The hook files this rank adds to the save (`hook_files.shared_hook_files`); one named as a file of the
        plugin's own is left out, with a warning. Collective."""
        kept = shared_hook_files(hooks, small)
        dropped = sorted(n for n in hooks if is_reserved(n, small))
        if dropped:
            logger.warning("%s._save_checkpoint wrote %s into checkpoint-%d, which the unified checkpoint writes "
                           "itself: its own are kept.", save_owner(type(self.trainer)), dropped,
                           self.trainer.state.global_step)
        return kept

    def _dispatch(self, engine, request: SaveRequest, small: dict, rotate: Callable[[], None],
                  into_memory: bool) -> None:
        """Where the save goes: into memory (`flash`) or in the background (`async_save`), each once the optimizer
        step waits for its snapshot; else written before this returns (every save once a preemption is agreed).
        Collective: all ranks call it."""
        if into_memory:
            self._save_to_memory(engine, request, small, rotate)
        elif request.options.async_save and self._background:
            engine_of(self.trainer).step_barrier(self.trainer, self.wait_for_snapshot)
            self.saver.start(engine, request, small, after_commit=rotate)
        else:
            started = time.monotonic()
            save_checkpoint(engine, request, small, after_commit=rotate)
            self.save_seconds = time.monotonic() - started

    def _save_to_memory(self, engine, request: SaveRequest, small: dict, rotate: Callable[[], None]) -> None:
        """A save into the memory tier: snapshot as `async_save` does, written to memory in the background; the
        persister makes it durable at `request.final_dir` if it is due; a full memory folder saves it there
        directly. Collective."""
        flash, step, durable = self.flash, request.global_step, request.final_dir
        best, limit = self.trainer.state.best_model_checkpoint, self.trainer.args.save_total_limit

        def said(why: str) -> None:
            flash.active = False
            if dist.rank() == 0:
                logger.warning("flash: the memory folder %s is full (%s); checkpoint-%d was saved to %s instead, and "
                               "so are the next saves of this run.", flash.run, why, step, durable)

        memory = dataclasses.replace(request, final_dir=flash.final_dir(step), spare=flash.spare, direct_io=False)
        engine_of(self.trainer).step_barrier(self.trainer, self.wait_for_snapshot)
        self.saver.start(engine, memory, small, after_commit=lambda: flash.after_commit(step, durable, best, limit),
                         fallback=Fallback(durable, rotate, said))

    def wait(self) -> None:
        """Wait for the in-flight save and raise its error; a save that failed leaves `best_model_checkpoint` as it
        was before that save (it may name the folder that was never committed). Local (`AsyncSaver.wait`)."""
        try:
            self.saver.wait()
        except BaseException:
            if self.best_before is not None:
                self.trainer.state.best_model_checkpoint = self.best_before[0]
            raise
        finally:
            self.best_before = None

    def wait_for_background(self) -> None:
        """`on_train_end`: the in-flight save and EMA update are waited for, their errors raised. Local."""
        self.saver.wait()
        if self.ema is not None:
            self.ema.wait()

    def end_training(self) -> None:
        """After the last step, before the Trainer's end steps that read checkpoint folders (`_load_best_model`,
        the `save_total_limit=1` clean-up): the in-flight save commits, and with `flash` the last and the best
        checkpoints are made durable (the best then names the durable folder). Collective."""
        self.wait()
        self.make_durable()

    def make_durable(self) -> None:
        """With `flash`, training ended: its last checkpoint and the best are made durable before `train()` returns
        (waited for), then the persister frees the memory. Collective."""
        flash, state = self.flash, self.trainer.state
        if flash is None:
            return
        self.wait()
        best = state.best_model_checkpoint
        steps = [s for s in (self.saved_step, state.best_global_step if best else None) if s]
        flash.end_training(sorted(set(steps)) if flash.active else [])
        if best and same_ref(parent_of(best), flash.root):  # the memory copy is gone: point at the durable one
            durable = join(flash.durable_root, name_of(best))
            state.best_model_checkpoint = durable if is_folder(durable) else None

    # ---- save_model -----------------------------------------------------------------------------------------------
    def save_model(self, native_save: Callable, output_dir: str | None, _internal_call: bool) -> None:
        """`Trainer.save_model` (`native_save` for one process and DDP, or without `unified_checkpoint`): under
        DeepSpeed and FSDP, weights that `from_pretrained` loads (assembled by name on rank 0), with configs,
        tokenizer and training args, whatever the ZeRO stage or FSDP state-dict type. Collective under DeepSpeed and
        FSDP: all ranks call it, as the Trainer requires there."""
        trainer = self.trainer
        if not self.options.enabled or engine_of(trainer).native_save_model:
            return native_save(output_dir, _internal_call)
        folder = as_ref(output_dir if output_dir is not None else trainer.args.output_dir)
        engine = self.engine()
        small = {**engine.config_files(), **processing_class_files(trainer), ARGS_FILE: torch_bytes(trainer.args)}
        save_model_weights(engine, folder, self.options.max_shard_size, small,
                           show_progress=not trainer.args.disable_tqdm, direct_io=self.options.direct_io)
        if trainer.args.push_to_hub and not _internal_call:
            trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)
        return None
