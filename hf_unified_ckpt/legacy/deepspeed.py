"""Read a legacy DeepSpeed folder (`checkpoint-N/global_stepN/` ZeRO partitions written by the Trainer) without
a process group, one tensor at a time.

The per-rank `*_optim_states.pt` / `*_model_states.pt` files are opened with `torch.load(mmap=True)`, so only
the pages of the fragments a tensor needs are read. The layout rules are DeepSpeed's own (see its
`utils/zero_to_fp32.py`): ZeRO-1/2 record each parameter's fragment per rank in `param_slice_mappings`;
ZeRO-3 stores every parameter as `ceil(numel / world)` elements per rank, in `param_shapes` order.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import re
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from ..format.components import saved_by
from ..store.pickles import TRUST_OPT_IN, load_pickle, vet_pickle
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..format.optim_state import OptimizerStateEncoder
from .sources import TensorSource

logger = logging.getLogger(__name__)
_RANK_RE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class _ZeroStage(int):
    """Stands in for `deepspeed.runtime.zero.config.ZeroStageEnum` (pickled as `ZeroStageEnum(stage)`)."""

    @property
    def value(self) -> int:
        return int(self)


_ZERO_STAGES = {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3}


def _enum_member(cls, name: str):
    """Stands in for `getattr` in `getattr(ZeroStageEnum, "gradients")` (an enum pickled by member name); any other
    use is refused."""
    if cls is not _ZeroStage or name not in _ZERO_STAGES:
        raise ValueError(f"getattr({cls!r}, {name!r}) is not a ZeRO stage")
    return _ZeroStage(_ZERO_STAGES[name])


class _PickledState:
    """Stands in for a DeepSpeed class pickled as its attributes (`fragment_address`: start, numel; `LossScaler`)."""


#: Every DeepSpeed class the files of a `global_stepN` folder pickle, with a plain stand-in: reading a checkpoint
#: neither imports DeepSpeed (0.5 s, most of what reading the pickles costs) nor runs pickled code (`weights_only`).
#: Checked against the checkpoint code of DeepSpeed's release tags (where each class lives: v0.6.0 to v0.19.5; what
#: `state_dict` of ZeRO-1/2, ZeRO-3 and the bf16 optimizer and the engine's `_save_checkpoint` store: v0.7.0 to
#: v0.19.5) and against the files 0.19.8 writes under ZeRO-2, ZeRO-3 and bf16 (tests/engines/test_legacy_deepspeed.py,
#: `torch.serialization.get_unsafe_globals_in_checkpoint`): `ZeroStageEnum` since 0.7.0 (an int before),
#: `fragment_address` in `runtime.bf16_optimizer` 0.6.2-0.7.2 and in `utils.tensor_fragment` since 0.7.3, the loss
#: scalers in `runtime.fp16.loss_scaler` all along; everything else is tensors and plain values. The Trainer needs
#: DeepSpeed >= 0.9.3. A file that pickles anything else (a custom scheduler's class, say) is refused unless the
#: user trusts the folder (`trust_pickles`).
_STAND_INS = [(_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
              (_PickledState, "deepspeed.utils.tensor_fragment.fragment_address"),
              (_PickledState, "deepspeed.runtime.bf16_optimizer.fragment_address"),
              (_PickledState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
              (_PickledState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
              (_enum_member, "builtins.getattr"), (_enum_member, "__builtin__.getattr")]


def _load(path: Path, trust_pickles: bool = False) -> dict:
    """The pickled dict of a partition file, its tensors memory-mapped. Read with `weights_only` and the stand-ins
    above; a file that needs any other global is refused, naming it and the opt-in. `trust_pickles`: unpickled
    whole, by DeepSpeed's own classes (unpickling imports DeepSpeed), as DeepSpeed itself loads it."""
    return load_pickle(path, f"legacy DeepSpeed file {path}", _STAND_INS, trusted=trust_pickles,
                       opt_in=TRUST_OPT_IN, map_location="cpu", mmap=True)


