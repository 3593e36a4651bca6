"""Models whose parameters are sharded tensors: FSDP2 (DTensor), transformers' tensor parallelism (DTensor, alone
or with FSDP2: `from_pretrained(..., tp_plan="auto")` or a `DistributedConfig`), and FSDP1 (FlatParameter,
ShardedTensor state dicts).

Built on `torch.distributed.checkpoint.state_dict`: `get_model_state_dict` / `get_optimizer_state_dict` with
`StateDictOptions(full_state_dict=False)` give name-keyed sharded tensors (DTensor for FSDP2, ShardedTensor for
FSDP1) without any flat-parameter arithmetic. Save assembles each tensor on the rank that writes it
(`DTensor.full_tensor()` / `ShardedTensor.gather`); load copies, into each local shard, only the slice of the
file that shard covers (DCP's chunk metadata: `DTensor.__create_chunk_list__`, `ShardedTensor.local_shards()`),
then hands the state dicts back with `set_model_state_dict` / `set_optimizer_state_dict`. Tensor parallelism's
colwise (Shard(0)) and rowwise (Shard(1)) layers are one more DTensor layout to these helpers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .. import dist
from ..format.components import MASTER, MODEL, OPTIMIZER, Component, saved_by
from ..errors import UnsupportedCheckpointError, count_and_first
from .hf_model import naming_policy, model_config_files
from ..format.names import optimizer_key, split_optimizer_key
from ..format.optim_state import OptimizerStateDecoder, OptimizerStateEncoder, in_group_order
from ..format.planning import Strided, TensorSpec
from .base import Fragment, component_source


def _is_sharded(t) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return isinstance(t, (DTensor, ShardedTensor))


def _global_shape(t) -> tuple[int, ...]:
    return tuple(t.size()) if _is_sharded(t) else tuple(t.shape)


def local_chunks(t) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """(global offsets, sizes, local tensor) of each piece of `t` this rank holds."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()  # DCP's checkpointable protocol
        local = t.to_local()
        return [(tuple(c.offsets), tuple(c.sizes), local) for c in chunks if local.numel() or not c.sizes]
    if isinstance(t, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor) for s in t.local_shards()]
    return [(tuple(0 for _ in t.shape), tuple(t.shape), t)]


def row_fragment(t) -> Fragment | None:
    """This rank's part of `t` as a `Fragment` when `t` is sharded by blocks of whole rows (FSDP2's Shard(0) on
    its mesh, FSDP1's row-sharded ShardedTensor): one contiguous range of its flattened elements (empty where this
    rank holds no row). None for a tensor that is not sharded, or sharded some other way. Local only."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not _is_sharded(t) or t.dim() == 0:
        return None
    shape = _global_shape(t)
    if isinstance(t, ShardedTensor):
        pieces = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor) for s in t.local_shards()]
    else:
        local = t.to_local()
        pieces = [(tuple(c.offsets), tuple(c.sizes), local) for c in t.__create_chunk_list__()]
    pieces = [p for p in pieces if p[2].numel()]
    if not pieces:
        return Fragment(shape, 0, torch.empty(0, dtype=t.dtype))
    if len(pieces) > 1:
        return None
    offsets, sizes, local = pieces[0]
    if tuple(sizes[1:]) != shape[1:] or any(offsets[1:]):
        return None
    return Fragment(shape, offsets[0] * int(torch.Size(shape[1:]).numel()), local.detach().reshape(-1))


def _full_on(t, owner: int) -> torch.Tensor | None:
    """The whole tensor on rank `owner` (None elsewhere). Collective: all ranks must call it."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import Shard

    if isinstance(t, ShardedTensor):
        out = torch.empty(tuple(t.size()), dtype=t.dtype) if dist.rank() == owner else None
        t.gather(dst=owner, out=out)
        return out
    mesh = t.device_mesh
    if (mesh.ndim == 1 and len(t.placements) == 1 and type(t.placements[0]) is Shard
            and mesh.mesh.flatten().tolist() == list(range(dist.world_size()))):
        return _gather_dim(t, owner, t.placements[0].dim)  # FSDP2's rows, TP's rows or columns over every rank
    full = t.full_tensor()  # other layouts (2-D meshes, replicas): DTensor's own all-gather
    return full if dist.rank() == owner else None


