"""DeepSpeed ZeRO stages 1, 2 and 3 (fp32 and bf16).

Reading and writing go through DeepSpeed's own accessors:

- ZeRO-1/2 keep the low-precision (lp) parameters whole on every rank and partition the fp32 master weights
  and optimizer state as contiguous fragments of a flat buffer. Each parameter's fragment is described by
  DeepSpeed's own mapping object (`param._hp_mapping`, the one `safe_get_full_fp32_param` uses). A tensor
  whose fragment lies whole on one rank is planned to be written by that rank and read there with no
  communication; the few tensors that straddle a partition boundary are assembled with
  `deepspeed.utils.safe_get_full_fp32_param` / `safe_get_full_optimizer_state`. On load, each rank reads only
  the rows that cover its fragments.
- ZeRO-3 partitions everything: full tensors are assembled with `safe_get_full_fp32_param`,
  `safe_get_full_optimizer_state` and `deepspeed.zero.GatheredParameters`; on load each rank reads only its
  partition's rows and stores them with `safe_set_local_fp32_param` / `safe_set_local_optimizer_state`.

Per-group scalars of the base optimizer (Adam's `step`) are written once per parameter, as 0-d tensors, like
every other engine writes them.

With DeepSpeed AutoTP (`tensor_parallel.autotp_size`, ZeRO-1/2) a sharded parameter holds one slice of its full
tensor (`autotp.TPSplit`) and ZeRO's fragments are ranges of that slice: the specs give full shapes, row slices are
written in place by their holders, column slices are gathered over the tensor-parallel group, and a load reads
each rank's slice of the rows that cover its fragment.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from .. import dist
from ..format.components import MASTER, MODEL, OPTIMIZER, Component, saved_by
from ..errors import UnsupportedCheckpointError, count_and_first
from .hf_model import naming_policy, model_config_files
from ..format.names import optimizer_key, split_optimizer_key
from ..format.optim_state import OptimizerStateDecoder, OptimizerStateEncoder, encode_scalar
from ..format.planning import Strided, TensorSpec
from ..format.reader import TensorReader, read_flat_range
from .autotp import TPSplit, autotp_splits, gather_split, read_split_range
from .base import Fragment, component_source

logger = logging.getLogger(__name__)

#: The optimizer index's metadata key of an fp16 run's loss-scaler state, and the scaler attributes that change
#: while training (DeepSpeed's `DynamicLossScaler`; a static `LossScaler` has `cur_scale` only).
LOSS_SCALER = "loss_scaler"
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


#: DeepSpeed optimizer -> what its wrapped `step` waits for first (`wait_before_steps`).
_WAITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wait_before_steps(ds_engine, wait) -> None:
    """Make this DeepSpeed engine's optimizer call `wait()` before each of its steps (this instance only; set
    once, later calls replace `wait`). DeepSpeed steps inside `backward`, where no Trainer callback runs; an
    async save's snapshot may read the fp32 partitions and optimizer state until that step changes them."""
    optimizer = ds_engine.optimizer
    if optimizer not in _WAITS:
        step = optimizer.step

        def step_after_wait(*args, **kwargs):
            _WAITS[optimizer]()
            return step(*args, **kwargs)

        optimizer.step = step_after_wait
    _WAITS[optimizer] = wait



def autotp_refusal(tp_size: int, stage: int) -> str | None:
    """Why DeepSpeed AutoTP at `tp_size` with ZeRO `stage` cannot be checkpointed (None: it can). AutoTP is supported
    with ZeRO-1/2 (`autotp.py`); with ZeRO-3 each rank's partition is of its TP slice, which the ZeRO-3 reader does not
    follow. The Trainer integration asks before the first step; the adapter refuses the same way."""
    if tp_size > 1 and stage == 3:
        return (f"DeepSpeed AutoTP (tensor_parallel.autotp_size={tp_size}) with ZeRO stage 3 is not supported by "
                "unified checkpoints: use AutoTP with ZeRO stage 1 or 2, ZeRO-3 without autotp_size, or transformers' "
                "tensor parallelism (from_pretrained(..., tp_plan='auto')).")
    return None

