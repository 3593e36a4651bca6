"""FSDP2 (DTensor parameters) and FSDP1 (FlatParameter, ShardedTensor state dicts).

Built on `torch.distributed.checkpoint.state_dict`: `get_model_state_dict` / `get_optimizer_state_dict` with
`StateDictOptions(full_state_dict=False)` give name-keyed sharded tensors (DTensor for FSDP2, ShardedTensor for
FSDP1) without any flat-parameter arithmetic. Save assembles each tensor on the rank that writes it
(`DTensor.full_tensor()` / `ShardedTensor.gather`); load copies, into each local shard, only the slice of the
file that shard covers (DCP's chunk metadata: `DTensor.__create_chunk_list__`, `ShardedTensor.local_shards()`),
then hands the state dicts back with `set_model_state_dict` / `set_optimizer_state_dict`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import dist
from ..errors import UnsupportedCheckpointError, count_and_first
from ..hf_model import is_peft_model, write_model_configs
from ..names import canonical_name, optimizer_key, split_optimizer_key
from ..optim_state import check_groups_match, decode_hparam, decode_scalar, encode_hparam, encode_scalar
from ..planning import TensorSpec
from ..support import refuse_unsupported
from .base import MODEL, OPTIMIZER


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


def _full_on(t, owner: int) -> torch.Tensor | None:
    """The whole tensor on rank `owner` (None elsewhere). Collective: all ranks must call it."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import Shard

    if isinstance(t, ShardedTensor):
        out = torch.empty(tuple(t.size()), dtype=t.dtype) if dist.rank() == owner else None
        t.gather(dst=owner, out=out)
        return out
    if t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.device_mesh.size() == dist.world_size():
        return _gather_rows(t, owner)
    full = t.full_tensor()  # other layouts: DTensor's own all-gather
    return full if dist.rank() == owner else None


def _gather_rows(t, owner: int) -> torch.Tensor | None:
    """Gather a dim-0-sharded DTensor (torch.chunk layout, as FSDP2 shards) to `owner` only: each rank pads its
    rows to the largest chunk so gloo's equal-size gather applies. Collective: all ranks must call it."""
    import torch.distributed as tdist

    rows, world = t.shape[0], dist.world_size()
    chunk = -(-rows // world)
    local = t.to_local()
    padded = torch.zeros((chunk, *t.shape[1:]), dtype=local.dtype)
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(world)] if dist.rank() == owner else None
    tdist.gather(padded, pieces, dst=owner)
    return torch.cat(pieces)[:rows] if pieces is not None else None


