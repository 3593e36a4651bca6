"""`TrainingArguments` fields for the plugin, as a dataclass mixin usable with any Trainer config class.

`UnifiedCheckpointArguments` is `TrainingArguments` with the fields; `with_unified_checkpoint(Cls)` adds them
to another config class such as TRL's `SFTConfig` (see `hf_unified_ckpt.trl_configs`). The values are parsed
once, in `__post_init__`, into `args.unified_checkpoint_options` (a frozen `UnifiedCheckpointOptions`), so a
bad word fails when the arguments are built, before any training.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from typing import ClassVar

from transformers import TrainingArguments

from .options import (CONFIG_WORDS, DEFAULT_AGGREGATE_BUFFER, DEFAULT_AGGREGATE_RANGE, DEFAULT_AGGREGATORS,
                      DEFAULT_GRACE_PERIOD, DEFAULT_LEASE_TIMEOUT, DEFAULT_MAX_SHARD_SIZE,
                      DEFAULT_MEMORY_DIR, DEFAULT_MEMORY_KEEP, DEFAULT_OUTPUT_LEASE_TIMEOUT, DEFAULT_OUTPUT_LEASE_WAIT,
                      DEFAULT_PERSIST_EVERY, PREEMPTION_SIGNALS, UnifiedCheckpointOptions, parse_flash, parse_lease,
                      parse_options, parse_preemption)

_CONFIG_HELP = "Space- or comma-separated words: " + "; ".join(f"{w}: {d}" for w, d in CONFIG_WORDS.items()) + "."


@dataclass
class UnifiedCheckpointFields:
    """Dataclass mixin holding the plugin's fields; put it first in the bases of a TrainingArguments subclass."""

    #: The config class `with_unified_checkpoint` extended (objects pickle by it); None for a class written by hand.
    _uc_base: ClassVar[type | None] = None

    unified_checkpoint: bool = field(
        default=False,
        metadata={"help": "Save every checkpoint as engine- and world-size-independent safetensors "
                          "(model loadable by from_pretrained, optimizer keyed by parameter name)."},
    )
    unified_checkpoint_config: str = field(default="", metadata={"help": _CONFIG_HELP})
    ckpt_quant_stage: str = field(
        default="O0",
        metadata={"help": "Optimizer-state compression in checkpoints: O0 none, O1 int8, O2 int4."},
    )
    disable_ckpt_quant: bool = field(
        default=False, metadata={"help": "Turn checkpoint compression off whatever ckpt_quant_stage says."}
    )
    ema_decay: float = field(
        default=0.999, metadata={"help": "With the word 'ema': the EMA's decay per update, in (0, 1)."}
    )
    ema_interval: int = field(
        default=1, metadata={"help": "With the word 'ema': update the EMA every this many optimizer steps (>= 1)."}
    )
    unified_checkpoint_max_shard_size: str = field(
        default=DEFAULT_MAX_SHARD_SIZE,
        metadata={"help": "Largest safetensors file written, e.g. '5GB' or '512MiB'. Files are also split so "
                          "that every rank writes at least one when the state is large enough."},
    )

    unified_checkpoint_storage: str = field(
        default="",
        metadata={"help": "Where the run's checkpoints go: empty for output_dir, or an object-store prefix such as "
                          "'s3://bucket/run1' (pip install 'hf_unified_ckpt[s3]'). Endpoint and credentials come from "
                          "the AWS environment and config files, never from here. Logs and save_model stay in "
                          "output_dir."},
    )

    unified_checkpoint_memory_dir: str = field(
        default=DEFAULT_MEMORY_DIR,
        metadata={"help": "With the word 'flash': the node-local memory folder (a tmpfs) checkpoints are saved into "
                          "first; the run's go in <dir>/hf_unified_ckpt/<run id>/."},
    )
    unified_checkpoint_persist_every: int = field(
        default=DEFAULT_PERSIST_EVERY,
        metadata={"help": "With 'flash': a persister process makes every this-many-th save durable (output_dir or "
                          "unified_checkpoint_storage); the last and the best are made durable when training ends."},
    )
    unified_checkpoint_memory_keep: int = field(
        default=DEFAULT_MEMORY_KEEP,
        metadata={"help": "With 'flash': memory checkpoints kept, besides those not durable yet and the best."},
    )
    unified_checkpoint_memory_lease: float = field(
        default=DEFAULT_LEASE_TIMEOUT,
        metadata={"help": "With 'flash': seconds without a heartbeat after which the persister takes the trainer "
                          "for gone; it then makes the newest memory checkpoint durable and keeps the memory this "
                          "long for a restarted job, then frees it."},
    )

    unified_checkpoint_async_executor: str = field(
        default="thread",
        metadata={"help": "With 'async_save' or 'flash': where a save writes after its snapshot: 'thread' (a thread "
                          "of the trainer) or 'process' (a writer process per rank, with its own process group)."},
    )

    unified_checkpoint_direct_io: bool = field(
        default=True,
        metadata={"help": "Write checkpoints (and save_model's weights) to local or mounted folders with direct I/O "
                          "(O_DIRECT: several writes in flight, past the page cache: a save at the disk's speed that "
                          "leaves the job's page cache alone) where the filesystem takes it; a filesystem that refuses "
                          "it is found by a probe and written through the page cache. False: always through the page "
                          "cache (e.g. a network filesystem where direct writes are slower)."},
    )

    unified_checkpoint_lease_timeout: float = field(
        default=DEFAULT_OUTPUT_LEASE_TIMEOUT,
        metadata={"help": "One job per output_dir: train() takes a lease on the checkpoints' folder before its first "
                          "step and renews it; a job on another machine that has not renewed it for this many seconds "
                          "is taken for gone (on the same machine a dead process is seen at once)."},
    )
    unified_checkpoint_lease_wait: float = field(
        default=DEFAULT_OUTPUT_LEASE_WAIT,
        metadata={"help": "Seconds train() waits for another live job's lease on the checkpoints' folder to end "
                          "(a requeued job's predecessor) before it refuses to start, naming that job; 0: at once."},
    )
    unified_checkpoint_aggregate_range: str = field(
        default=DEFAULT_AGGREGATE_RANGE,
        metadata={"help": "On a folder every rank sees, a file the ranks hold in pieces (ZeRO-3, FSDP2) with more "
                          "writers than unified_checkpoint_aggregators is written by a few aggregator ranks, each about "
                          "this many bytes of it in large aligned writes (e.g. '256MiB', a multiple of a Lustre or "
                          "GPFS stripe); the words 'aggregate' / 'in_place' force it on / off."},
    )
    unified_checkpoint_aggregators: int = field(
        default=DEFAULT_AGGREGATORS,
        metadata={"help": "The most ranks that write one file; a file with more writers in place is aggregated."},
    )
    unified_checkpoint_aggregate_buffer: str = field(
        default=DEFAULT_AGGREGATE_BUFFER,
        metadata={"help": "An aggregator's extra host memory: it receives and writes cells of half of it, one while "
                          "the other is written."},
    )

    save_on_preemption: bool = field(
        default=True,
        metadata={"help": "With unified_checkpoint: on a preemption signal (preemption_signals) the ranks agree at the "
                          "next step boundary, save a checkpoint there, and train() raises TrainingPreempted (a "
                          "SystemExit: the process ends with status 128 + the signal's number)."},
    )
    preemption_signals: str = field(
        default="SIGTERM",
        metadata={"help": "Signals that mean preemption, space- or comma-separated, from "
                          f"{', '.join(PREEMPTION_SIGNALS)} (SLURM's --signal usually sends SIGUSR1 ahead)."},
    )
    preemption_grace_period: float = field(
        default=DEFAULT_GRACE_PERIOD,
        metadata={"help": "Seconds between the preemption signal and the SIGKILL after it (torchrun: 30). A rank "
                          "waits at most half of it for the others to agree; a save predicted to overrun it is said."},
    )
    slurm_requeue: bool = field(
        default=False,
        metadata={"help": "Under SLURM: after the preemption save, requeue the job (scontrol requeue; array tasks "
                          "included). Resume it with resume_from_checkpoint='auto'."},
    )

    def __post_init__(self):
        super().__post_init__()
        self._unified_checkpoint_options = parse_options(
            unified_checkpoint=self.unified_checkpoint,
            unified_checkpoint_config=self.unified_checkpoint_config,
            ckpt_quant_stage=self.ckpt_quant_stage,
            disable_ckpt_quant=self.disable_ckpt_quant,
            max_shard_size=self.unified_checkpoint_max_shard_size,
            ema_decay=self.ema_decay,
            ema_interval=self.ema_interval,
            preemption=parse_preemption(self.save_on_preemption, self.preemption_signals,
                                        self.preemption_grace_period, self.slurm_requeue),
            storage=self.unified_checkpoint_storage,
            flash=parse_flash(self.unified_checkpoint_memory_dir, self.unified_checkpoint_persist_every,
                              self.unified_checkpoint_memory_keep, self.unified_checkpoint_memory_lease),
            async_executor=self.unified_checkpoint_async_executor,
            direct_io=self.unified_checkpoint_direct_io,
            lease=parse_lease(self.unified_checkpoint_lease_timeout, self.unified_checkpoint_lease_wait),
            aggregate_range=self.unified_checkpoint_aggregate_range,
            aggregators=self.unified_checkpoint_aggregators,
            aggregate_buffer=self.unified_checkpoint_aggregate_buffer,
        )

    @property
    def unified_checkpoint_options(self) -> UnifiedCheckpointOptions:
        """The parsed, frozen options."""
        return self._unified_checkpoint_options

    def __reduce__(self):
        """Pickled (`training_args.bin`) by the config class it extends, so that it unpickles in any interpreter,
        also where the class `with_unified_checkpoint` made is bound to no importable name."""
        cls = type(self)
        return _rebuild, (cls.__module__, cls.__qualname__, cls._uc_base, dict(self.__dict__))