def _copy_out(pieces: list[torch.Tensor], numel: int, mapped: list[tuple[int, int]],
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `numel` elements of `pieces` copied once into a new tensor (converted to `dtype` as they are
    copied, if given). Pieces that lie in the memory-mapped partition files (`mapped`: address ranges of those
    files' mappings) hand their pages back to the kernel, so that reading a whole checkpoint does not keep every
    page it touched resident (the files are mapped private and never written: a page touched again is read again
    from the file)."""
    out = torch.empty(numel, dtype=dtype or (pieces[0].dtype if pieces else torch.float32))
    at = 0
    for piece in pieces:
        take = min(piece.numel(), numel - at)
        out[at:at + take] = piece[:take]
        at += take
        _release_pages(piece, mapped)
    return out


def _release_pages(t: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """`madvise(MADV_DONTNEED)` over the whole pages `t` lies in, only when they all lie inside one of the file
    mappings `mapped` (never anonymous memory, whose pages that call would zero). Linux only."""
    libc = _libc()
    if libc is None or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    if any(lo <= start and end <= hi for lo, hi in mapped):
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _file_mappings(paths: list[Path]) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `paths` (from /proc/self/maps; empty elsewhere)."""
    wanted = {str(p.resolve()) for p in paths}
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in wanted:
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


_MADV_DONTNEED = 4


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def step_folder(folder: Path) -> Path:
    """The `global_stepN` folder of a checkpoint: the one `latest` names, or the only one."""
    latest = folder / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if "/" in tag or tag in ("", ".", ".."):
            raise CorruptCheckpointError(f"{latest} names {tag!r}, not a folder inside the checkpoint.")
        if (folder / tag).is_dir():
            return folder / tag
    candidates = sorted(p for p in folder.glob("global_step*") if p.is_dir())
    if len(candidates) != 1:
        raise CorruptCheckpointError(f"{folder}: expected one global_step* folder (or a 'latest' file naming it), "
                                     f"found {[p.name for p in candidates]}.")
    return candidates[0]


class LegacyDeepSpeedCheckpoint:
    """Tensors of a legacy DeepSpeed checkpoint by parameter name: model, master weights, optimizer state."""

    def __init__(self, folder: str | Path, trust_pickles: bool = False):
        self.folder = Path(folder)
        self.trust_pickles = trust_pickles
        self.dir = step_folder(self.folder)
        ranked = sorted((int(m.group(1)), p) for p in self.dir.iterdir() if (m := _RANK_RE.match(p.name)))
        if not ranked or [r for r, _ in ranked] != list(range(len(ranked))):
            raise CorruptCheckpointError(f"{self.dir}: the optimizer partitions of ranks 0..N-1 are not all there "
                                         f"(found ranks {[r for r, _ in ranked]}).")
        self.world_size = len(ranked)
        self.optim = [_load(p, trust_pickles)["optimizer_state_dict"] for _, p in ranked]
        stage = int(getattr(self.optim[0]["zero_stage"], "value", self.optim[0]["zero_stage"]))
        self.stage = stage
        model_files = ([self.dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world_size)]
                       if stage == 3 else [self.dir / "mp_rank_00_model_states.pt"])
        missing = [str(p) for p in model_files if not p.is_file()]
        if missing:
            raise CorruptCheckpointError(f"legacy DeepSpeed checkpoint {self.dir} lacks {missing}.")
        self.models = [_load(p, trust_pickles) for p in model_files]
        self._mapped = _file_mappings([p for _, p in ranked] + list(model_files))
        config = self.models[0].get("ds_config") or {}
        if (config.get("fp16") or {}).get("enabled"):
            raise UnsupportedCheckpointError(f"{self.dir} was trained with DeepSpeed fp16; only fp32 and bf16 "
                                             "checkpoints can be read.")
        self.lp_dtype = torch.bfloat16 if (config.get("bf16") or {}).get("enabled") else torch.float32
        self.global_step = int(self.models[0].get("global_steps") or 0)
        self.tp_size = int(self.models[0].get("mp_world_size") or 1)  # DeepSpeed AutoTP: one mp_rank file per slice
        self.param_shapes: list[OrderedDict] = self.models[0]["param_shapes"]
        self.group_of = {n: g for g, shapes in enumerate(self.param_shapes) for n in shapes}
        self.shape_of = {n: tuple(s) for shapes in self.param_shapes for n, s in shapes.items()}
        self._z3_offsets = self._zero3_offsets() if stage == 3 else None

    def vet_for_deepspeed(self) -> None:
        """Before DeepSpeed's own `load_checkpoint` reads this folder (the topology matches): DeepSpeed unpickles
        every file it opens whole, also those this reader never opens (MoE experts' `*expert*_model_states.pt`,
        other mp_rank files), so each `.pt` file of the step folder is checked statically against the stand-ins'
        globals first (nothing unpickled); one that needs any other is refused, naming it and the opt-in. Skipped
        where the user trusts the folder (`trust_pickles`)."""
        if self.trust_pickles:
            return
        allowed = {name for _, name in _STAND_INS}
        for path in sorted(self.dir.glob("*.pt")):
            vet_pickle(path, f"legacy DeepSpeed file {path}", allowed, TRUST_OPT_IN)

    # ---- layout ------------------------------------------------------------------------------------------
    def topology(self) -> dict:
        return {"world_size": self.world_size * self.tp_size, "zero_stage": self.stage,
                "bf16": self.lp_dtype == torch.bfloat16, "autotp_size": self.tp_size}

    def _base_state(self, r: int) -> dict:
        return self.optim[r]["base_optimizer_state"] if self.stage != 3 else self.optim[r]["optimizer_state_dict"]

    def _flats(self, r: int, key: str | None) -> list[torch.Tensor]:
        """Rank r's flat fp32 partitions (per group, or per ZeRO-3 sub-group) of the master weights or a state."""
        if key is None:
            return self.optim[r]["single_partition_of_fp32_groups" if self.stage != 3 else "fp32_flat_groups"]
        state = self._base_state(r)["state"]
        return [state[i][key] for i in sorted(state)]

    def _zero3_offsets(self) -> dict[str, tuple[int, int]]:
        """ZeRO-3: (sub-group, offset) of each parameter's per-rank partition, walking params in order."""
        sizes = [t.numel() for t in self._flats(0, None)]
        out, sub, offset = {}, 0, 0
        for name, shape in ((n, s) for shapes in self.param_shapes for n, s in shapes.items()):
            part = math.ceil(math.prod(shape) / self.world_size)
            if offset + part > sizes[sub]:
                sub, offset = sub + 1, 0
            out[name] = (sub, offset)
            offset += part
        return out

    def fp32(self, name: str, key: str | None = None, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Full fp32 master weight (key None) or optimizer state `key` of parameter `name` (converted to
        `as_dtype` while it is copied out of the partitions, if given)."""
        shape = self.shape_of[name]
        numel = math.prod(shape)
        if self.stage == 3:
            sub, offset = self._z3_offsets[name]
            part = math.ceil(numel / self.world_size)
            pieces = [self._flats(r, key)[sub].narrow(0, offset, part) for r in range(self.world_size)]
            return _copy_out(pieces, numel, self._mapped, as_dtype).view(shape)
        g = self.group_of[name]
        pieces = []
        for r in range(self.world_size):
            fragment = self.optim[r]["param_slice_mappings"][g].get(name)
            if fragment is not None:
                pieces.append(self._flats(r, key)[g].narrow(0, fragment.start, fragment.numel))
        found = sum(p.numel() for p in pieces)
        if found != numel:
            raise CorruptCheckpointError(f"{self.dir}: the fragments of {name} hold {found} elements, "
                                         f"expected {numel}.")
        return _copy_out(pieces, numel, self._mapped, as_dtype).view(shape)

    # ---- components ----------------------------------------------------------------------------------------
    def _aliases(self) -> set[str]:
        return set((self.models[0].get("shared_params") or {}).keys())

    def _frozen(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(s) for n, s in (self.models[0].get("frozen_param_shapes") or {}).items()}

    def _frozen_tensor(self, name: str) -> torch.Tensor:
        shape = self._frozen()[name]
        if self.stage != 3:
            return self.models[0]["module"][name].clone()
        pieces = [m["frozen_param_fragments"][name] for m in self.models]
        return torch.cat(pieces)[:math.prod(shape)].view(shape).clone()

    def _copied(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (a tensor of a mapped file), its mapped pages handed back (see `_copy_out`)."""
        return _copy_out([t.reshape(-1)], t.numel(), self._mapped).view(t.shape)

    def model_source(self) -> TensorSource:
        """Model weights in the training dtype, named as save_pretrained names them."""
        module = self.models[0]["module"]
        entries = {}
        for name, shape in self.shape_of.items():
            if self.stage != 3:
                entries[name] = (shape, self.lp_dtype, lambda n=name: self._copied(module[n]))
            else:
                entries[name] = (shape, self.lp_dtype, lambda n=name: self.fp32(n, as_dtype=self.lp_dtype))
        for name, shape in self._frozen().items():
            entries[name] = (shape, module[name].dtype if self.stage != 3 else self.lp_dtype,
                             lambda n=name: self._frozen_tensor(n))
        for name in self.models[0].get("buffer_names") or []:
            entries[name] = (tuple(module[name].shape), module[name].dtype, lambda n=name: module[n].clone())
        for alias in self._aliases():
            entries.pop(alias, None)
        return TensorSource(entries)

    def master_source(self) -> TensorSource:
        """fp32 master weights of the trainable parameters."""
        return TensorSource({n: (s, torch.float32, lambda n=n: self.fp32(n)) for n, s in self.shape_of.items()})

    def optimizer_source(self) -> TensorSource:
        """Optimizer state keyed `<param>/<state>` plus the param-group metadata of the unified format."""
        base, encoder = self._base_state(0), OptimizerStateEncoder()
        for g, shapes in enumerate(self.param_shapes):
            state = base["state"].get(self._first_state_index(g), {})
            for key, value in state.items():
                for name, shape in shapes.items():
                    lazy = (tuple(shape), torch.float32, lambda n=name, key=key: self.fp32(n, key)) \
                        if torch.is_tensor(value) and value.dim() > 0 else None
                    encoder.add(name, key, value, stored=lazy)
        for g, saved in enumerate(base["param_groups"]):
            encoder.add_group(saved, list(self.param_shapes[g]))
        return TensorSource.encoded(encoder)

    def _first_state_index(self, g: int) -> int:
        """Index of the base-optimizer state entry that holds group g's scalars (ZeRO-3: its first sub-group)."""
        if self.stage != 3:
            return g
        first = next(iter(self.param_shapes[g]))
        return self._z3_offsets[first][0]

    def saved_by(self) -> dict:
        master = self.lp_dtype != torch.float32
        return saved_by("deepspeed", self.world_size, [self.lp_dtype], zero_stage=self.stage, master_weights=master,
                        master_weights_dtype="float32" if master else None, converted_from="deepspeed-legacy")


