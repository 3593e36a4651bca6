"""User options: parsed once from TrainingArguments fields into a frozen `UnifiedCheckpointOptions`.

No other module looks at option strings; everything reads the frozen dataclass.
"""

from __future__ import annotations

import difflib
import os
import re
import dataclasses
from dataclasses import dataclass

from .errors import UnsupportedOptionError

#: Words accepted in `unified_checkpoint_config`, with what each does.
CONFIG_WORDS: dict[str, str] = {
    "async_save": "write the checkpoint in the background; training blocks only for the host snapshot",
    "skip_save_model_weight": "when fp32 master weights exist, save them as the model weights and skip the low-precision copy",
    "master_weight_compatible": "build missing master weights from the model weights on load",
    "remove_master_weight": "do not save master weights; rebuild them from the model weights on load",
    "enable_all_options": "skip_save_model_weight + master_weight_compatible",
    "ema": "keep an exponential moving average of the weights (ema_decay, ema_interval) and save it in every "
           "checkpoint as ema*.safetensors",
    "residual_master_weight": "store the fp32 master weights as a 16-bit residual over their bf16 rounding in the "
                              "model files (exact, 2 bytes per parameter instead of 4)",
    "flash": "save into node-local memory (unified_checkpoint_memory_dir, /dev/shm by default) at memory speed, "
             "snapshot as async_save does; a persister process that outlives the trainer makes every "
             "unified_checkpoint_persist_every-th save durable; resume picks the newest checkpoint across tiers",
    "aggregate": "on a folder every rank sees, write every file the ranks hold in pieces through a few aggregator "
                 "ranks (large aligned ranges, point-to-point transfers) instead of each rank writing its pieces in "
                 "place; by default only files with more writers than unified_checkpoint_aggregators, or small "
                 "pieces from several machines, are aggregated",
    "in_place": "never aggregate: every rank writes its pieces in place (a filesystem that serves many small "
                "writers well)",
    "trust_pickles": "resume from a legacy DeepSpeed or FSDP folder you trust even where its pickles name classes "
                     "beyond tensors, plain values and the known DeepSpeed/DCP ones (unpickled whole, as DeepSpeed "
                     "and torch.distributed.checkpoint do: runs any code they hold)",
}

#: Words whose implementation has not landed yet: accepted by the parser, refused by `validate_supported`.
NOT_SUPPORTED_YET: dict[str, str] = {}

QUANT_STAGES = ("O0", "O1", "O2")
#: Signals a preemption may arrive by (SIGKILL and SIGSTOP cannot be caught).
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGXCPU")
DEFAULT_GRACE_PERIOD = 30.0
DEFAULT_MAX_SHARD_SIZE = "5GB"
DEFAULT_MEMORY_DIR = "/dev/shm"
DEFAULT_PERSIST_EVERY = 4
DEFAULT_MEMORY_KEEP = 2
DEFAULT_LEASE_TIMEOUT = 600.0
DEFAULT_OUTPUT_LEASE_TIMEOUT = 60.0
DEFAULT_OUTPUT_LEASE_WAIT = 120.0
DEFAULT_AGGREGATE_RANGE = "256MiB"
DEFAULT_AGGREGATORS = 8
DEFAULT_AGGREGATE_BUFFER = "512MiB"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


#: Where a background save writes after its snapshot (`checkpoint/save/executors.py`).
ASYNC_EXECUTORS = ("thread", "process")


@dataclass(frozen=True)
class PreemptionOptions:
    """What a preemption signal does, with `unified_checkpoint=True` (`preemption/`, `trainer/preempt.py`).

    Attributes:
        enabled: on a signal, the ranks agree at the next step boundary, save, and `train()` raises
            `TrainingPreempted` (`save_on_preemption`).
        signals: the signal numbers that mean "preempted" (`preemption_signals`, SIGTERM by default).
        grace_period: seconds between the signal and the SIGKILL that follows it (`preemption_grace_period`; 30,
            torchrun's). A rank waits at most half of it for the others to agree.
        requeue: under SLURM, requeue the job after the save (`slurm_requeue`).
    """

    enabled: bool = True
    signals: tuple[int, ...] = (15,)
    grace_period: float = DEFAULT_GRACE_PERIOD
    requeue: bool = False

    @property
    def agree_timeout(self) -> float:
        return self.grace_period / 2


