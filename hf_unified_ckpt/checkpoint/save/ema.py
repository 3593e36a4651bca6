"""Exponential moving average (EMA) of the weights, kept per rank and saved as the `ema` component.

Each rank averages only what it holds of the fp32 values the optimizer updates: DeepSpeed's fp32 master fragments
or partitions, FSDP2's local rows, or (one process, DDP) whole parameters. An engine describes what it holds as
`Fragment`s (elements `[start, start + numel)` of a flattened full tensor) through `parameter_fragments()`; the
average is fp32, started from the weights at its first update (so no bias correction is needed), and updated as
`ema = decay * ema + (1 - decay) * weights` every `interval` optimizer steps, off the training thread
(`BackgroundUpdates`). What a checkpoint at step N holds is the average after the last update at or before N (a
save before the first update starts the average from the weights there). `EmaRun` is one `train()` call's EMA: the
average, its background updates, and when they are due.

`WithEma` wraps an engine adapter so that the save and load algorithms see one more component, keyed like the
model weights: on save into a shared folder each rank writes its own ranges in place (`fragments`); into
machine-local folders each tensor is assembled on its writer by a sum of the ranks' zero-padded fragments (no
communication when every rank holds it whole); on load each rank reads only its ranges.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from ... import dist
from ...format.components import EMA, Component
from ...engines.base import AdapterWrapper, Fragment, LoadSources, ParameterRule, PartitionRule
from ...errors import UnsupportedCheckpointError, count_and_first
from .persist import Background
from .snapshot import HostBuffers
from ...format.planning import TensorSpec
from ...format.reader import read_flat_range

logger = logging.getLogger(__name__)


class ExponentialAverage:
    """This rank's part of the EMA (fp32, on the host), by saved parameter name."""

    def __init__(self, decay: float, interval: int = 1):
        self.decay, self.interval = decay, interval
        self.parts: dict[str, Fragment] = {}

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def update(self, fragments: Mapping[str, Fragment]) -> None:
        """Fold in the current values; the first update (or a parameter seen for the first time) copies them."""
        with torch.no_grad():
            for name, frag in fragments.items():
                part = self.parts.get(name)
                values = frag.values.detach().reshape(-1)
                if part is None:
                    self.parts[name] = replace(frag, values=values.to("cpu", torch.float32, copy=True))
                else:
                    part.values.mul_(self.decay).add_(values.to(torch.float32), alpha=1 - self.decay)

    def load(self, reader, fragments: Mapping[str, Fragment]) -> None:
        """Read this rank's ranges of every fragment from the `ema` component `reader`."""
        missing = sorted(set(fragments) - set(reader.keys()))
        if missing:
            raise UnsupportedCheckpointError(f"the checkpoint's EMA has no average for {count_and_first(missing)}; "
                                             "it was saved for another model or set of trainable parameters.")
        self.parts = {}
        for name, frag in fragments.items():
            values = read_flat_range(reader, name, frag.shape, frag.start, frag.values.numel())
            self.parts[name] = replace(frag, values=values.to(torch.float32).clone())


class BackgroundUpdates:
    """Runs the updates of an `ExponentialAverage` off the training thread, the way an async save takes its
    snapshot (`persist.Background` over `persist.HostBuffers`): `submit` starts a thread that copies the fragments
    into reused host buffers, signals the copy done, then folds the copy into the average at low CPU priority. The
    next optimizer step waits only for the copy (`wait_for_snapshot`); a save waits for the whole update (`wait`),
    which also raises an update's error."""

    def __init__(self, average: ExponentialAverage):
        self.average = average
        self._buffers = HostBuffers()
        self._background = Background("ema", self._buffers.transfers)

    def submit(self, fragments: Mapping[str, Fragment]) -> None:
        """Start one update from `fragments` (live views), after the previous one finished."""
        self.wait()
        self._background.start(lambda: self._copy(fragments), self.average.update)

    def _copy(self, fragments: Mapping[str, Fragment]) -> dict[str, Fragment]:
        return {name: replace(frag, values=self._buffers.copy(name, frag.values, torch.float32, flat=True))
                for name, frag in fragments.items()}

    def wait_for_snapshot(self) -> None:
        """Block until the update in flight has copied the weights (call before the optimizer changes them)."""
        self._background.wait_for_snapshot()

    def wait(self) -> None:
        """Block until the update in flight is folded in; raise its error, if any."""
        try:
            self._background.wait()
        except BaseException as error:
            raise RuntimeError(f"updating the EMA of the weights failed: {error}") from error