class FSDPEngine:
    """Adapter for a model wrapped by FSDP2 (`fully_shard`) or FSDP1 (`FullyShardedDataParallel`)."""

    def __init__(self, model: nn.Module, optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        refuse_unsupported("fsdp", is_peft_model(_unwrap(model)), fp16=False)
        self.version = 2 if any(type(p).__name__ == "DTensor" for p in model.parameters()) else 1
        self.engine = f"fsdp{self.version}"
        self._options = StateDictOptions(full_state_dict=False)
        self._model_sd: dict | None = None
        self._tied: dict[str, str] = {}
        self._optim_sd: dict | None = None
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    # ---- sharded state dicts (names as save_pretrained keeps them) ---------------------------------------
    def _model_state(self) -> dict:
        """Collective on first call (FSDP1 state dict hooks): all ranks must call it."""
        if self._model_sd is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            tied = dict(getattr(_unwrap(self.model), "all_tied_weights_keys", {}) or {})
            raw = {canonical_name(k): v for k, v in get_model_state_dict(self.model, options=self._options).items()}
            self._model_sd = {k: v for k, v in raw.items() if k not in tied}
            self._tied = {target: source for target, source in tied.items() if target in raw and source in raw}
        return self._model_sd

    def _with_tied(self, model_sd: dict) -> dict:
        """`model_sd` plus the tied names save_pretrained leaves out (they share their source's tensor), which
        `set_model_state_dict` expects."""
        return {**model_sd, **{target: model_sd[source] for target, source in self._tied.items()}}

    def _optim_state(self) -> dict:
        """Collective on first call: all ranks must call it."""
        if self._optim_sd is None:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            raw = get_optimizer_state_dict(self.model, self.optimizer, options=self._options)
            self._optim_sd = {
                "state": {canonical_name(k): v for k, v in raw["state"].items()},
                "param_groups": [{**g, "params": [canonical_name(p) for p in g["params"]]} for g in raw["param_groups"]],
            }
        return self._optim_sd

    def _optim_tensors(self) -> dict[str, object]:
        out = {}
        for name, per_param in self._optim_state()["state"].items():
            for key, value in per_param.items():
                out[optimizer_key(name, key)] = value
        return out

    # ---- EngineAdapter: description --------------------------------------------------------------------
    def saved_by(self) -> dict:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in self._model_state().values()})
        return {"engine": "fsdp", "world_size": dist.world_size(), "zero_stage": None,
                "fsdp_version": self.version, "param_dtypes": dtypes, "master_weights": False}

    def needs_fp32_master(self) -> bool:
        return any(p.requires_grad and p.dtype == torch.float32 for p in self.model.parameters())

    def components(self) -> list[str]:
        return [MODEL, OPTIMIZER]

    def file_stem(self, component: str) -> str:
        return component

    def specs(self, component: str) -> list[TensorSpec]:
        if component == MODEL:
            return [TensorSpec(n, _global_shape(t), t.dtype) for n, t in self._model_state().items()]
        specs = []
        for key, value in self._optim_tensors().items():
            if torch.is_tensor(value) or _is_sharded(value):
                specs.append(TensorSpec(key, _global_shape(value), value.dtype))
            elif value is not None:
                specs.append(TensorSpec(key, (), encode_scalar(value)[0].dtype))
        return specs

    def optimizer_metadata(self) -> dict:
        groups = [{**{k: encode_hparam(k, v) for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in self._optim_state()["param_groups"]]
        state_types = {}
        for key, value in self._optim_tensors().items():
            if value is None:
                state_types[key] = "none"
            elif not (torch.is_tensor(value) or _is_sharded(value)):
                state_types[key] = encode_scalar(value)[1]
        return {"param_groups": groups, "state_types": state_types}

    def preferred_owners(self, component: str) -> dict[str, int]:
        return {}

    def exchange(self, component: str, names: Sequence[str], owner: int) -> None:
        """Assemble on `owner` every sharded tensor of one file. Collective: all ranks must call it, in the same
        order (the loop order is the order of the collectives)."""
        source = self._model_state() if component == MODEL else self._optim_tensors()
        for name in names:
            if _is_sharded(source[name]):
                full = _full_on(source[name], owner)
                if full is not None:
                    self._cache[(component, name)] = full.detach().cpu()

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors this rank writes (after `exchange`); local reads only."""
        source = self._model_state() if component == MODEL else self._optim_tensors()
        out = {}
        for name in names:
            cached = self._cache.pop((component, name), None)
            value = source[name]
            out[name] = cached if cached is not None else (value if torch.is_tensor(value) else encode_scalar(value)[0])
        return out

    def write_configs(self, folder) -> None:
        write_model_configs(_unwrap(self.model), folder)

    # ---- load: each rank reads the slices its shards cover ------------------------------------------------
    def load(self, sources) -> None:
        """Collective (state-dict hooks and optimizer-state initialisation): all ranks must call it."""
        from torch.distributed.checkpoint.state_dict import (_init_optim_state, set_model_state_dict,
                                                            set_optimizer_state_dict)

        model_sd = self._model_state()
        missing = sorted(set(model_sd) - set(sources.model.keys()))
        if missing:
            raise UnsupportedCheckpointError(f"the checkpoint has no weights for {count_and_first(missing)}; "
                                             "build the same "
                                             "architecture as the run that saved it.")
        trainable = {canonical_name(n) for n, p in self.model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            for name, target in model_sd.items():
                reader = sources.master if name in trainable and name in sources.master else sources.model
                _fill(target, reader, name)
        set_model_state_dict(self.model, self._with_tied(model_sd), options=self._options)
        if sources.optimizer is None:
            return
        _init_optim_state(self.optimizer)  # DCP's own: creates the state tensors a fresh optimizer lacks
        self._optim_sd = None
        osd = self._optim_state()
        self._fill_optimizer(osd, sources.optimizer)
        set_optimizer_state_dict(self.model, self.optimizer, osd, options=self._options)

    def _fill_optimizer(self, osd: dict, reader) -> None:
        saved = reader.metadata["param_groups"]
        check_groups_match([g["params"] for g in saved], [g["params"] for g in osd["param_groups"]])
        for group, saved_group in zip(osd["param_groups"], saved):
            group.update({k: decode_hparam(v) for k, v in saved_group.items() if k != "params"})
        state_types = reader.metadata.get("state_types", {})
        wanted = set()
        for key in list(reader.keys()) + [k for k, t in state_types.items() if t == "none"]:
            name, state = split_optimizer_key(key)
            if name not in osd["state"]:
                raise UnsupportedCheckpointError(f"optimizer state {key!r} belongs to no parameter of this model.")
            wanted.add(key)
            current = osd["state"][name].get(state)
            kind = state_types.get(key)
            if kind == "none":
                osd["state"][name][state] = None
            elif kind in ("bool", "int", "float"):
                osd["state"][name][state] = decode_scalar(reader.get(key), kind)
            elif current is not None and (_is_sharded(current) or current.dim() > 0):
                with torch.no_grad():
                    _fill(current, reader, key)
            else:
                osd["state"][name][state] = reader.get(key).to(current.dtype if current is not None else None)
        stale = sorted(optimizer_key(n, k) for n, per in osd["state"].items() for k in per
                       if optimizer_key(n, k) not in wanted)
        if stale:
            raise UnsupportedCheckpointError(f"the checkpoint has no optimizer state for {count_and_first(stale, 'key')}"
                                             " that this optimizer "
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