def _rebuild(module: str, qualname: str, base: type | None, state: dict):
    """Unpickle an arguments object `__reduce__` pickled: its class by name where importable, else
    `with_unified_checkpoint(base)`."""
    import importlib

    cls = None
    try:
        cls = getattr(importlib.import_module(module), qualname, None)
    except ImportError:
        pass
    if not (isinstance(cls, type) and issubclass(cls, UnifiedCheckpointFields)):
        cls = with_unified_checkpoint(base)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


_CACHE: dict[type, type] = {}


def with_unified_checkpoint(config_cls: type, name: str | None = None, module: str | None = None) -> type:
    """Return a subclass of `config_cls` (a TrainingArguments dataclass) with the plugin's fields.

    The result is cached per class. Its objects pickle by `config_cls` (the Trainer's `training_args.bin`
    unpickles in a fresh interpreter, to an equal object), whether or not the result is bound to a module-level
    name.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, TrainingArguments) and is_dataclass(config_cls)):
        raise TypeError(f"with_unified_checkpoint expects a TrainingArguments dataclass, got {config_cls!r}.")
    if issubclass(config_cls, UnifiedCheckpointFields):
        return config_cls
    if config_cls not in _CACHE:
        cls_name = name or f"Unified{config_cls.__name__}"
        namespace = {"__module__": module or config_cls.__module__, "__qualname__": cls_name, "_uc_base": config_cls}
        _CACHE[config_cls] = dataclass(type(cls_name, (UnifiedCheckpointFields, config_cls), namespace))
    return _CACHE[config_cls]


UnifiedCheckpointArguments = with_unified_checkpoint(
    TrainingArguments, name="UnifiedCheckpointArguments", module=__name__
)
UnifiedCheckpointArguments.__doc__ = (
    "`transformers.TrainingArguments` plus the unified-checkpoint fields "
    "(unified_checkpoint, unified_checkpoint_config, ckpt_quant_stage, disable_ckpt_quant, ema_decay, ema_interval, "
    "unified_checkpoint_max_shard_size, unified_checkpoint_storage, unified_checkpoint_memory_dir, "
    "unified_checkpoint_persist_every, unified_checkpoint_memory_keep, unified_checkpoint_memory_lease, "
    "unified_checkpoint_async_executor, unified_checkpoint_direct_io, unified_checkpoint_lease_timeout, "
    "unified_checkpoint_lease_wait, unified_checkpoint_aggregate_range, unified_checkpoint_aggregators, "
    "unified_checkpoint_aggregate_buffer, save_on_preemption, preemption_signals, "
    "preemption_grace_period, slurm_requeue)."
)