class _EmaPartitionRule:
    """`WithEma`'s `PartitionRule`, where the engine has one."""

    def partition_rule(self, component: str, names=None) -> tuple[dict | None, str]:
        """The engine's (`saving.plan_save`); for EMA, the layout of the parameters the averages follow (the engine's
        `parameter_rule`), restricted to the averages not held whole. Local."""
        if component != EMA.name:
            return self.inner.partition_rule(component, names)
        if not isinstance(self.inner, ParameterRule):
            return None, f"{type(self.inner).__name__} has no parameter rule for its EMA"
        rule, why = self.inner.parameter_rule()
        if rule is None:
            return None, why
        parts = self._average.parts
        return {n: s for n, s in rule.items() if n in parts and not parts[n].replicated}, why


class WithEma(AdapterWrapper):
    """An engine adapter plus the `ema` component (see the module docstring); everything else is the engine's
    (`inner`), its optional capabilities included (`engines.base.AdapterWrapper`)."""

    own_capabilities = {PartitionRule: _EmaPartitionRule}

    def __init__(self, engine, average: ExponentialAverage, load_average: bool = True):
        super().__init__(engine)
        self._average, self._load_average = average, load_average
        self._cache: dict[str, torch.Tensor] = {}

    def components(self) -> list[Component]:
        own = self.inner.components()
        return own + [EMA] if self._average.parts else own

    def specs(self, component: str) -> list[TensorSpec]:
        if component != EMA.name:
            return self.inner.specs(component)
        return [TensorSpec(n, tuple(f.shape), torch.float32) for n, f in self._average.parts.items()]

    def preferred_owners(self, component: str) -> dict[str, int]:
        return {} if component == EMA.name else self.inner.preferred_owners(component)

    def exchange(self, component: str, names: Sequence[str], owner: int) -> None:
        """The engine's exchange; for EMA, each sharded tensor is summed from the ranks' zero-padded fragments into
        `owner`. Collective: all ranks must call it, in the same order."""
        if component != EMA.name:
            return self.inner.exchange(component, names, owner)
        for name in names:
            part = self._average.parts[name]
            if part.replicated:
                continue
            full = torch.zeros(math.prod(part.shape), dtype=torch.float32)
            full[part.start:part.start + part.values.numel()] = part.values
            dist.reduce_to(full, owner)
            if dist.rank() == owner:
                self._cache[name] = full.view(part.shape)

    def fragments(self, component: str, names: Sequence[str] | None = None) -> dict[str, Fragment]:
        """The engine's; for EMA, this rank's part of every average not held whole by every rank. Local."""
        if component != EMA.name:
            return self.inner.fragments(component, names)
        parts = self._average.parts
        return {n: parts[n] for n in (parts if names is None else names) if not parts[n].replicated}

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        if component != EMA.name:
            return self.inner.tensors(component, names)
        parts = self._average.parts
        return {n: self._cache.pop(n) if n in self._cache else parts[n].values.view(parts[n].shape) for n in names}

    def load(self, sources: LoadSources) -> None:
        """The engine's load; then this rank's EMA ranges (on a resume: when the optimizer is loaded too)."""
        readers = dict(sources.readers)
        reader = readers.pop(EMA.name, None)
        self.inner.load(LoadSources(readers, sources.global_step))
        if reader is not None and self._load_average and sources.readers.get("optimizer") is not None:
            self._average.load(reader, self.inner.parameter_fragments())


class EmaRun:
    """The EMA of the weights during one `train()` call: the average (`checkpoint.save.ema`), its updates in the
    background, and this rank's weight fragments folded into it (`fragments` asked for once)."""

    def __init__(self, average: ExponentialAverage, fragments: Callable[[], dict]):
        self.average = average
        self.updates = BackgroundUpdates(average)
        self._fragments_of = fragments
        self._fragments: dict | None = None

    def fragments(self) -> dict:
        if self._fragments is None:
            self._fragments = self._fragments_of()
        return self._fragments

    def after_step(self, step: int) -> None:
        """Start folding this rank's weights into the average, in the background, when an update is due after
        optimizer step `step`. Local only."""
        if self.average.due(step):
            self.updates.submit(self.fragments())

    def ready(self) -> None:
        """Before a save: the update in flight is folded in; a save before the first update starts the average
        from the weights there. Local only."""
        self.updates.wait()
        if not self.average.parts:
            self.average.update(self.fragments())

    def wait_for_snapshot(self) -> None:
        """Before an optimizer step: the update in flight has copied the weights. Local only."""
        self.updates.wait_for_snapshot()

    def wait(self) -> None:
        """The update in flight is done; its error raised. Local only."""
        self.updates.wait()
