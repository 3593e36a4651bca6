"""Weight conversions: how the tensors a model holds at run time (`live` names, e.g. a Mixture-of-Experts layer's
fused `mlp.experts.gate_up_proj` of shape [experts, 2 x intermediate, hidden]) map to the tensors `save_pretrained`
writes (per-expert `mlp.experts.3.gate_proj.weight`, ...). Pure: `engines.conversion` works a `WeightConversion`
out from transformers' own conversion rules, once per run; this module applies it.

Each saved tensor is made of `View`s of live tensors: a view's elements are
`live.flatten()[offset + sum(i_d * stride_d)]` (a slice, a chunk, one expert, a transposition), stored at elements
[at, at + numel) of the saved tensor's flattened values. Most saved tensors are one view of one live tensor (every
MoE family transformers converts); a saved tensor that concatenates several live tensors along its first dimension
(a fused `gate_up_proj` the model holds as `gate_proj` and `up_proj`) has one view per live tensor.

A view is `contiguous` when it is one range of the live tensor's flattened elements (the per-expert pieces of the
fused tensors): a rank holding a range of the live tensor (a ZeRO partition, FSDP2 rows) holds one range of each
such view and writes it in place. Every component is keyed alike: a live name in the weights, master weights and
EMA, and the `<live name>/<state>` keys of the optimizer, become the saved names with the same suffix; a state whose
shape is not the parameter's (a scalar `step`) is written once per saved name and read back from the first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from .planning import TensorSpec
from .reader import Specs, TensorReader, TensorSlice, read_flat_range


@dataclass(frozen=True)
class View:
    """Elements of one live tensor, `live.flatten()[offset + sum(index_d * stride_d)]` for an index of `shape`,
    stored at elements [at, at + numel) of saved tensor `key`, whose shape is `whole` (None: `shape`, the view is
    the whole saved tensor)."""

    key: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    at: int = 0
    whole: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def saved_shape(self) -> tuple[int, ...]:
        return self.shape if self.whole is None else self.whole

    @property
    def partial(self) -> bool:
        """Whether other live tensors fill the rest of the saved tensor."""
        return self.whole is not None

    @property
    def contiguous(self) -> bool:
        """Whether the view is the live elements [offset, offset + numel), in order."""
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def span(self) -> tuple[int, int]:
        """[first, last + 1) of the live flat positions the view reads."""
        last = self.offset + sum((s - 1) * d for s, d in zip(self.shape, self.stride) if s > 0)
        return self.offset, last + 1

    def of(self, flat: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This view of `flat`, the live elements [base, base + flat.numel()) (a view, no copy)."""
        return flat.as_strided(self.shape, self.stride, flat.storage_offset() + self.offset - base)

    def positions(self) -> torch.Tensor:
        """The live flat position of every element of the view, in the view's order (int64, `shape`)."""
        pos = torch.full(self.shape, self.offset, dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(self.shape, self.stride)):
            pos += (torch.arange(size, dtype=torch.int64) * stride).reshape([-1 if d == dim else 1
                                                                             for d in range(len(self.shape))])
        return pos


