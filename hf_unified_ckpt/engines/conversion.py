"""Models whose run-time tensors are not the ones `save_pretrained` writes (transformers 5 weight conversions:
Mixture-of-Experts layers fuse their experts into 3-D tensors at load time and `save_pretrained` writes them back
per expert): the `WeightConversion` worked out from transformers' own rules, the tensors `save_pretrained` writes
(`model_state_for_save`), and `WithConversion`, the engine adapter that saves and loads every component under the
saved names. `hf_model` is below this module: it never imports it.

The rules (`transformers.core_model_loading.revert_weight_conversion` with the model's conversion mapping) work
on whole tensors. To learn which elements of which live tensor each saved tensor holds, they are run once on index
tensors (`arange`, one layer at a time so the memory is one layer's converted tensors), and each result is checked
to be a strided view of one live tensor, or consecutive runs of views of several (a concatenation)
(`format.conversion.View`); anything else is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import UnsupportedCheckpointError
from ..format.conversion import View, WeightConversion
from ..format.planning import TensorSpec
from .base import AdapterWrapper, MasterFragments
from .hf_model import is_peft_model, live_model_state


def weight_conversion(module: nn.Module, specs: Sequence[TensorSpec]) -> WeightConversion | None:
    """The conversion between `module`'s live tensors (`specs`: the weights component's specs, live names, full
    shapes) and what `save_pretrained` writes; None when they are the same. Raises `UnsupportedCheckpointError`
    naming a saved tensor that is not a rearrangement of one live tensor. Local only (no collective)."""
    revert = _reverter(module)
    if revert is None:
        return None
    meta = {s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs}
    reverted = revert(dict(meta))
    by_tensor = {id(t): name for name, t in meta.items()}
    renamed = {by_tensor[id(t)]: key for key, t in reverted.items() if id(t) in by_tensor}
    views = {live: (_whole(key, meta[live].shape),) for live, key in renamed.items() if live != key}
    converted = [name for name in meta if name not in renamed]
    for group in _layer_groups(converted):
        views.update(_index_pass(module, revert, {n: tuple(meta[n].shape) for n in group}))
    if not views:
        return None
    return WeightConversion(views, {n: tuple(meta[n].shape) for n in views},
                            getattr(getattr(module, "config", None), "model_type", "") or "")


def model_state_for_save(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained(module)` would write, by the names it would use (views where the model's
    weight conversion allows, else copies)."""
    state = live_model_state(module)
    conversion = weight_conversion(module, [TensorSpec.of(n, t) for n, t in state.items()])
    if conversion is None:
        return state
    return conversion.tensors(state, [saved for live in state for saved in conversion.saved_names(live)])


def _reverter(module: nn.Module):
    if is_peft_model(module) or not hasattr(module, "all_tied_weights_keys"):
        return None  # PEFT saves its adapter keys as they are; a plain module has no conversions
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: models hold what they save
        return None
    return lambda state: revert_weight_conversion(module, state)


def _whole(key: str, shape) -> View:
    return View(key, tuple(shape), torch.empty(shape, device="meta").stride(), 0)