class DeepSpeedEngine:
    """Adapter for a `deepspeed.DeepSpeedEngine` (ZeRO stage 1, 2 or 3) wrapping a transformers/PEFT model."""

    #: The weights are written into the ZeRO partitions by position (the load checks their shapes first).
    loads_by_module = False

    def __init__(self, ds_engine, master_weights_policy: str = "save"):
        self.ds = ds_engine
        self.zero = ds_engine.optimizer
        self.base = getattr(self.zero, "optimizer", None)
        self.stage = int(ds_engine.zero_optimization_stage())
        self.module: nn.Module = ds_engine.module
        self.engine = f"deepspeed-zero{self.stage}"
        if self.stage not in (1, 2, 3) or self.base is None:
            raise UnsupportedCheckpointError(
                f"unified checkpoints support DeepSpeed ZeRO stages 1, 2 and 3 with a torch optimizer; this engine "
                f"runs stage {self.stage} with {type(self.zero).__name__}.")
        self.naming = naming_policy(self.module)
        self._named = self._collect_params()
        self._weight_key = {self.naming.stored_key(n): k for n, _ in self.module.named_parameters()
                            if (k := self.naming.weight_key(n)) is not None}
        self._weight_param = {k: n for n, k in self._weight_key.items()}
        self.lp_dtype = next(p.dtype for _, p in self._named)
        self.has_master = self.lp_dtype != torch.float32
        self.master_policy = master_weights_policy
        self._by_name = dict(self._named)
        self._name_of = {id(p): n for n, p in self._named}
        self._groups = self._lp_groups()
        self._group_index = {n: g for g, names in enumerate(self._groups) for n in names}
        self._cache: dict[tuple[str, str], torch.Tensor] = {}
        self._frag_sizes: dict[str, list[int]] | None = None
        self._flat: dict[str, tuple[int, int]] | None = None  # ZeRO-1/2: name -> (offset in its group flat, partition)
        self._rule_confirmed = False
        self._keys: list[tuple[list[str], list[str]]] | None = None
        self._buffer_map: dict[str, torch.Tensor] | None = None
        self._tables: dict[str, tuple] | None = None
        self.tp_size = int(ds_engine.autotp_size() or 1) if hasattr(ds_engine, "autotp_size") else 1
        self._tp_index, self._split = self._tensor_parallel()
        if self.stage != 3:
            for g in range(len(self._groups)):
                self._link_fragments(g)

    # ---- parameters, names, groups -------------------------------------------------------------------
    def _collect_params(self) -> list[tuple[str, nn.Parameter]]:
        """(stored name, parameter) once per parameter: the name its master weights and optimizer state are keyed
        by (`NamingPolicy.stored_key`). Its weights are written under `self._weight_key[name]`, if at all (a PEFT
        model writes its adapter only)."""
        return [(self.naming.stored_key(name), p) for name, p in self.module.named_parameters()]

    def _tensor_parallel(self) -> tuple[int, dict[int, TPSplit]]:
        """(this rank's TP index, the `TPSplit` of every AutoTP-sharded parameter by id); (0, {}) without AutoTP."""
        if self.tp_size <= 1:
            return 0, {}
        refusal = autotp_refusal(self.tp_size, self.stage)
        if refusal:
            raise UnsupportedCheckpointError(refusal)
        from deepspeed.utils import groups

        index = int(groups.get_tensor_model_parallel_rank())
        splits = autotp_splits(self._named, index)
        return index, {id(self._by_name[n]): split for n, split in splits.items()}

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._named if p.requires_grad]

    def _full_shape(self, p) -> tuple[int, ...]:
        if self.stage == 3:
            return tuple(p.ds_shape)
        split = self._split.get(id(p))
        return split.shape if split is not None else tuple(p.shape)

    def _lp_groups(self) -> list[list[str]]:
        """Names of the lp parameters of each base-optimizer param group (DeepSpeed keeps the grouping in its
        ZeRO optimizer: `bit16_groups` (ZeRO-1/2), `bf16_groups` (BF16 optimizer), `fp16_groups` with
        `sub_group_to_group_id` (ZeRO-3))."""
        if self.stage == 3:
            groups: list[list[str]] = [[] for _ in self.base.param_groups]
            for sub, params in enumerate(self.zero.fp16_groups):
                groups[self.zero.sub_group_to_group_id[sub]].extend(self._name_of[id(p)] for p in params)
            return groups
        lp_groups = getattr(self.zero, "bit16_groups", None) or getattr(self.zero, "bf16_groups", None)
        if lp_groups is None:
            raise UnsupportedCheckpointError(f"cannot read the parameter groups of {type(self.zero).__name__}.")
        return [[self._name_of[id(p)] for p in g] for g in lp_groups]

    def _group_flats(self, g: int) -> list[torch.Tensor]:
        """The flat fp32 partitions the base optimizer keeps state for, for group `g`."""
        if self.stage == 3:
            return [self.zero.fp32_partitioned_groups_flat[s] for s, gid in self.zero.sub_group_to_group_id.items()
                    if gid == g]
        return list(self.base.param_groups[g]["params"])

    def _group_state(self, g: int) -> dict:
        flats = self._group_flats(g)
        return self.base.state.get(flats[0], {}) if flats else {}

    def _state_keys(self) -> list[tuple[list[str], list[str]]]:
        """Per group: (tensor state keys shaped like the flat partition, scalar state keys). Cached: an adapter
        serves one save or one load."""
        if self._keys is None:
            self._keys = self._read_state_keys()
        return self._keys

    def _read_state_keys(self) -> list[tuple[list[str], list[str]]]:
        out = []
        for g in range(len(self._groups)):
            state, flat = self._group_state(g), (self._group_flats(g) or [None])[0]
            tensors = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0
                             and flat is not None and v.shape == flat.shape)
            scalars = sorted(k for k, v in state.items() if k not in tensors)
            out.append((tensors, scalars))
        return out

    # ---- EngineAdapter: description --------------------------------------------------------------------
    def saved_by(self) -> dict:
        mesh = {"device_mesh": {"dp": dist.world_size() // self.tp_size, "tp": self.tp_size}} if self.tp_size > 1 else {}
        return saved_by("deepspeed", dist.world_size(), [self.lp_dtype], zero_stage=self.stage,
                        master_weights=self.has_master and self.master_policy == "save",
                        master_weights_dtype="float32" if self.has_master else None, **mesh)

    def needs_fp32_master(self) -> bool:
        """bf16 training keeps fp32 master weights; fp32 training loads them into the parameters."""
        return any(p.requires_grad for _, p in self._named)

    def components(self) -> list[Component]:
        weights = self.naming.weights
        master = [MASTER] if self.has_master and self.master_policy == "save" else []
        return [weights, *master, OPTIMIZER]

    def _held(self, component: str) -> tuple:
        """(specs, source of one tensor) of a component this engine writes (see `components`); built once."""
        if self._tables is None:
            every = {MODEL.name: (self._weights_specs, self._weights_source),
                     MASTER.name: (self._master_specs, self._master_source),
                     OPTIMIZER.name: (self._optimizer_specs, self._optimizer_source)}
            self._tables = {c.name: every[c.name] for c in self.components()}
        return component_source(self._tables, component, self.engine)

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers the weights files hold, by weight key (state_dict keys are valid under ZeRO-3 too)."""
        if self._buffer_map is None:
            persistent = set(self.module.state_dict(keep_vars=True).keys())
            self._buffer_map = {k: b for n, b in self.module.named_buffers()
                                if n in persistent and (k := self.naming.weight_key(n)) is not None}
        return self._buffer_map

    def specs(self, component: str) -> list[TensorSpec]:
        return self._held(component)[0]()

    def _weights_specs(self) -> list[TensorSpec]:
        dtype = torch.float32 if self.master_policy == "as_model" else None
        return ([TensorSpec(self._weight_key[n], self._full_shape(p), dtype or p.dtype) for n, p in self._named
                 if n in self._weight_key]
                + [TensorSpec.of(n, b) for n, b in self._buffers().items()])

    def _master_specs(self) -> list[TensorSpec]:
        """Keyed like the weights files (a PEFT model: its adapter keys), as EMA weights are."""
        return [TensorSpec(self._weight_key.get(n, n), self._full_shape(p), torch.float32) for n, p in self._trainable()]

    def _optimizer_specs(self) -> list[TensorSpec]:
        specs = []
        keys = self._state_keys()
        by_name = self._by_name
        for g, names in enumerate(self._groups):
            tensor_keys, scalar_keys = keys[g]
            state = self._group_state(g)
            for name in names:
                shape = self._full_shape(by_name[name])
                specs += [TensorSpec(optimizer_key(name, k), shape, torch.float32) for k in tensor_keys]
                specs += [TensorSpec(optimizer_key(name, k), (), encode_scalar(state[k])[0].dtype) for k in scalar_keys]
        return specs

    def param_group_names(self) -> list[list[str]]:
        """The parameter names of each of the base optimizer's param groups (DeepSpeed drops empty ones). Local."""
        return [list(names) for names in self._groups]

    def optimizer_metadata(self) -> dict:
        """Param groups and scalar types (the state tensors are read from DeepSpeed's fragments, not encoded)."""
        encoder = OptimizerStateEncoder()
        for g, names in enumerate(self._groups):
            encoder.add_group(self.base.param_groups[g], names)
            state = self._group_state(g)
            for key in self._state_keys()[g][1]:  # per-group scalars, written once per parameter
                for name in names:
                    encoder.add(name, key, state[key])
        fp16 = {LOSS_SCALER: self._loss_scaler_state()} if self.ds.fp16_enabled() else {}
        return {**encoder.metadata(), **fp16}

    def _loss_scaler_state(self) -> dict:
        """fp16: the loss scaler's changing state and the engine's skipped-step count (JSON scalars)."""
        scaler = self.zero.loss_scaler
        state = {k: getattr(scaler, k) for k in SCALER_FIELDS if hasattr(scaler, k)}
        return {**state, "dynamic": bool(getattr(scaler, "dynamic", False)), "skipped_steps": self.ds.skipped_steps}

    def _restore_loss_scaler(self, saved: dict | None) -> None:
        """fp16: put the saved loss scaler's state back (DeepSpeed's own resume replaces the scaler object the same
        way); without one (the checkpoint was not saved in fp16), the scaler starts as configured, said once."""
        if not self.ds.fp16_enabled():
            return
        if saved is None:
            if dist.rank() == 0:
                logger.warning("The checkpoint holds no fp16 loss-scaler state (it was not saved by a DeepSpeed fp16 "
                               "run): the loss scale starts again at its configured initial value.")
            return
        scaler = self.zero.loss_scaler
        for key in SCALER_FIELDS:
            if key in saved and hasattr(scaler, key):
                setattr(scaler, key, saved[key])
        self.ds.skipped_steps = int(saved.get("skipped_steps", self.ds.skipped_steps))

    # ---- where each tensor comes from ------------------------------------------------------------------
    def _source(self, component: str, name: str) -> tuple:
        """("lp", param) | ("buffer", tensor) | ("hp", param, state key or None) | ("scalar", group, key)."""
        return self._held(component)[1](name)

    def _weights_source(self, name: str) -> tuple:
        if name not in self._weight_param:
            return ("buffer", self._buffers()[name])
        p = self._by_name[self._weight_param[name]]
        return ("hp", p, None) if self.master_policy == "as_model" and p.requires_grad else ("lp", p)

    def _master_source(self, name: str) -> tuple:
        return ("hp", self._by_name[self._weight_param.get(name, name)], None)

    def _optimizer_source(self, name: str) -> tuple:
        by_name = self._by_name
        param_name, key = split_optimizer_key(name)
        g = self._group_index[param_name]
        if key in self._state_keys()[g][1]:
            return ("scalar", g, key)
        return ("hp", by_name[param_name], key)

    # ---- the closed form of the partition (issue 57) -----------------------------------------------------------
    def partition_rule(self, component: str, names: list[str] | None = None) -> tuple[dict[str, Strided] | None, str]:
        """(the closed form of `fragments(component)` from DeepSpeed's partition rule and the shapes, a reason), or
        (None, why not). ZeRO-3: every parameter split in ceil(numel / N) elements per rank. ZeRO-1/2: each param
        group's flat buffer (its trainable parameters in order) padded to a multiple of 2N elements
        (`nccl_start_alignment_factor` x N) and split in N equal partitions. None where the layout does not follow
        the world size alone: AutoTP, MiCS (its shard groups), expert parameters (their own data-parallel groups).
        Local: shapes and group membership only (`names`: the component's tensors, where the caller has them)."""
        why = self._no_rule()
        if why:
            return None, why
        out = {}
        for name in [s.name for s in self.specs(component)] if names is None else names:
            source = self._source(component, name)
            if source[0] == "hp" or (source[0] == "lp" and self.stage == 3):
                out[name] = self._strided(self._name_of[id(source[1])])
        return {n: s for n, s in out.items() if s.numel}, f"ZeRO-{self.stage}"

    def parameter_rule(self) -> tuple[dict[str, Strided] | None, str]:
        """`partition_rule` of `parameter_fragments` (an EMA's averages follow it). Local."""
        why = self._no_rule()
        if why:
            return None, why
        return {self._weight_key.get(n, n): s for n, _ in self._trainable() if (s := self._strided(n)).numel}, \
            f"ZeRO-{self.stage}"

    def _no_rule(self) -> str:
        if self.tp_size > 1:
            return f"AutoTP at {self.tp_size} (tensor parallel)"
        if "MiCS" in type(self.zero).__name__:
            return "MiCS (shard groups smaller than the world)"
        if any(getattr(p, "allreduce", True) is False for _, p in self._named):
            return "expert parameters (expert-parallel groups)"
        return ""

    def _strided(self, param_name: str) -> Strided:
        """The rule's pieces of parameter `param_name` over the current world."""
        world, numel = dist.world_size(), math.prod(self._full_shape(self._by_name[param_name]))
        if self.stage == 3:
            return Strided(numel, max(1, -(-numel // world)))
        if self._flat is None:
            self._flat = {}
            for names in self._groups:
                at, numels = 0, [math.prod(self._full_shape(self._by_name[n])) for n in names]
                padded = -(-sum(numels) // (2 * world)) * 2 * world
                for n, count in zip(names, numels):
                    self._flat[n] = (at, max(1, padded // world))
                    at += count
        at, size = self._flat[param_name]
        return Strided(numel, size, at)

    def confirm_rule(self) -> None:
        """The save checked on every rank that the rule's pieces are the ones held (`saving.plan_save`): owners are
        then computed from the rule, with no gather of fragment sizes."""
        self._rule_confirmed = True

    def _fragment_sizes(self) -> dict[str, list[int]]:
        """Per trainable parameter, the numel of its fp32 fragment on each rank (ZeRO-1/2).
        Collective on first call: all ranks must call it."""
        if self._frag_sizes is None:
            local = {n: p._hp_mapping.lp_fragment_address.numel for n, p in self._trainable()
                     if getattr(p, "_hp_mapping", None) is not None}
            everyone = dist.all_gather_object(local)
            self._frag_sizes = {n: [r.get(n, 0) for r in everyone] for n, _ in self._trainable()}
        return self._frag_sizes

    def _fragment_owner(self, param_name: str) -> int:
        if self._rule_confirmed:
            return self._strided(param_name).majority()
        sizes = self._fragment_sizes()[param_name]
        return max(range(len(sizes)), key=lambda r: (sizes[r], -r))

    def _is_local_to_owner(self, source: tuple) -> bool:
        kind = source[0]
        if kind in ("buffer", "scalar"):
            return True
        if self.stage == 3 or id(source[1]) in self._split:
            return False
        if kind == "lp":
            return True
        p = source[1]
        if self._rule_confirmed:
            return len(self._strided(self._name_of[id(p)])) <= 1
        return max(self._fragment_sizes()[self._name_of[id(p)]]) == p.numel()

    # ---- planning hints and exchange ----------------------------------------------------------------------
    def preferred_owners(self, component: str) -> dict[str, int]:
        """ZeRO-1/2: a tensor read from fp32 fragments is written by the rank holding most of it (usually all).
        Tensors absent from the result may be written by any rank. Collective: all ranks must call it."""
        if self.stage == 3:
            return {}
        if not self._rule_confirmed:
            self._fragment_sizes()
        owners = {}
        for spec in self.specs(component):
            source = self._source(component, spec.name)
            if source[0] == "hp":
                owners[spec.name] = self._fragment_owner(self._name_of[id(source[1])])
            elif source[0] == "scalar":
                owners[spec.name] = self._fragment_owner(split_optimizer_key(spec.name)[0])
        return owners

    def exchange(self, component: str, names: Sequence[str], owner: int) -> None:
        """Assemble on `owner` the tensors of one file that are not whole there. Collective: all ranks must call
        it, in the same order (the loop order is the order of the collectives)."""
        for name in names:
            source = self._source(component, name)
            if self._is_local_to_owner(source):
                continue
            value = self._assemble(source)
            if dist.rank() == owner:
                self._cache[(component, name)] = value.detach().to("cpu", copy=True)

    def _assemble(self, source: tuple) -> torch.Tensor:
        """The full tensor of `source`. Collective: all ranks must call it (ZeRO's data-parallel all-reduce, then,
        for an AutoTP slice, an all-gather over the tensor-parallel group)."""
        import deepspeed
        from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

        p = source[1]
        if source[0] == "lp":
            with deepspeed.zero.GatheredParameters([p]):
                local = p.data.clone()
        else:
            local = safe_get_full_fp32_param(p) if source[2] is None else safe_get_full_optimizer_state(p, source[2])
        split = self._split.get(id(p))
        return local if split is None else gather_split(local, split, groups.get_tensor_model_parallel_group())

    # ---- EngineAdapter: local tensors ---------------------------------------------------------------------
    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors this rank writes (after `exchange`); local reads only."""
        return {n: self._local_tensor(component, n) for n in names}

    def _local_tensor(self, component: str, name: str) -> torch.Tensor:
        cached = self._cache.pop((component, name), None)
        if cached is not None:
            return cached
        source = self._source(component, name)
        kind = source[0]
        if kind == "buffer":
            return source[1]
        if kind == "lp":
            return source[1].data
        if kind == "scalar":
            return encode_scalar(self._group_state(source[1])[source[2]])[0]
        _, p, key = source
        return p._hp_mapping.get_hp_fragment(key).view(p.shape)

    def fragments(self, component: str, names: Sequence[str] | None = None) -> dict[str, Fragment]:
        """This rank's piece of every tensor of `component` that DeepSpeed splits over the ranks: the fp32
        fragments of ZeRO-1/2 (master weights, optimizer state) and the partitions of ZeRO-3 (weights too); views
        of the live flat buffers. Buffers, scalars and ZeRO-1/2's whole weights are not listed. Local only."""
        names = [s.name for s in self.specs(component)] if names is None else names
        out = {}
        for name in names:
            source = self._source(component, name)
            if source[0] == "hp" or (source[0] == "lp" and self.stage == 3):
                piece = self._shared_piece(source)
                if piece is not None:
                    out[name] = piece
        return out

    def _shared_piece(self, source: tuple) -> Fragment | None:
        """This rank's piece as a range of the full tensor. Under AutoTP: a row slice's fragment is shifted to its
        rows, a column slice has no single range (None: it is gathered), and the tensor-parallel ranks' copies of a
        replicated parameter count once (TP rank 0's)."""
        piece = self._piece(source)
        split = self._split.get(id(source[1]))
        if split is not None:
            return split.globalize(piece)
        if self._tp_index != 0:
            return Fragment(piece.shape, 0, piece.values[:0])
        return piece

    def _piece(self, source: tuple) -> Fragment:
        p, key = source[1], (source[2] if source[0] == "hp" else None)
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            _, start, count = self._partition(p)
            flat = (p.ds_tensor.data if source[0] == "lp" else safe_get_local_fp32_param(p) if key is None
                    else safe_get_local_optimizer_state(p, key))
            return Fragment(tuple(p.ds_shape), start, flat.reshape(-1)[:count])
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return Fragment(tuple(p.shape), 0, torch.empty(0, dtype=torch.float32))
        return Fragment(tuple(p.shape), mapping.lp_fragment_address.start, mapping.get_hp_fragment(key).reshape(-1))

    def config_files(self) -> dict[str, bytes]:
        return model_config_files(self.module)

    def parameter_fragments(self) -> dict:
        """This rank's fp32 fragment (ZeRO-1/2) or partition (ZeRO-3) of every trainable parameter, as
        `Fragment`s keyed like the weights files (an empty one where it holds none, so every rank lists every
        parameter). Local only."""
        if self.tp_size > 1:
            raise UnsupportedCheckpointError(
                "an EMA of the weights is not supported with DeepSpeed AutoTP yet (its column-sharded parameters "
                "have no single range per rank). Drop the word 'ema', or train without autotp_size.")
        return self._local_pieces()

    def _local_pieces(self) -> dict:
        return {self._weight_key.get(name, name): self._piece(("hp", p, None)) for name, p in self._trainable()}

    def master_fragments(self):
        """(name, this rank's fp32 master elements, the bf16 weight elements at the same flat positions) of every
        trainable parameter that has a master copy and a fragment here (what `saving.residual_census` checks), each
        element once over all ranks (under AutoTP a replicated parameter's copies on TP ranks other than 0 are left
        out, as `fragments` leaves them out). Local reads only."""
        if not self.has_master:
            return
        for name, frag in self._local_pieces().items():
            n = frag.values.numel()
            p = self._by_name[self._weight_param.get(name, name)]
            if n and (self._tp_index == 0 or id(p) in self._split):
                lp = p.ds_tensor.data.reshape(-1)[:n] if self.stage == 3 else p.data.reshape(-1)[frag.start:frag.start + n]
                yield name, frag.values, lp

    # ---- load: each rank reads only the rows it holds ------------------------------------------------------
    def load(self, sources) -> None:
        """Load from `sources` (a `load.LoadSources`). Local reads and writes only (no collectives)."""
        model, master, optimizer = sources.get(MODEL), sources.get(MASTER), sources.get(OPTIMIZER)
        model_specs = model.specs()
        missing = sorted((set(self._weight_param) | set(self._buffers())) - set(model_specs))
        if missing:
            raise UnsupportedCheckpointError(f"the checkpoint has no weights for {count_and_first(missing)}; "
                                             "build the same "
                                             "architecture as the run that saved it.")
        if self.stage == 3:
            self._release_gathered()
        # master weights (or the model weights standing in for them) are keyed like the weights files
        for name, p in self._named:  # a PEFT model's base weights are not in the checkpoint: they stay as built
            if name in self._weight_key:
                fp32 = p.dtype == torch.float32 and p.requires_grad
                self._load_lp(master if fp32 else model, self._weight_key[name], p)
        with torch.no_grad():
            for name, buf in self._buffers().items():
                buf.copy_(model.get(name))
        for name, p in self._trainable():  # the fp32 partitions are separate copies even in fp32 training
            self._load_hp(master, self._weight_key.get(name, name), p, None)
        if optimizer is not None:
            self._load_optimizer(optimizer)  # a resume: the engine's counters follow the checkpoint
            self.ds.global_steps = sources.global_step
            self.ds.global_samples = sources.global_step * self.ds.train_batch_size()

    def _release_gathered(self) -> None:
        """ZeRO-3: drop the full copies of parameters that are gathered now (small ones below
        `stage3_param_persistence_threshold` stay gathered between steps), as DeepSpeed's own `partition` does; the
        next forward gathers them again from the partitions this load writes. Local only."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        gathered = [p for _, p in self._named if p.ds_status == ZeroParamStatus.AVAILABLE]
        if gathered:
            gathered[0].partition(param_list=gathered, has_been_updated=False)

    def _partition(self, p) -> tuple[int, int, int]:
        """ZeRO-3: (padded partition size, first element, element count) of this rank's partition of `p`."""
        size = p.ds_tensor.numel()
        start = dist.rank() * size
        return size, start, max(0, min(size, p.ds_numel - start))

    def _read_range(self, reader: TensorReader, name: str, p, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of this rank's flattened `p` (its AutoTP slice, if sharded)."""
        split = self._split.get(id(p))
        if split is not None:
            return read_split_range(reader, name, split, start, count)
        return read_flat_range(reader, name, self._full_shape(p), start, count)

    def _load_lp(self, reader: TensorReader, name: str, p) -> None:
        with torch.no_grad():
            if self.stage != 3:
                p.data.copy_(self._read_range(reader, name, p, 0, p.numel()).view(p.shape) if id(p) in self._split
                             else reader.get(name))
                return
            _, start, count = self._partition(p)
            if count:
                p.ds_tensor.data[:count].copy_(read_flat_range(reader, name, p.ds_shape, start, count))

    def _load_hp(self, reader: TensorReader, key_in_file: str, p, key: str | None) -> None:
        """Write this rank's fp32 fragment/partition of `p` (master weights when key is None, else state)."""
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        shape = self._full_shape(p)
        if self.stage != 3:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                return
            address = mapping.lp_fragment_address
            values = self._read_range(reader, key_in_file, p, address.start, address.numel)
            with torch.no_grad():
                mapping.get_hp_fragment(key).copy_(values)
            return
        size, start, count = self._partition(p)
        padded = read_flat_range(reader, key_in_file, shape, start, count).float() if count else None
        if count < size:  # only the last rank's partition has padding (or a rank past the end: all of it)
            padded = torch.cat([t for t in (padded, torch.zeros(size - count)) if t is not None])
        if key is None:
            safe_set_local_fp32_param(p, padded)
        else:
            safe_set_local_optimizer_state(p, padded, key)

    def _load_optimizer(self, reader: TensorReader) -> None:
        decoder = OptimizerStateDecoder(reader)
        self._restore_loss_scaler(reader.metadata.get(LOSS_SCALER))
        specs = reader.specs()
        for g, hparams in enumerate(decoder.group_hparams(self._groups)):
            self.base.param_groups[g].update(hparams or {})
            tensor_keys, scalar_keys = _keys_of_group(self._groups[g], specs, self._by_name, self._full_shape)
            self._init_group_state(g, tensor_keys)
            for key in scalar_keys:
                value = decoder.value(optimizer_key(self._groups[g][0], key))
                for flat in self._group_flats(g):
                    self.base.state[flat][key] = value.clone() if torch.is_tensor(value) else value
            for name in self._groups[g]:
                for key in tensor_keys:
                    self._load_hp(reader, optimizer_key(name, key), self._by_name[name], key)

    def _init_group_state(self, g: int, tensor_keys: list[str]) -> None:
        """Create the state tensors a fresh (never stepped) optimizer lacks, and link DeepSpeed's fragments."""
        self._keys = None
        for flat in self._group_flats(g):
            state = self.base.state[flat]
            for key in tensor_keys:
                if key not in state:
                    state[key] = torch.zeros_like(flat)
        if self.stage != 3:
            self._link_fragments(g)

    def _link_fragments(self, g: int) -> None:
        """(Re)link each parameter's fragment to the optimizer state of group `g` with DeepSpeed's own
        `lazy_init_hp_params_optimizer_state`. DeepSpeed 0.19 links state once, after the first group's first
        step, so the fragments of later groups can miss keys the optimizer does have."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        flat = self._group_flats(g)[0]
        keys = {k for k, v in self.base.state.get(flat, {}).items() if torch.is_tensor(v) and v.shape == flat.shape}
        mappings = [m for n in self._groups[g] if (m := getattr(self._by_name[n], "_hp_mapping", None)) is not None]
        if keys and any(m.optim_fragment is None or not keys <= set(m.optim_fragment) for m in mappings):
            lazy_init_hp_params_optimizer_state([self._by_name[n] for n in self._groups[g]], flat, self.base.state)


def _keys_of_group(names, specs, by_name, full_shape) -> tuple[list[str], list[str]]:
    """State keys stored for a group's parameters: tensor keys shaped like the parameter, and 0-d scalars."""
    tensor_keys, scalar_keys = set(), set()
    for key, (shape, _) in specs.items():
        param_name, state = split_optimizer_key(key)
        if param_name not in names:
            continue
        if tuple(shape) == tuple(full_shape(by_name[param_name])) and len(shape) > 0:
            tensor_keys.add(state)
        elif len(shape) == 0:
            scalar_keys.add(state)
        else:
            raise UnsupportedCheckpointError(
                f"optimizer state {key!r} has shape {tuple(shape)}, neither the parameter's shape nor a scalar; "
                "DeepSpeed keeps optimizer state per element (an optimizer with factored state, such as "
                "Adafactor, cannot move into DeepSpeed).")
    return sorted(tensor_keys), sorted(scalar_keys)