@dataclass(frozen=True)
class WeightConversion:
    """Live name -> the views of it that are saved (in `save_pretrained`'s order), and each converted live tensor's
    shape. Names are canonical (`names.canonical_name`) and, for a tied weight, the name it is saved under."""

    views: Mapping[str, tuple[View, ...]]
    live_shapes: Mapping[str, tuple[int, ...]]
    model_type: str = ""

    def __post_init__(self):
        sources: dict[str, list[tuple[str, View]]] = {}
        for live, views in self.views.items():
            for v in views:
                sources.setdefault(v.key, []).append((live, v))
        object.__setattr__(self, "_sources", sources)

    # ---- names ---------------------------------------------------------------------------------------------
    def converts(self, live: str) -> bool:
        return _param(live) in self.views

    def saved_names(self, live: str) -> list[str]:
        """The saved names of live key `live` (`<param>` or `<param>/<state>`); itself when not converted."""
        param, suffix = _split(live)
        views = self.views.get(param)
        return [live] if views is None else list(dict.fromkeys(v.key + suffix for v in views))

    def sources(self, saved: str) -> list[tuple[str, View | None]]:
        """[(live key, view)] a saved key is made of; [(saved, None)] when not converted."""
        param, suffix = _split(saved)
        found = self._sources.get(param)
        return [(saved, None)] if found is None else [(live + suffix, view) for live, view in found]

    def live_names(self, saved: Sequence[str]) -> list[str]:
        """The live keys the saved keys `saved` are made of, each once, in order."""
        return list(dict.fromkeys(live for n in saved for live, _ in self.sources(n)))

    # ---- save ----------------------------------------------------------------------------------------------
    def _is_view(self, live: str, shape: Sequence[int]) -> bool:
        """Whether state `live` has its parameter's shape (its elements convert); else it is copied per name."""
        return tuple(shape) == tuple(self.live_shapes[_param(live)])

    def specs(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """`specs` (live) as saved: each converted tensor replaced by the saved tensors it is part of."""
        out, seen = [], set()
        for spec in specs:
            if not self.converts(spec.name):
                out.append(spec)
                continue
            as_view = self._is_view(spec.name, spec.shape)
            _, suffix = _split(spec.name)
            for view in self.views[_param(spec.name)]:
                if view.key + suffix not in seen:
                    seen.add(view.key + suffix)
                    out.append(TensorSpec(view.key + suffix, view.saved_shape if as_view else spec.shape, spec.dtype))
        return out

    def owners(self, owners: Mapping[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for live, rank in owners.items():
            for saved in self.saved_names(live):
                out.setdefault(saved, rank)
        return out

    def tensors(self, live: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The saved tensors `names`, from the whole live tensors `live` (views where the layout allows)."""
        out = {}
        for name in names:
            parts = self.sources(name)
            source, view = parts[0]
            tensor = live[source]
            if view is None or not self._is_view(source, tensor.shape):
                out[name] = tensor
            elif not view.partial:
                tensor = view.of(tensor.reshape(-1))
                out[name] = tensor if view.contiguous else tensor.contiguous()
            else:
                whole = torch.empty(view.whole, dtype=tensor.dtype, device=tensor.device)
                for src, part in parts:
                    whole.view(-1)[part.at:part.at + part.numel] = part.of(live[src].reshape(-1)).reshape(-1)
                out[name] = whole
        return out

    def fragments(self, live: Mapping[str, object], names: Sequence[str] | None = None) -> dict[str, object]:
        """This rank's pieces (`engines.base.Fragment`) of the saved tensors, from its pieces of the live ones: the
        range of a contiguous view that the live range covers; a view that is not contiguous only when the live
        range covers all of it; none of a saved tensor made of several live tensors. What has no piece here is
        assembled like a tensor held in other layouts."""
        wanted = None if names is None else set(names)
        out = {}
        for source, frag in live.items():
            param, suffix = _split(source)
            for view in self.views.get(param, (None,)):
                name = source if view is None else view.key + suffix
                if wanted is not None and name not in wanted:
                    continue
                piece = frag if view is None or not self._is_view(source, frag.shape) else _piece(view, frag)
                if piece is not None:
                    out[name] = piece
        return out

    def metadata(self, metadata: Mapping) -> dict:
        """Optimizer index metadata (live names) as saved: every param group lists the saved names."""
        return _rename_metadata(metadata, self.saved_names)

    # ---- load ----------------------------------------------------------------------------------------------
    def reader(self, reader: TensorReader) -> "LiveReader":
        return LiveReader(reader, self)


def _piece(view: View, frag):
    """`frag` (elements [start, start + n) of a live tensor) restricted to `view`, as a fragment of its saved
    tensor; None when it holds none of it, or part of a view that is not one range, or part of a saved tensor."""
    if view.partial:
        return None
    values = frag.values.reshape(-1)
    lo, hi = frag.start, frag.start + values.numel()
    if frag.replicated or (lo == 0 and hi == math.prod(frag.shape)):
        full = view.of(values, lo)
        return replace(frag, shape=view.shape, start=0, values=full.reshape(-1) if view.contiguous
                       else full.contiguous().reshape(-1))
    first, end = view.span
    if view.contiguous:
        a, b = max(lo, first), min(hi, end)
        if a >= b:
            return None
        return replace(frag, shape=view.shape, start=a - first, values=values[a - lo:b - lo])
    if lo <= first and end <= hi:
        return replace(frag, shape=view.shape, start=0, values=view.of(values, lo).contiguous().reshape(-1))
    return None


def _param(key: str) -> str:
    return key.partition("/")[0]


def _split(key: str) -> tuple[str, str]:
    param, sep, state = key.partition("/")
    return param, sep + state


def _rename_metadata(metadata: Mapping, rename) -> dict:
    out = dict(metadata)
    if "param_groups" in out:
        out["param_groups"] = [{**g, "params": list(dict.fromkeys(n for p in g["params"] for n in rename(p)))}
                               for g in out["param_groups"]]
    if "state_types" in out:
        out["state_types"] = {n: kind for key, kind in out["state_types"].items() for n in rename(key)}
    return out


class LiveReader(TensorReader):
    """A saved component seen by live names: each converted live tensor is put together from the saved tensors
    that hold its views; a slice of rows reads only the saved tensors (and, for contiguous views, only the ranges)
    that cover it. Keys that are not converted pass through, and so do live tensors the reader holds as they are
    (legacy folders, checkpoints written before conversions were handled)."""

    def __init__(self, saved: TensorReader, conversion: WeightConversion):
        self.saved, self.conversion = saved, conversion
        self.metadata = _rename_metadata(saved.metadata, lambda key: conversion.live_names([key]))
        self._specs: Specs | None = None

    def specs(self) -> Specs:
        if self._specs is None:
            live: Specs = {}
            for name, (shape, dtype) in self.saved.specs().items():
                for source, view in self.conversion.sources(name):
                    if view is None:
                        live[name] = (shape, dtype)
                    elif source not in live:
                        same = tuple(shape) == tuple(view.saved_shape)
                        live[source] = (self.conversion.live_shapes[_param(source)] if same else shape, dtype)
            self._specs = live
        return self._specs

    def keys(self) -> list[str]:
        return list(self.specs())

    def __contains__(self, name: str) -> bool:
        return name in self.specs()

    def _assembled(self, name: str) -> bool:
        """Whether live tensor `name` is put together from saved ones (else read as the reader holds it)."""
        return self.conversion.converts(name) and name not in self.saved

    def get(self, name: str) -> torch.Tensor:
        if not self._assembled(name):
            return self.saved.get(name)
        shape = self.specs()[name][0]
        return self._rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def get_slice(self, name: str) -> TensorSlice:
        if not self._assembled(name):
            return self.saved.get_slice(name)
        return _LiveSlice(self, name)

    def _rows(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of live tensor `name`, flattened: only the saved tensors that cover them are read."""
        shape, _ = self.specs()[name]
        param, suffix = _split(name)
        views = self.conversion.views[param]
        if tuple(shape) != tuple(self.conversion.live_shapes[param]):  # a state copied per name
            return self.saved.get(views[0].key + suffix).reshape(-1)
        row = math.prod(shape[1:])
        lo, hi = first * row, last * row
        out = None
        for view in views:
            first_at, end = view.span
            if end <= lo or hi <= first_at:
                continue
            where, values = self._read(view.key + suffix, view, lo, hi)
            if out is None:
                out = torch.empty(hi - lo, dtype=values.dtype)
            out[where] = values
        return out if out is not None else self.saved.get_slice(views[0].key + suffix)[0:0].reshape(-1)

    def _read(self, key: str, view: View, lo: int, hi: int) -> tuple[object, torch.Tensor]:
        """(positions in the output, values) of the live range [lo, hi) that `view` of saved tensor `key` holds."""
        first_at, end = view.span
        if view.contiguous:
            a, b = max(lo, first_at), min(hi, end)
            values = read_flat_range(self.saved, key, view.saved_shape, view.at + a - first_at, b - a)
            return slice(a - lo, b - lo), values
        positions = view.positions().reshape(-1)
        inside = (positions >= lo) & (positions < hi)
        values = read_flat_range(self.saved, key, view.saved_shape, view.at, view.numel)
        return positions[inside] - lo, values[inside]

    def close(self) -> None:
        self.saved.close()


class _LiveSlice(TensorSlice):
    def __init__(self, reader: LiveReader, name: str):
        self._reader, self._name = reader, name

    def __getitem__(self, index) -> torch.Tensor:
        shape = self._reader.specs()[self._name][0]
        rows = index[0] if isinstance(index, tuple) and index else index
        rest = index[1:] if isinstance(index, tuple) else ()
        if isinstance(rows, slice) and rows.step in (None, 1) and shape:
            first, last, _ = rows.indices(shape[0])
            last = max(first, last)
            values = self._reader._rows(self._name, first, last).reshape((last - first, *shape[1:]))
            return values[(slice(None), *rest)] if rest else values
        return self._reader.get(self._name)[index]
