"""The seam between the save/load algorithms and a training engine.

An engine holds the tensors of some components (`components.py`): it lists them, describes their tensors and
hands them out by component name, and takes a `LoadSources` mapping back. Engines never branch on component
names: each keeps a mapping from the names it holds to where their tensors come from (`component_source`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ..format.components import Component
from ..format.names import NamingPolicy
from ..format.planning import TensorSpec

T = TypeVar("T")


@dataclass(frozen=True)
class Fragment:
    """What this rank holds of one tensor: elements `[start, start + values.numel())` of its flattened full
    tensor of shape `shape` (`values`: a 1-D view of the live data); `replicated` when every rank holds the whole
    tensor."""

    shape: tuple[int, ...]
    start: int
    values: torch.Tensor
    replicated: bool = False


@dataclass(frozen=True)
class LoadSources:
    """What an engine loads from: a reader per component name, and the global step.

    The `master_weights` reader holds the best fp32 values of the trainable weights: the master weights' files
    when saved, else the model weights (exact when they are fp32; a rebuild from low precision otherwise).
    """

    readers: Mapping[str, object]
    global_step: int

    def get(self, component: Component):
        """The reader of `component`, or None when it is not loaded (the optimizer of a weights-only load)."""
        return self.readers.get(component.name)


def component_source(sources: Mapping[str, T], component: str, engine: str) -> T:
    """`sources[component]`, or a clear error naming the components `engine` holds."""
    try:
        return sources[component]
    except KeyError:
        raise KeyError(f"the {engine} engine holds no {component!r} component (it holds {sorted(sources)})") from None


class EngineAdapter(Protocol):
    """What the save and load algorithms need from an engine.

    `components` (with the file stem of each), `specs` and `optimizer_metadata` are identical on every rank, so
    every rank computes the same plan. `preferred_owners` and `exchange` (which assembles one file's tensors on the rank `owner` that
    writes it) may be collectives on sharded engines: all ranks call them in the same order. After `exchange`,
    `tensors` only reads what this rank holds, and may run in a writer thread.

    `fragments` lists the tensors of a component that are split over the ranks in contiguous ranges of their
    flattened elements (one range per rank, possibly empty), with this rank's range: the shared-file writer writes
    those in place, with no exchange. It reads only what this rank holds (no collective) and must describe the
    same split on every call of one save.
    """

    engine: str
    #: How the model's tensors are named in a checkpoint: `naming.weight_key(name)` is the weight an optimizer key's
    #: parameter name stands for (the resume checks saved state against that weight's live shape).
    naming: NamingPolicy

    def saved_by(self) -> dict: ...

    def components(self) -> list[Component]: ...

    def specs(self, component: str) -> list[TensorSpec]: ...

    def preferred_owners(self, component: str) -> dict[str, int]: ...

    def exchange(self, component: str, names: Sequence[str], owner: int) -> None: ...

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]: ...

    def fragments(self, component: str, names: Sequence[str] | None = None) -> dict[str, Fragment]: ...

    def optimizer_metadata(self) -> dict: ...

    def param_group_names(self) -> list[list[str]]: ...

    def config_files(self) -> dict[str, bytes]: ...

    def load(self, sources) -> None: ...
