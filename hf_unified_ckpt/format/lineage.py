"""The lineage guard of checkpoint compression (O1/O2): quantisation error is paid once per restore, never
compounded. Pure.

A restore from a compressed checkpoint puts an error into the optimizer's moments. Training then decays it: a
moment with decay rate beta keeps beta**t of it after t steps (Adam's second moment, beta2, is the slowest). If a
later save quantised the moments while that error is still large, the next restore would stack a second error on
top of the first. The guard: a save is written at O0 while fewer than `half_life` steps have passed since the
lineage's latest restore from a compressed checkpoint, where `half_life` is the steps the slowest moment needs to
halve what it carries (ln 2 / -ln beta: 693 for beta2 = 0.999, 14 for 0.95). So when a save compresses, every
earlier restore's error has at least halved, and the errors a checkpoint's moments carry are bounded by
1 + 1/2 + 1/4 + ... = twice one quantisation, however long the lineage. The step of that latest restore is
recorded in every manifest of the lineage (`options.quantized_restore_step`), so the guard holds across jobs.
An optimizer without a known decay rate gets no compressed save after a compressed restore (the reference
design's rule).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

#: Param-group hyper-parameters that are the decay rate of a moment (torch optimizers' names).
_DECAYS = ("betas", "momentum", "alpha", "rho", "beta")


class SaveStages(Protocol):
    """What the guard reads and sets of a save's options: a dataclass with these fields (`options`'
    `UnifiedCheckpointOptions`, which sits above this layer and is never imported here)."""

    quant_stage: str
    quant_stage_requested: str | None
    quantized_restore_step: int | None


Options = TypeVar("Options", bound=SaveStages)


def error_half_life(param_groups: Sequence[Mapping]) -> float:
    """Steps for the slowest-decaying moment of these param groups to halve a perturbation; inf when unknown."""
    rates = []
    for group in param_groups:
        for key in _DECAYS:
            value = group.get(key)
            values = value if isinstance(value, (list, tuple)) else [value]
            rates += [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    slowest = max((r for r in rates if 0 < r < 1), default=None)
    return math.inf if slowest is None else math.log(2) / -math.log(slowest)


def restored_step(manifest: Mapping) -> int | None:
    """The step of the latest restore from a compressed checkpoint in the lineage of a run resumed from `manifest`:
    that checkpoint's own step if it is compressed, else what it recorded."""
    options = manifest.get("options", {})
    if options.get("ckpt_quant_stage", "O0") != "O0":
        return int(manifest.get("global_step", 0))
    recorded = options.get("quantized_restore_step")
    return None if recorded is None else int(recorded)


def options_for_save(options: Options, step: int, restore_step: int | None, half_life: float) -> Options:
    """The options of the save at `step` (`options`: a dataclass such as `UnifiedCheckpointOptions`, returned
    as the same type): O0 (the requested stage recorded) while the guard holds, and the lineage's restore step
    carried forward either way."""
    if restore_step is None:
        return options
    if options.quant_stage != "O0" and step - restore_step < half_life:
        return replace(options, quant_stage="O0", quant_stage_requested=options.quant_stage,
                       quantized_restore_step=restore_step)
    return replace(options, quantized_restore_step=restore_step)