def _layer_groups(names: Sequence[str]) -> list[list[str]]:
    """The converted live names grouped by the numbers in them (one layer's tensors are converted together)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        groups.setdefault(tuple(re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)), []).append(name)
    return list(groups.values())


def _index_pass(module: nn.Module, revert, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[View, ...]]:
    """Run the reverse conversion on index tensors (live tensor k holds `bases[k] + arange`) and read each saved
    tensor back as views of the live tensors it is made of."""
    bases, at = {}, 0
    for name, shape in shapes.items():
        bases[name] = at
        at += max(1, math.prod(shape))
    index = {n: torch.arange(bases[n], bases[n] + math.prod(s), dtype=torch.int64).reshape(s)
             for n, s in shapes.items()}
    views: dict[str, list[View]] = {n: [] for n in shapes}
    for key, values in revert(index).items():
        for source, view in _as_views(module, key, values, bases, shapes):
            views[source].append(view)
    return {n: tuple(v) for n, v in views.items() if v}


def _as_views(module, key: str, values: torch.Tensor, bases: dict[str, int], shapes) -> list[tuple[str, View]]:
    """Saved tensor `key` (its elements' indices `values`) as one view of one live tensor, or as consecutive runs
    of its flattened elements, one per live tensor (a concatenation); refused otherwise."""
    if values.numel() == 0:
        raise _refusal(module, key, "it is empty")
    names = sorted(bases, key=bases.get)
    flat = values.reshape(-1)
    owner = torch.bucketize(flat, torch.tensor([bases[n] for n in names]), right=True) - 1
    cuts = [0, *(torch.nonzero(owner[1:] != owner[:-1]).reshape(-1) + 1).tolist(), flat.numel()]
    runs = [(names[int(owner[a])], a, b) for a, b in zip(cuts, cuts[1:])]
    if len({source for source, _, _ in runs}) != len(runs):
        raise _refusal(module, key, "it interleaves the elements of several tensors the model holds")
    if len(runs) == 1:
        return [(runs[0][0], _view(module, key, values - bases[runs[0][0]], shapes[runs[0][0]]))]
    row = math.prod(values.shape[1:])
    out = []
    for source, a, b in runs:
        local = flat[a:b] - bases[source]
        local = local.reshape(((b - a) // row, *values.shape[1:])) if a % row == 0 and b % row == 0 else local
        out.append((source, dataclasses.replace(_view(module, key, local, shapes[source]), at=a,
                                                whole=tuple(values.shape))))
    return out


def _view(module, key: str, local: torch.Tensor, live_shape) -> View:
    """`local` (indices into one live tensor) as a strided `View`; refused when it is not one."""
    first = int(local.reshape(-1)[0])
    stride = tuple(int(local[tuple(1 if d == dim else 0 for d in range(local.dim()))]) - first if size > 1 else 0
                   for dim, size in enumerate(local.shape))
    view = View(key, tuple(local.shape), stride, first)
    inside = bool(((local >= 0) & (local < math.prod(live_shape))).all())
    if not inside or not torch.equal(view.positions(), local):
        raise _refusal(module, key, "its elements are not a slice or transposition of the tensors the model holds")
    return view


def _refusal(module: nn.Module, key: str, why: str) -> UnsupportedCheckpointError:
    model_type = getattr(getattr(module, "config", None), "model_type", "?")
    return UnsupportedCheckpointError(
        f"{type(module).__name__} (model type {model_type!r}) converts its weights when loaded (transformers "
        f"weight conversions), and the tensor save_pretrained writes as {key!r} cannot be saved from the model's "
        f"own tensors: {why}. Unified checkpoints support conversions that cut each saved tensor out of tensors of "
        "the model (slices, transpositions, concatenations along the first dimension: the fused experts of "
        "Mixture-of-Experts models, fused projections). Set unified_checkpoint=False for this model.")


class _ConvertedMasterFragments:
    """`WithConversion`'s `MasterFragments`, where the wrapped adapter has them."""

    def master_fragments(self):
        """`master_fragments` of the wrapped adapter, by saved name (a piece of each saved tensor it covers)."""
        pieces = self.inner.parameter_fragments()
        for name, hp, lp in self.inner.master_fragments():
            frag = pieces[name]
            high = self.conversion.fragments({name: dataclasses.replace(frag, values=hp)})
            low = self.conversion.fragments({name: dataclasses.replace(frag, values=lp)})
            for saved, piece in high.items():
                yield saved, piece.values, low[saved].values


class WithConversion(AdapterWrapper):
    """An engine adapter seen under the names `save_pretrained` writes: every component (weights, master weights,
    EMA, optimizer state) keyed by the saved names, each rank's pieces of a fused live tensor handed out as pieces of
    the saved tensors they cover (`WeightConversion.fragments`), and on load every reader seen by live names
    (`LiveReader`). Everything else is the wrapped adapter's (`inner`), its optional capabilities included
    (`engines.base.AdapterWrapper`), but its partition rule: the saved tensors follow none."""

    own_capabilities = {MasterFragments: _ConvertedMasterFragments}

    def __init__(self, inner, conversion: WeightConversion):
        super().__init__(inner)
        self.conversion = conversion

    def specs(self, component: str) -> list[TensorSpec]:
        return self.conversion.specs(self.inner.specs(component))

    def preferred_owners(self, component: str) -> dict[str, int]:
        """Collective where the wrapped adapter's is."""
        return self.conversion.owners(self.inner.preferred_owners(component))

    def exchange(self, component: str, names, owner: int) -> None:
        """Assemble the live tensors the saved `names` come from on `owner`. Collective on sharded engines."""
        self.inner.exchange(component, self.conversion.live_names(names), owner)

    def tensors(self, component: str, names) -> dict[str, torch.Tensor]:
        return self.conversion.tensors(self.inner.tensors(component, self.conversion.live_names(names)), names)

    def fragments(self, component: str, names=None) -> dict:
        live = self.inner.fragments(component, None if names is None else self.conversion.live_names(names))
        return self.conversion.fragments(live, names)

    def optimizer_metadata(self) -> dict:
        return self.conversion.metadata(self.inner.optimizer_metadata())

    def partition_rule(self, component: str, names=None) -> tuple[None, str]:
        """None: the saved tensors are pieces of fused live ones (`WeightConversion.fragments`), not the engine's
        rule; the save takes the census. Local."""
        return None, "tensors saved under converted names (pieces of fused live tensors)"

    def load(self, sources) -> None:
        readers = {name: self.conversion.reader(r) for name, r in sources.readers.items()}
        self.inner.load(dataclasses.replace(sources, readers=readers))



def live_groups(engine, groups: list[list[str]]) -> list[list[str]]:
    """A checkpoint's param groups (saved names, or the live names of a checkpoint written before conversions were
    handled) by the live names `engine.param_group_names()` lists."""
    if not isinstance(engine, WithConversion):
        return groups
    return [engine.conversion.live_names(g) for g in groups]
