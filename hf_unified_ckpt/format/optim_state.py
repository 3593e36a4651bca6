"""Flatten any torch optimizer's `state_dict()` into name-keyed tensors plus JSON metadata, and back. Pure.

Tensors are keyed `<param name>/<state name>`. Non-tensor per-parameter values (Adafactor's int `step`,
float `RMS`, `None` momentum buffers) are stored as 0-d tensors (or not at all, for None) and their Python
type is recorded in the metadata so they round-trip exactly. Param-group hyper-parameters are stored as
JSON with tuples and tensors tagged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import count_and_first
from .names import optimizer_key, split_optimizer_key

_PY_SCALARS = {bool: ("bool", torch.bool), int: ("int", torch.int64), float: ("float", torch.float64)}
_PY_TYPES = {"bool": bool, "int": int, "float": float}


def encode_scalar(value, key: str = "") -> tuple[torch.Tensor, str | None]:
    """A per-parameter (or per-group) scalar as a 0-d tensor, with its Python type name when it was not a
    tensor (recorded in `state_types` so `decode_scalar` returns the same type)."""
    if torch.is_tensor(value):
        return value.detach().reshape(()).cpu(), None
    if type(value) in _PY_SCALARS:
        type_name, dtype = _PY_SCALARS[type(value)]
        return torch.tensor(value, dtype=dtype), type_name
    raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; the unified format stores tensors, "
                    "Python numbers and None only.")


def decode_scalar(tensor: torch.Tensor, kind: str | None):
    """Inverse of `encode_scalar`."""
    return _PY_TYPES[kind](tensor.item()) if kind else tensor


def encode_hparam(key: str, value):
    """Encode one param-group value as JSON (tuples, tensors and non-finite floats are tagged)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_hparam(key, v) for v in value]}
    if isinstance(value, list):
        return [encode_hparam(key, v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise TypeError(
        f"optimizer param_group entry {key!r} has a value of type {type(value).__name__} that the unified "
        "format cannot store; expected numbers, strings, bools, None, tuples/lists of them or tensors."
    )


def decode_hparam(value):
    """Inverse of `encode_hparam`."""
    if isinstance(value, list):
        return [decode_hparam(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_hparam(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    return value


class OptimizerStateEncoder:
    """Builds the optimizer component, the same for every engine and legacy reader: `<param>/<state>` entries and
    the index metadata (`param_groups`: hyper-parameters and parameter names; `state_types`: the Python type of
    each scalar, "none" for a None value, which has no entry)."""

    def __init__(self):
        self.entries: dict[str, object] = {}
        self.state_types: dict[str, str] = {}
        self.groups: list[dict] = []

    def add_group(self, hparams: Mapping, params: Sequence[str]) -> None:
        """One param group: its hyper-parameters (`params` ignored) and the names of its parameters."""
        self.groups.append({**{k: encode_hparam(k, v) for k, v in hparams.items() if k != "params"},
                            "params": list(params)})

    def add(self, param: str, state: str, value, stored=None) -> str:
        """One per-parameter state value; returns its key. A tensor is kept as given, or as `stored` when the caller
        holds it in another form (a sharded tensor, a lazy loader); a Python scalar becomes a 0-d tensor with its
        type recorded; None is recorded only."""
        key = optimizer_key(param, state)
        if stored is not None:
            self.entries[key] = stored
        elif value is None:
            self.state_types[key] = "none"
        elif torch.is_tensor(value):
            self.entries[key] = value
        else:
            self.entries[key], self.state_types[key] = encode_scalar(value, key)
        return key

    def metadata(self) -> dict:
        return {"param_groups": self.groups, "state_types": self.state_types}


class OptimizerStateDecoder:
    """Reads the optimizer component back (a reader with `keys`, `get` and the index `metadata`)."""

    def __init__(self, reader):
        self.reader = reader
        self.state_types: dict[str, str] = reader.metadata.get("state_types", {})
        self.saved_groups: list[dict] = reader.metadata["param_groups"]

    def group_hparams(self, current: Sequence[Sequence[str]]) -> list[dict | None]:
        """The saved hyper-parameters of each current group (names, in the optimizer's order), after checking the
        groups hold the same parameters; None for an empty current group (some engines drop empty groups, such
        as a LoRA model's no-weight-decay group, so empty groups on either side are not matched)."""
        matched = match_groups(group_param_names(self.reader.metadata), current)
        return [None if j is None else {k: decode_hparam(v) for k, v in self.saved_groups[j].items() if k != "params"}
                for j in matched]

    def keys(self) -> list[str]:
        """Every saved state key, None-valued ones included."""
        return list(self.reader.keys()) + [k for k, t in self.state_types.items() if t == "none"]

    def kind(self, key: str) -> str | None:
        """"none", "bool", "int" or "float" for values that were not tensors; None for tensors."""
        return self.state_types.get(key)

    def value(self, key: str):
        """The saved value: None, a Python scalar of its saved type, or the tensor (read whole) in memory this
        process owns. An optimizer keeps the tensors `load_state_dict` is given (`.to()` returns the same tensor
        when dtype and device match), and a reader's tensor may be a view of a mapped checkpoint file, which the
        memory tier reuses later: a kept view would change with the file, or die with SIGBUS once it shrinks."""
        kind = self.kind(key)
        if kind == "none":
            return None
        return decode_scalar(owned(self.reader.get(key)), kind)


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor a reader returned, in memory the process owns (never in a file mapping)."""
    return tensor.clone(memory_format=torch.contiguous_format)


def flatten_optimizer_state(
    state_dict: Mapping, index_to_name: Mapping[int, str]
) -> tuple[dict[str, torch.Tensor], dict]:
    """Turn `optimizer.state_dict()` into (`{"<param>/<state>": tensor}`, metadata).

    `index_to_name` maps the integer ids of `state_dict["param_groups"][*]["params"]` to canonical names.
    """
    encoder = OptimizerStateEncoder()
    groups = [group["params"] for group in state_dict["param_groups"]]
    for index, state_name, value in in_group_order(state_dict["state"], groups):
        encoder.add(index_to_name[index], state_name, value)
    for group in state_dict["param_groups"]:
        encoder.add_group(group, [index_to_name[i] for i in group["params"]])
    return encoder.entries, encoder.metadata()


def in_group_order(state: Mapping, groups: Sequence[Sequence]):
    """(parameter, state name, value) of every per-parameter state value: parameters in param-group order (the
    order the optimizer was built with), each parameter's scalars (`step`) first, then its other states, each by
    name -- the order torch's Adam family creates them in, so a fresh AdamW's files stay byte for byte what they
    were. The component is planned in this order, so the files, their sizes and their writers do not depend on the
    order the state dict happens to have (a fresh optimizer creates state at its first step, a loaded one in the
    order it was loaded); a parameter in no group comes last, in the state's order."""
    listed = [p for params in groups for p in params]
    known = set(listed)
    for param in [p for p in listed if p in state] + [p for p in state if p not in known]:
        per_param = state[param]
        for state_name in sorted(per_param, key=lambda name: (_is_array(per_param[name]), name)):
            yield param, state_name, per_param[state_name]


def _is_array(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def group_param_names(metadata: Mapping) -> list[list[str]]:
    """The parameter names of each saved param group."""
    return [list(g["params"]) for g in metadata["param_groups"]]


def match_groups(saved: Sequence[Sequence[str]], current: Sequence[Sequence[str]]) -> list[int | None]:
    """For each current param group, the index of the saved group holding the same parameters (None for an empty
    current group). Non-empty groups are matched in order; raise if they do not hold the same parameters."""
    saved_at = [i for i, names in enumerate(saved) if names]
    current_at = [i for i, names in enumerate(current) if names]
    if len(saved_at) != len(current_at):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_at)} non-empty param group(s), the current optimizer has "
            f"{len(current_at)}; build the optimizer the same way as the run that saved it."
        )
    for i, j in zip(current_at, saved_at):
        missing, extra = sorted(set(current[i]) - set(saved[j])), sorted(set(saved[j]) - set(current[i]))
        if missing or extra:
            raise ValueError(
                f"optimizer param group {i}: in the current optimizer but not in the checkpoint: "
                f"{count_and_first(missing, 'parameter')}; in the checkpoint but not in the current optimizer: "
                f"{count_and_first(extra, 'parameter')}. The model or its trainable parameters differ."
            )
    by_current = dict(zip(current_at, saved_at))
    return [by_current.get(i) for i in range(len(current))]


def fit_scheduler_state(saved: Mapping, fresh: Mapping, matched: Sequence[int | None]) -> dict:
    """A learning-rate scheduler's saved `state_dict()` fitted to the current optimizer's param groups: every
    per-group list (`base_lrs`, `_last_lr`, `lr_lambdas`, ...) reordered by `matched` (`match_groups`), with the
    `fresh` scheduler's own entry for a current group the checkpoint does not list. Unchanged when the groups
    correspond one to one."""
    count = len(saved.get("base_lrs", ()))
    if list(matched) == list(range(count)):
        return dict(saved)
    out = dict(saved)
    for key, value in saved.items():
        now = fresh.get(key)
        if isinstance(value, list) and len(value) == count and isinstance(now, list) and len(now) == len(matched):
            out[key] = [now[i] if j is None else value[j] for i, j in enumerate(matched)]
    return out


def unflatten_optimizer_state(reader, current_groups: Sequence[Sequence[str]],
                              current_hparams: Sequence[Mapping]) -> dict:
    """Build an `optimizer.load_state_dict()` argument, from the optimizer component `reader`, for an optimizer whose
    groups hold `current_groups` (parameter names, in the optimizer's own order) with hyper-parameters
    `current_hparams` (kept for an empty group the checkpoint does not list). State ids follow that order, so the
    positional mapping `load_state_dict` performs is the identity."""
    decoder = OptimizerStateDecoder(reader)
    hparams = [saved if saved is not None else {k: v for k, v in now.items() if k != "params"}
               for saved, now in zip(decoder.group_hparams(current_groups), current_hparams)]
    name_to_index = {name: i for i, name in enumerate(n for group in current_groups for n in group)}
    state: dict[int, dict] = {}
    for key in decoder.keys():
        name, state_name = split_optimizer_key(key)
        if name not in name_to_index:
            raise ValueError(f"optimizer state {key!r} belongs to no parameter of the current optimizer.")
        state.setdefault(name_to_index[name], {})[state_name] = decoder.value(key)
    groups = [{**hp, "params": [name_to_index[n] for n in names]} for hp, names in zip(hparams, current_groups)]
    return {"state": state, "param_groups": groups}