def _gather_dim(t, owner: int, dim: int) -> torch.Tensor | None:
    """Gather a DTensor sharded along `dim` over all ranks in rank order (torch.chunk layout, as FSDP2 and tensor
    parallelism shard) to `owner` only: each rank pads its piece to the largest chunk so gloo's equal-size gather
    applies. Collective: all ranks must call it."""
    import torch.distributed as tdist

    size, world = t.shape[dim], dist.world_size()
    local = t.to_local()
    shape = list(t.shape)
    shape[dim] = -(-size // world)
    padded = torch.zeros(shape, dtype=local.dtype)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    pieces = [torch.empty_like(padded) for _ in range(world)] if dist.rank() == owner else None
    tdist.gather(padded, pieces, dst=owner, group=dist.cpu_group())  # host tensors: gloo beside an NCCL group
    return torch.cat(pieces, dim=dim).narrow(dim, 0, size) if pieces is not None else None


def device_mesh_of(model: nn.Module) -> dict[str, int]:
    """Name -> size of each dimension of the largest device mesh the model's DTensor parameters live on (`{}` when
    it has none): {"tp": 2} for tensor parallelism at 2, {"fsdp": 2, "tp": 2} for FSDP2 x TP."""
    from torch.distributed.tensor import DTensor

    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    if not meshes:
        return {}
    mesh = max(meshes, key=lambda m: m.ndim)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {name: int(size) for name, size in zip(names, mesh.shape)}


class FSDPEngine:
    """Adapter for a model wrapped by FSDP2 (`fully_shard`) or FSDP1 (`FullyShardedDataParallel`), or sharded at
    load time by transformers' tensor parallelism (`kind="tensor_parallel"`: DTensor parameters on a `tp` mesh
    dimension, with an `fsdp` one under FSDP2 x TP; the norms stay whole, replicated on every rank)."""

    #: The weights are written into the shards by position (the load checks their shapes first).
    loads_by_module = False

    def __init__(self, model: nn.Module, optimizer, kind: str = "fsdp"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model = model
        self.module = _unwrap(model)
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.version = 2 if any(type(p).__name__ == "DTensor" for p in model.parameters()) else 1
        self.kind = kind
        self.engine = f"fsdp{self.version}" if kind == "fsdp" else kind
        self._options = StateDictOptions(full_state_dict=False)
        self.naming = naming_policy(_unwrap(model))
        if self.version == 1 and self.naming.adapter_map is not None:
            raise UnsupportedCheckpointError(
                "unified checkpoints of PEFT/LoRA models under FSDP1 are not supported (FSDP1 wraps the adapter "
                "layers in FSDP units of their own, whose state dicts cannot be read before the first step). Use "
                "FSDP2: fsdp_config={'version': 2} (or fsdp_version: 2 in the accelerate config).")
        # a PEFT model's checkpoint holds its adapter only: the base weights stay as the model was built
        self._live_options = StateDictOptions(full_state_dict=False, strict=self.naming.adapter_map is None)
        self._model_sd: dict | None = None
        self._encoded: OptimizerStateEncoder | None = None
        self._sources = {MODEL.name: self._model_state, OPTIMIZER.name: self._optim_tensors}
        self._optim_sd: dict | None = None
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    # ---- sharded state dicts (names as save_pretrained keeps them) ---------------------------------------
    def _model_state(self) -> dict:
        """Collective on first call (FSDP1 state dict hooks): all ranks must call it."""
        if self._model_sd is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            self._model_sd = self.naming.saved(get_model_state_dict(self.model, options=self._options))
        return self._model_sd

    def _optim_state(self) -> dict:
        """Collective on first call: all ranks must call it."""
        if self._optim_sd is None:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            raw = get_optimizer_state_dict(self.model, self.optimizer, options=self._options)
            self._optim_sd = {
                "state": {self.naming.stored_key(k): v for k, v in raw["state"].items()},
                "param_groups": [{**g, "params": [self.naming.stored_key(p) for p in g["params"]]}
                                 for g in raw["param_groups"]],
            }
        return self._optim_sd

    def _optim_encoded(self) -> OptimizerStateEncoder:
        """The optimizer component: sharded or whole state tensors, scalars as 0-d tensors, and its metadata.
        Collective on first call: all ranks must call it."""
        if self._encoded is None:
            osd, encoder = self._optim_state(), OptimizerStateEncoder()
            for name, key, value in in_group_order(osd["state"], [g["params"] for g in osd["param_groups"]]):
                encoder.add(name, key, value, stored=value if _is_sharded(value) else None)
            for group in osd["param_groups"]:
                encoder.add_group(group, group["params"])
            self._encoded = encoder
        return self._encoded

    def _optim_tensors(self) -> dict[str, object]:
        return self._optim_encoded().entries

    # ---- EngineAdapter: description --------------------------------------------------------------------
    def saved_by(self) -> dict:
        mesh = device_mesh_of(self.model)
        fsdp = self.kind == "fsdp" or mesh.get("fsdp", 1) > 1
        return saved_by(self.kind, dist.world_size(), [t.dtype for t in self._model_state().values()],
                        fsdp_version=self.version if fsdp else None, **({"device_mesh": mesh} if mesh else {}))

    def needs_fp32_master(self) -> bool:
        return any(p.requires_grad and p.dtype == torch.float32 for p in self.model.parameters())

    def components(self) -> list[Component]:
        return [self.naming.weights, OPTIMIZER]

    def _source(self, component: str) -> dict:
        """Name -> tensor (sharded or whole) or Python scalar of `component`. Collective on first call of each
        component: all ranks must call it."""
        return component_source(self._sources, component, self.engine)()

    def specs(self, component: str) -> list[TensorSpec]:
        return [TensorSpec(key, _global_shape(t), t.dtype) for key, t in self._source(component).items()]

    def param_group_names(self) -> list[list[str]]:
        """The parameter names of each of the optimizer's param groups, in its order. Collective on first use of
        the optimizer state dict: all ranks must call it."""
        return [list(g["params"]) for g in self._optim_state()["param_groups"]]

    def optimizer_metadata(self) -> dict:
        return self._optim_encoded().metadata()

    def preferred_owners(self, component: str) -> dict[str, int]:
        return {}

    def exchange(self, component: str, names: Sequence[str], owner: int) -> None:
        """Assemble on `owner` every sharded tensor of one file. Collective: all ranks must call it, in the same
        order (the loop order is the order of the collectives)."""
        source = self._source(component)
        for name in names:
            if _is_sharded(source[name]):
                full = _full_on(source[name], owner)
                if full is not None:
                    self._cache[(component, name)] = full.detach().cpu()

    def fragments(self, component: str, names: Sequence[str] | None = None) -> dict[str, Fragment]:
        """This rank's rows of every tensor of `component` sharded by whole rows (`row_fragment`). Local only."""
        source = self._source(component)
        out = {}
        for name in source if names is None else names:
            fragment = row_fragment(source[name]) if torch.is_tensor(source[name]) else None
            if fragment is not None:
                out[name] = fragment
        return out

    def partition_rule(self, component: str, names=None) -> tuple[dict[str, Strided] | None, str]:
        """(the closed form of `fragments(component)`: FSDP2's Shard(0) on a 1-D mesh over every rank, ceil(dim0 /
        N) rows per rank, torch.chunk's split; a reason) or (None, why not: FSDP1, HSDP or a tensor-parallel mesh,
        whose layout does not follow the world size alone). Local: reads placements and shapes only."""
        return self._rows_rule((name, t) for name, t in self._source(component).items() if _is_sharded(t))

    def parameter_rule(self) -> tuple[dict[str, Strided] | None, str]:
        """`partition_rule` of `parameter_fragments` (an EMA's averages follow it). Local."""
        return self._rows_rule((self.naming.weight_key(n) or self.naming.stored_key(n), p)
                               for n, p in self.model.named_parameters() if p.requires_grad)

    def _rows_rule(self, tensors) -> tuple[dict[str, Strided] | None, str]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Shard

        if self.kind != "fsdp" or self.version != 2:
            return None, f"{self.engine} (its shards do not follow the world size alone)"
        world, out = dist.world_size(), {}
        for name, t in tensors:
            if not (isinstance(t, DTensor) and t.device_mesh.ndim == 1 and t.device_mesh.size() == world
                    and tuple(t.placements) == (Shard(0),) and t.dim() > 0):
                return None, f"{name} is not sharded by rows over all {world} ranks (HSDP or another mesh)"
            shape = _global_shape(t)
            rows, numel = shape[0], math.prod(shape)
            if numel:
                out[name] = Strided(numel, -(-rows // world) * (numel // rows))
        return out, "FSDP2 Shard(0)"

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors this rank writes (after `exchange`); local reads only."""
        source = self._source(component)
        out = {}
        for name in names:
            cached = self._cache.pop((component, name), None)
            out[name] = cached if cached is not None else source[name]
        return out

    def parameter_fragments(self) -> dict:
        """This rank's rows of every trainable FSDP2 parameter (its DTensor's local shard, `row_fragment`), as
        `Fragment`s (an empty one where it holds no row). Local only."""
        if self.version != 2 or self.kind != "fsdp":
            raise UnsupportedCheckpointError(
                "an EMA of the weights needs FSDP2 (fsdp_version 2) among the sharded engines; "
                + ("tensor parallelism's column-sharded and replicated parameters are not supported yet."
                   if self.kind != "fsdp" else "FSDP1's flat parameters are not supported.")
                + " Use FSDP2, DeepSpeed or DDP, or drop the word 'ema'.")
        out = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                out[self.naming.weight_key(name) or self.naming.stored_key(name)] = row_fragment(p)
        return out

    def config_files(self) -> dict[str, bytes]:
        return model_config_files(_unwrap(self.model))

    # ---- load: each rank reads the slices its shards cover ------------------------------------------------
    def load(self, sources) -> None:
        """Collective (state-dict hooks and optimizer-state initialisation): all ranks must call it."""
        from torch.distributed.checkpoint.state_dict import (_init_optim_state, set_model_state_dict,
                                                            set_optimizer_state_dict)

        model, master, optimizer = sources.get(MODEL), sources.get(MASTER), sources.get(OPTIMIZER)
        model_sd = self._model_state()
        missing = sorted(set(model_sd) - set(model.keys()))
        if missing:
            raise UnsupportedCheckpointError(f"the checkpoint has no weights for {count_and_first(missing)}; "
                                             "build the same "
                                             "architecture as the run that saved it.")
        trainable = {self.naming.stored_key(n) for n, p in self.model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            for name, target in model_sd.items():
                _fill(target, master if name in trainable and name in master else model, name)
        set_model_state_dict(self.model, self.naming.to_live(model_sd), options=self._live_options)
        if optimizer is None:
            return
        _init_optim_state(self.optimizer)  # DCP's own: creates the state tensors a fresh optimizer lacks
        self._optim_sd, self._encoded = None, None
        osd = self._optim_state()
        self._fill_optimizer(osd, optimizer)
        set_optimizer_state_dict(self.model, self.optimizer, osd, options=self._options)

    def _fill_optimizer(self, osd: dict, reader) -> None:
        decoder = OptimizerStateDecoder(reader)
        current = [g["params"] for g in osd["param_groups"]]
        for group, hparams in zip(osd["param_groups"], decoder.group_hparams(current)):
            group.update(hparams or {})
        wanted = set()
        for key in decoder.keys():
            name, state = split_optimizer_key(key)
            if name not in osd["state"]:
                raise UnsupportedCheckpointError(f"optimizer state {key!r} belongs to no parameter of this model.")
            wanted.add(key)
            current = osd["state"][name].get(state)
            if decoder.kind(key) is None and current is not None and (_is_sharded(current) or current.dim() > 0):
                with torch.no_grad():
                    _fill(current, reader, key)  # only the slices this rank's shards cover
                continue
            value = decoder.value(key)
            osd["state"][name][state] = value.to(current.dtype) if torch.is_tensor(value) and current is not None \
                else value
        stale = sorted(optimizer_key(n, k) for n, per in osd["state"].items() for k in per
                       if optimizer_key(n, k) not in wanted)
        if stale:
            raise UnsupportedCheckpointError(
                f"the checkpoint has no optimizer state for {count_and_first(stale, 'key')} that this optimizer "
                "keeps; build the same optimizer as the run that saved it.")


def _fill(target, reader, name: str) -> None:
    """Copy into each local piece of `target` the slice of `name` it covers."""
    for offsets, sizes, local in local_chunks(target):
        if local.numel() == 0:
            continue
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        values = reader.get_slice(name)[index] if index else reader.get(name)
        local.copy_(values.reshape(local.shape))


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)  # FSDP1 wraps the model; FSDP2 keeps the model's class
    return _unwrap(inner) if isinstance(inner, nn.Module) and type(model).__name__ == "FullyShardedDataParallel" \
        else model