@dataclass(frozen=True)
class FlashOptions:
    """The memory tier (`flash`; `flash/`, `flash/tier.py`).

    Attributes:
        enabled: saves go into node-local memory first; a persister process makes some durable.
        memory_dir: the memory folder (`unified_checkpoint_memory_dir`); the run's checkpoints go in
            `<memory_dir>/hf_unified_ckpt/<run id>/`.
        persist_every: make every this-many-th flash save durable (`unified_checkpoint_persist_every`); the last one
            and the best one are always made durable when training ends.
        keep: memory checkpoints kept (`unified_checkpoint_memory_keep`), besides those not durable yet and the best.
        lease_timeout: seconds without a heartbeat after which the persister takes the trainer for gone
            (`unified_checkpoint_memory_lease`); a trainer whose processes died is seen at once. After the trainer
            is gone, the persister makes the newest memory checkpoint durable and keeps the memory this long for a
            restarted job to resume from, then frees it.
    """

    enabled: bool = False
    memory_dir: str = DEFAULT_MEMORY_DIR
    persist_every: int = DEFAULT_PERSIST_EVERY
    keep: int = DEFAULT_MEMORY_KEEP
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT


def parse_flash(memory_dir: str = DEFAULT_MEMORY_DIR, persist_every: int = DEFAULT_PERSIST_EVERY,
                keep: int = DEFAULT_MEMORY_KEEP, lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> FlashOptions:
    """The memory-tier fields parsed and checked, whether or not `flash` is on (`parse_options` sets `enabled`
    from the word)."""
    from .store import scheme_of

    memory_dir = str(memory_dir or DEFAULT_MEMORY_DIR)
    if scheme_of(memory_dir):
        raise ValueError(f"unified_checkpoint_memory_dir={memory_dir!r} is a URL; it takes a node-local folder in "
                         "memory such as '/dev/shm' (a tmpfs). Durable storage is output_dir or "
                         "unified_checkpoint_storage.")
    for name, value in (("unified_checkpoint_persist_every", persist_every), ("unified_checkpoint_memory_keep", keep)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name}={value!r}: expected a whole number >= 1.")
    if not float(lease_timeout) > 0:
        raise ValueError(f"unified_checkpoint_memory_lease={lease_timeout!r}: expected seconds > 0 (how long the "
                         "persister waits for a silent trainer, and keeps its memory for a restart).")
    return FlashOptions(False, os.path.abspath(memory_dir), int(persist_every), int(keep), float(lease_timeout))


@dataclass(frozen=True)
class LeaseOptions:
    """The lease a `train()` call holds on the folder its checkpoints go to: one job per output_dir
    (`checkpoint/folder/lease.py`).

    Attributes:
        timeout: seconds without a renewal after which the lease of a job on another machine is taken for stale
            (`unified_checkpoint_lease_timeout`); on the same machine a dead process is seen at once.
        wait: seconds a job waits for another job's live lease to end before it refuses to start
            (`unified_checkpoint_lease_wait`): a requeued job whose predecessor still saves, or whose predecessor's
            machine died (its lease goes stale after `timeout`).
    """

    timeout: float = DEFAULT_OUTPUT_LEASE_TIMEOUT
    wait: float = DEFAULT_OUTPUT_LEASE_WAIT


def parse_lease(timeout: float = DEFAULT_OUTPUT_LEASE_TIMEOUT, wait: float = DEFAULT_OUTPUT_LEASE_WAIT) -> LeaseOptions:
    """The output_dir lease fields parsed and checked."""
    if not float(timeout) > 0:
        raise ValueError(f"unified_checkpoint_lease_timeout={timeout!r}: expected seconds > 0 (how long a job on "
                         "another machine may go without renewing its lease before it is taken for gone).")
    if not float(wait) >= 0:
        raise ValueError(f"unified_checkpoint_lease_wait={wait!r}: expected seconds >= 0 (how long a job waits for "
                         "another job's lease on its output_dir to end; 0 refuses at once).")
    return LeaseOptions(float(timeout), float(wait))


@dataclass(frozen=True)
class AggregationOptions:
    """How a save writes files the ranks hold in pieces on a folder every rank sees (`format/aggregation.py`,
    `checkpoint/write/aggregating.py`).

    Attributes:
        mode: "auto" (aggregate a file with more writers than `per_file`, or written in small pieces by several
            machines), "always" (the word `aggregate`) or "never" (the word `in_place`).
        range_bytes: about how many bytes of a file one aggregator writes (`unified_checkpoint_aggregate_range`).
        per_file: at most this many aggregators per file (`unified_checkpoint_aggregators`).
        buffer_bytes: an aggregator's extra host memory (`unified_checkpoint_aggregate_buffer`): it receives and
            writes cells of half of it, one while the other is written.
    """

    mode: str = "auto"
    range_bytes: int = 256 * 2**20
    per_file: int = DEFAULT_AGGREGATORS
    buffer_bytes: int = 512 * 2**20

    @property
    def cell_bytes(self) -> int:
        return self.buffer_bytes // 2


def parse_aggregation(words: set[str], range_bytes: str | int = DEFAULT_AGGREGATE_RANGE,
                      per_file: int = DEFAULT_AGGREGATORS,
                      buffer_bytes: str | int = DEFAULT_AGGREGATE_BUFFER) -> AggregationOptions:
    """The aggregation words and fields parsed and checked."""
    if {"aggregate", "in_place"} <= words:
        raise ValueError("unified_checkpoint_config: 'aggregate' (always write through aggregators) and 'in_place' "
                         "(never) contradict each other; keep one of them, or neither for the automatic choice.")
    ranges = parse_size(range_bytes, "unified_checkpoint_aggregate_range")
    buffer = parse_size(buffer_bytes, "unified_checkpoint_aggregate_buffer")
    if int(per_file) != per_file or per_file < 1:
        raise ValueError(f"unified_checkpoint_aggregators={per_file!r}: expected a whole number >= 1 (the most "
                         "ranks that write one file).")
    if buffer < 2 * 4096:
        raise ValueError(f"unified_checkpoint_aggregate_buffer={buffer_bytes!r}: expected at least 8KiB (two cells "
                         "of one 4 KiB block), e.g. '512MiB'.")
    mode = "always" if "aggregate" in words else "never" if "in_place" in words else "auto"
    return AggregationOptions(mode, ranges, int(per_file), buffer)


def parse_signals(value: str | list[str] | tuple) -> tuple[int, ...]:
    """"SIGTERM,SIGUSR1" (names with or without SIG, or numbers; spaces or commas) into signal numbers."""
    import signal

    words = split_config_words(value if value is not None else "")
    numbers = []
    for word in words:
        name = word.upper() if not word.isdigit() else None
        name = name if name is None or name.startswith("SIG") else f"SIG{name}"
        try:
            number = int(word) if name is None else int(getattr(signal, name))
            canonical = signal.Signals(number).name
        except (AttributeError, ValueError):
            canonical = None
        if canonical not in PREEMPTION_SIGNALS:
            raise ValueError(
                f"preemption_signals: {word!r} is not a signal a preemption can be caught by; expected names from "
                f"{list(PREEMPTION_SIGNALS)} (SIGKILL and SIGSTOP cannot be caught), e.g. 'SIGTERM,SIGUSR1'.")
        if number not in numbers:
            numbers.append(number)
    if not numbers:
        raise ValueError("preemption_signals is empty; name at least one signal (e.g. 'SIGTERM'), or set "
                         "save_on_preemption=False to turn preemption handling off.")
    return tuple(numbers)


def parse_preemption(enabled: bool = True, signals="SIGTERM", grace_period: float = DEFAULT_GRACE_PERIOD,
                     requeue: bool = False) -> PreemptionOptions:
    """The preemption fields parsed and checked."""
    if not float(grace_period) > 0:
        raise ValueError(f"preemption_grace_period={grace_period!r}: expected the seconds between the preemption "
                         "signal and the SIGKILL that follows it (> 0; torchrun waits 30, SLURM's KillWait is 30 by "
                         "default).")
    return PreemptionOptions(enabled=bool(enabled), signals=parse_signals(signals), grace_period=float(grace_period),
                             requeue=bool(requeue))


@dataclass(frozen=True)
class UnifiedCheckpointOptions:
    """The plugin's options, parsed and validated once.

    Attributes:
        enabled: write unified checkpoints (`unified_checkpoint=True`).
        async_save: write in the background; training waits only for assembling the tensors and, before its
            next optimizer step, for copying them into reused host buffers.
        skip_save_model_weight: save master weights in place of the model weights when they exist.
        master_weight_compatible: rebuild missing master weights from model weights on load.
        remove_master_weight: never save master weights.
        residual_master_weight: store master weights as a 16-bit residual over the bf16 model weights (exact).
        ema, ema_decay, ema_interval: keep (and save) an EMA of the weights, updated every `ema_interval` steps.
        quant_stage: optimizer-moment compression, "O0" (none), "O1" (int8) or "O2" (int4).
        max_shard_size: upper bound, in bytes, of one safetensors file.
        preemption: what a preemption signal does (`PreemptionOptions`).
        storage: where the run's checkpoints go (`unified_checkpoint_storage`): an object-store URL prefix such as
            `s3://bucket/run1`, or None for `output_dir`.
        flash: the memory tier (`FlashOptions`; on with the word `flash`).
        async_executor: where a background save (`async_save`, `flash`) writes after its snapshot: "thread" (a
            thread of the trainer) or "process" (a writer process per rank).
        direct_io: write checkpoint files to local and mounted folders with direct I/O (`O_DIRECT`, past the page
            cache) where the filesystem takes it (`unified_checkpoint_direct_io`); False: through the page cache.
        trust_pickles: a legacy folder resumed from is unpickled whole (`trust_pickles`), not with `weights_only`
            and an allow-list (`store/pickles.py`).
        lease: the lease `train()` takes on the checkpoints' folder, one job per output_dir (`LeaseOptions`).
        aggregation: which files a few aggregator ranks write for all (`AggregationOptions`).
    """

    enabled: bool = False
    async_save: bool = False
    skip_save_model_weight: bool = False
    master_weight_compatible: bool = False
    remove_master_weight: bool = False
    residual_master_weight: bool = False
    ema: bool = False
    ema_decay: float = 0.999
    ema_interval: int = 1
    quant_stage: str = "O0"
    max_shard_size: int = 5 * 10**9
    preemption: PreemptionOptions = PreemptionOptions()
    storage: str | None = None
    flash: FlashOptions = FlashOptions()
    async_executor: str = "thread"
    direct_io: bool = True
    trust_pickles: bool = False
    lease: LeaseOptions = LeaseOptions()
    aggregation: AggregationOptions = AggregationOptions()
    #: Set on the options of one save only (`lineage.options_for_save`): the stage asked for, when the lineage guard
    #: wrote this save at O0, and the step of the lineage's latest restore from a compressed checkpoint.
    quant_stage_requested: str | None = None
    quantized_restore_step: int | None = None

    def as_manifest_dict(self) -> dict:
        """The options recorded in the manifest (what a reader must know to interpret the files)."""
        return {
            "ckpt_quant_stage": self.quant_stage,
            **({"ckpt_quant_stage_requested": self.quant_stage_requested} if self.quant_stage_requested else {}),
            **({"quantized_restore_step": self.quantized_restore_step}
               if self.quantized_restore_step is not None else {}),
            "skip_save_model_weight": self.skip_save_model_weight,
            "remove_master_weight": self.remove_master_weight,
            "residual_master_weight": self.residual_master_weight,
            "async_save": self.async_save,
            "ema": self.ema,
            **({"ema_decay": self.ema_decay, "ema_interval": self.ema_interval} if self.ema else {}),
        }


def parse_storage(value: str | None) -> str | None:
    """`unified_checkpoint_storage`: None/"" (checkpoints in output_dir), or the URL of a store (`s3://bucket/run`)
    whose scheme has a store (checked here, before any training; nothing is contacted). Credentials never go in the
    URL: they would be saved with the training arguments."""
    if not value:
        return None
    from .store import scheme_of, store_for  # here: the store registry imports its backends

    value = str(value).strip().rstrip("/")
    if not scheme_of(value):
        raise ValueError(f"unified_checkpoint_storage={value!r} is a local path; it takes an object-store URL such as "
                         "'s3://bucket/run1'. For a local or mounted folder, set output_dir instead.")
    where, _, rest = value.partition("://")
    if "@" in rest.split("/", 1)[0] or "?" in rest:
        raise ValueError(f"unified_checkpoint_storage: the URL carries credentials or parameters ({where}://<...>@ or "
                         "?...), which would be saved with the training arguments. Give the bare "
                         f"'{where}://bucket/prefix' and put credentials in the environment (AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3) or ~/.aws/credentials.")
    if not rest.split("/", 1)[0]:
        raise ValueError(f"unified_checkpoint_storage={value!r} names no bucket; expected '{where}://bucket/prefix'.")
    store_for(value)  # an unknown or unsupported scheme is refused by name here
    return value


def parse_size(value: str | int, what: str = "unified_checkpoint_max_shard_size") -> int:
    """Parse "5GB", "500MiB", "1000" or an int into bytes (`what`: the option, named in errors)."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).upper() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; expected a number of bytes "
                f"or a number with a unit ({', '.join(u for u in _SIZE_UNITS if u)}), e.g. '5GB' or '512MiB'."
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}.")
    return size


def split_config_words(config: str | list[str] | None) -> list[str]:
    """Split `unified_checkpoint_config` on spaces and commas (a list is accepted as well)."""
    if config is None:
        return []
    if isinstance(config, (list, tuple)):
        config = " ".join(config)
    return [w for w in re.split(r"[\s,]+", config.strip()) if w]


def did_you_mean(word: str, choices) -> str:
    """" (did you mean 'x'?)" with the closest of `choices` to `word`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_options(
    unified_checkpoint: bool = False,
    unified_checkpoint_config: str | list[str] | None = "",
    ckpt_quant_stage: str = "O0",
    disable_ckpt_quant: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    ema_decay: float = 0.999,
    ema_interval: int = 1,
    preemption: PreemptionOptions | None = None,
    storage: str | None = None,
    flash: FlashOptions | None = None,
    async_executor: str = "thread",
    direct_io: bool = True,
    lease: LeaseOptions | None = None,
    aggregate_range: str | int = DEFAULT_AGGREGATE_RANGE,
    aggregators: int = DEFAULT_AGGREGATORS,
    aggregate_buffer: str | int = DEFAULT_AGGREGATE_BUFFER,
) -> UnifiedCheckpointOptions:
    """Parse the raw argument values into `UnifiedCheckpointOptions`.

    Raises:
        ValueError: an unknown word, an unknown quantisation stage, or a contradictory combination.
        UnsupportedOptionError: a valid option whose implementation has not landed yet.
    """
    words = split_config_words(unified_checkpoint_config)
    unknown = [w for w in words if w not in CONFIG_WORDS]
    if unknown:
        named = ", ".join(repr(w) + did_you_mean(w, CONFIG_WORDS) for w in unknown)
        raise ValueError(
            f"unified_checkpoint_config: unknown word(s) {named}; valid words are: "
            + ", ".join(f"'{w}' ({d})" for w, d in CONFIG_WORDS.items())
            + ". Separate words with spaces or commas."
        )
    chosen = set(words)
    if "enable_all_options" in chosen:
        chosen |= {"skip_save_model_weight", "master_weight_compatible"}
    if {"skip_save_model_weight", "remove_master_weight"} <= chosen:
        raise ValueError(
            "unified_checkpoint_config: 'skip_save_model_weight' (or 'enable_all_options') together with "
            "'remove_master_weight' would save no weights at all. Keep one of them."
        )
    _refuse_contradictions(chosen, set(words))
    stage = (ckpt_quant_stage or "O0").strip().upper()
    if stage not in QUANT_STAGES:
        raise ValueError(
            f"ckpt_quant_stage={ckpt_quant_stage!r} is not valid{did_you_mean(stage.replace('0', 'O'), QUANT_STAGES)}; "
            f"expected one of {list(QUANT_STAGES)} "
            "(O0: no compression, O1: int8, O2: int4 optimizer moments)."
        )
    if disable_ckpt_quant:
        stage = "O0"
    if not 0 < float(ema_decay) < 1:
        raise ValueError(f"ema_decay={ema_decay!r} is not in (0, 1); an EMA keeps decay * average + (1 - decay) * "
                         "weights, e.g. ema_decay=0.999.")
    if int(ema_interval) != ema_interval or ema_interval < 1:
        raise ValueError(f"ema_interval={ema_interval!r}: expected a whole number of optimizer steps >= 1.")
    if async_executor not in ASYNC_EXECUTORS:
        raise ValueError(f"unified_checkpoint_async_executor={async_executor!r}"
                         f"{did_you_mean(async_executor, ASYNC_EXECUTORS)}: expected one of {list(ASYNC_EXECUTORS)} "
                         "(where a background save writes after its snapshot).")
    options = UnifiedCheckpointOptions(
        enabled=bool(unified_checkpoint),
        async_save="async_save" in chosen,
        skip_save_model_weight="skip_save_model_weight" in chosen,
        master_weight_compatible="master_weight_compatible" in chosen,
        remove_master_weight="remove_master_weight" in chosen,
        residual_master_weight="residual_master_weight" in chosen,
        ema="ema" in chosen,
        ema_decay=float(ema_decay),
        ema_interval=int(ema_interval),
        quant_stage=stage,
        max_shard_size=parse_size(max_shard_size),
        preemption=preemption if preemption is not None else PreemptionOptions(),
        storage=parse_storage(storage),
        flash=dataclasses.replace(flash or FlashOptions(), enabled="flash" in chosen),
        async_executor=async_executor,
        direct_io=bool(direct_io),
        trust_pickles="trust_pickles" in chosen,
        lease=lease if lease is not None else LeaseOptions(),
        aggregation=parse_aggregation(chosen, aggregate_range, aggregators, aggregate_buffer),
    )
    validate_supported(options, words)
    return options


def _refuse_contradictions(chosen: set[str], given: set[str]) -> None:
    """Word pairs that ask for two different things; the error names both words as the user wrote them."""
    if "residual_master_weight" not in chosen:
        return
    for other, why in (("remove_master_weight", "keeps no master weights at all"),
                       ("skip_save_model_weight", "writes the fp32 master weights as the model weights, leaving no "
                                                  "bf16 model weights for a residual to refine")):
        if other in chosen:
            named = f"'{other}'" if other in given else f"'enable_all_options' (which implies '{other}')"
            raise ValueError(
                f"unified_checkpoint_config: 'residual_master_weight' stores exact fp32 master weights as a residual "
                f"over the bf16 model weights, but {named} {why}. Keep one of them (residual_master_weight alone "
                "already keeps both the bf16 weights and the exact fp32 master weights, in 4 bytes per parameter).")


def validate_supported(options: UnifiedCheckpointOptions, words: list[str]) -> None:
    """Refuse options that this version accepts in the format but does not implement yet."""
    pending = [w for w in words if w in NOT_SUPPORTED_YET]
    if pending:
        what = sorted({NOT_SUPPORTED_YET[w] for w in pending})
        raise UnsupportedOptionError(
            f"unified_checkpoint_config: {sorted(set(pending))} not supported yet in this version "
            f"({'; '.join(what)}). Remove the word(s) to save and resume without them."
        )
