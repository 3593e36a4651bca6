"""The seam between the save/load algorithms and a training engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..planning import TensorSpec
from ..storage.safetensors_io import ComponentReader

MODEL, OPTIMIZER = "model", "optimizer"


class EngineAdapter(Protocol):
    """What the save and load algorithms need from an engine.

    `specs` and `optimizer_metadata` are identical on every rank (plans are computed locally from them).
    `tensors` may be a collective on sharded engines: then all ranks call it with the same arguments order.
    """

    engine: str

    def saved_by(self) -> dict: ...

    def file_stem(self, component: str) -> str: ...

    def specs(self, component: str) -> list[TensorSpec]: ...

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]: ...

    def optimizer_metadata(self) -> dict: ...

    def write_configs(self, folder) -> None: ...

    def load_model(self, reader: ComponentReader) -> None: ...

    def load_optimizer(self, reader: ComponentReader) -> None: ...
