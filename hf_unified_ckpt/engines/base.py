"""The seam between the save/load algorithms and a training engine.

An engine holds the tensors of some components (`components.py`): it lists them, describes their tensors and
hands them out by component name, and takes a `LoadSources` mapping back. Engines never branch on component
names: each keeps a mapping from the names it holds to where their tensors come from (`component_source`).

What an engine may have beyond `EngineAdapter` is a capability, each a runtime-checkable protocol of this module
(`PartitionRule`, `ParameterRule`, `ConfirmsRule`, `MasterFragments`, `MasterPrecision`): the algorithms ask
`isinstance(engine, Capability)`, never `getattr`/`hasattr`. An adapter that wraps another (`AdapterWrapper`: the
EMA's `WithEma`, `WithConversion`) has exactly the capabilities of the adapter it wraps, declared on its class (not
found through `__getattr__`, which Python 3.12's `isinstance` on a protocol no longer calls)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch

from ..format.components import Component
from ..format.names import NamingPolicy
from ..format.planning import Strided, TensorSpec

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
    #: Whether the weights are applied by the module's own `load_state_dict`, which judges their shapes (one
    #: process, DDP); else the load refuses a saved weight of another shape than the model's first.
    loads_by_module: bool
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


# ---- optional capabilities ------------------------------------------------------------------------------------


@runtime_checkable
class PartitionRule(Protocol):
    """An engine whose layout follows a rule of the world size alone, given in closed form (`checkpoint.save
    .rule_plan`)."""

    def partition_rule(self, component: str, names: Sequence[str] | None = None) -> tuple[dict[str, Strided] | None,
                                                                                           str]:
        """Tensor name -> `Strided` of every tensor of `component` held in pieces (those of `names` where given),
        or (None, why not). Local."""


@runtime_checkable
class ParameterRule(Protocol):
    """An engine whose parameter fragments (`parameter_fragments`, which an EMA follows) follow a rule."""

    def parameter_rule(self) -> tuple[dict[str, Strided] | None, str]:
        """`partition_rule` of `parameter_fragments`, or (None, why not). Local."""


@runtime_checkable
class ConfirmsRule(Protocol):
    """An engine that checks, once the ranks agreed on its rule, what the rule's plan assumes of it."""

    def confirm_rule(self) -> None:
        """Raise where the engine's state contradicts its partition rule. Local."""


@runtime_checkable
class MasterFragments(Protocol):
    """An engine keeping fp32 master weights beside its low-precision ones (the residual codec's census)."""

    def master_fragments(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, fp32 values, low-precision values) of each fragment this rank holds. Local."""


@runtime_checkable
class MasterPrecision(Protocol):
    """An engine that says whether a resume needs fp32 values of its trainable weights."""

    def needs_fp32_master(self) -> bool:
        """Whether the load needs fp32 master weights (else rebuilt from low precision, when allowed)."""


#: Every optional capability of an engine adapter.
CAPABILITIES: tuple[type, ...] = (PartitionRule, ParameterRule, ConfirmsRule, MasterFragments, MasterPrecision)


class AdapterWrapper:
    """Base of an engine adapter that wraps another (`inner`) and passes on what it does not define itself.

    Its objects are of a subclass made per set of capabilities of the inner adapter (`__new__`): it has every
    capability the inner one has, and none other (unless the wrapper defines it unconditionally). A wrapper's own
    version of a capability, used only where the inner adapter has it, is a mixin in `own_capabilities`; any other
    is forwarded to `inner`. `isinstance(wrapper, Capability)` thus answers as for the inner adapter on every
    Python (3.12 looks members up statically, without `__getattr__`)."""

    #: Capability -> mixin class with the wrapper's own version of it, used where the inner adapter has it.
    own_capabilities: dict[type, type] = {}

    def __new__(cls, inner, *args, **kwargs):
        return super().__new__(_with_capabilities(cls, frozenset(c for c in CAPABILITIES if isinstance(inner, c))))

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "inner":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)


@functools.cache
def _with_capabilities(cls: type, capabilities: frozenset) -> type:
    """`cls` with each of `capabilities` it lacks: its own mixin (`own_capabilities`) or members forwarded to
    `inner`."""
    mixins = [cls.own_capabilities.get(c) or _forwarding(c) for c in CAPABILITIES
              if c in capabilities and not issubclass(cls, c)]
    if not mixins:
        return cls
    return type(cls.__name__, (cls, *mixins), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


@functools.cache
def _forwarding(capability: type) -> type:
    """A mixin whose methods are `capability`'s, each calling the same method of `self.inner`."""
    def forward(name):
        def method(self, *args, **kwargs):
            return getattr(self.inner, name)(*args, **kwargs)
        method.__name__ = name
        return method

    members = [n for n, v in vars(capability).items() if callable(v) and not n.startswith("_")]
    return type(f"Forwarded{capability.__name__}", (), {n: forward(n) for n in members})
