"""The seam between the save/load algorithms and a training engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..planning import TensorSpec

MODEL, MASTER, OPTIMIZER = "model", "master_weights", "optimizer"


class EngineAdapter(Protocol):
    """What the save and load algorithms need from an engine.

    `components`, `specs` and `optimizer_metadata` are identical on every rank, so every rank computes the
    same plan. `preferred_owners` and `exchange` (which assembles one file's tensors on the rank `owner` that
    writes it) may be collectives on sharded engines: all ranks call them in the same order. After `exchange`,
    `tensors` only reads what this rank holds, and may run in a writer thread.
    """

    engine: str

    def saved_by(self) -> dict: ...

    def components(self) -> list[str]: ...

    def file_stem(self, component: str) -> str: ...

    def specs(self, component: str) -> list[TensorSpec]: ...

    def preferred_owners(self, component: str) -> dict[str, int]: ...

    def exchange(self, component: str, names: Sequence[str], owner: int) -> None: ...

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]: ...

    def optimizer_metadata(self) -> dict: ...

    def write_configs(self, folder) -> None: ...

    def load(self, sources) -> None: ...
