"""The components of a unified checkpoint, described once. Pure.

A component is a named set of tensors with its own files (`<stem>[-0000k-of-0000n].safetensors` + index) and
its own entry in the manifest. Its *role* says how its tensors are keyed, which is all that engines and readers
need to know about it:

- `WEIGHTS`: the model's tensors, named as `save_pretrained` names them (the model files; a PEFT model's adapter);
- `PARAMETER_STATE`: one tensor per trainable parameter, keyed like the weights (fp32 master weights, EMA);
- `OPTIMIZER`: `<param name>/<state name>` keys, param groups and scalar types in the index metadata.

Engines give the save a mapping `{component name: its tensors}` and take one back on load; adding a component
(EMA, an adapter of its own) is a row in `REGISTRY` plus the code that produces its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    WEIGHTS = "weights"
    PARAMETER_STATE = "parameter_state"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class Component:
    """One component: its name in the manifest, the stem of its files (the weights' stem can be replaced by the
    naming policy: `adapter_model` for PEFT), and its role."""

    name: str
    file_stem: str
    role: Role


MODEL = Component("model", "model", Role.WEIGHTS)
MASTER = Component("master_weights", "master_weights", Role.PARAMETER_STATE)
OPTIMIZER = Component("optimizer", "optimizer", Role.OPTIMIZER)
EMA = Component("ema", "ema", Role.PARAMETER_STATE)

#: Every component this version writes or reads, by name (the manifest's `components` keys).
REGISTRY: dict[str, Component] = {c.name: c for c in (MODEL, MASTER, OPTIMIZER, EMA)}


def component(name: str) -> Component:
    """The registered component `name`; a clear error for one this version does not know."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown checkpoint component {name!r}; this version knows {sorted(REGISTRY)}") from None


def saved_by(engine: str, world_size: int, param_dtypes, *, zero_stage: int | None = None,
             fsdp_version: int | None = None, master_weights: bool = False,
             master_weights_dtype: str | None = None, **extra) -> dict:
    """How a checkpoint was saved, as the manifest records it (one shape for every engine and legacy reader);
    `extra` keys are added (`converted_from` for legacy folders)."""
    out = {"engine": engine, "world_size": int(world_size), "zero_stage": zero_stage, "fsdp_version": fsdp_version,
           "param_dtypes": sorted({str(d).removeprefix("torch.") for d in param_dtypes}),
           "master_weights": bool(master_weights)}
    if master_weights_dtype is not None or engine == "deepspeed":
        out["master_weights_dtype"] = master_weights_dtype
    return {**out, **extra}
