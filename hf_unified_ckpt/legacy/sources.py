"""`TensorSource`: a `format.reader.TensorReader` over tensors computed on demand, so engines load from legacy
folders exactly as from unified ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..format.headers import safetensors_dtype
from ..format.reader import LoadedSlice, Specs, TensorReader

if TYPE_CHECKING:
    import torch


class TensorSource(TensorReader):
    """Named tensors, each produced by a loader when asked for (one tensor in memory at a time). A slice is computed
    whole, then indexed."""

    def __init__(self, entries: dict[str, tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]],
                 metadata: dict | None = None):
        self._entries = entries
        self.metadata = metadata or {}

    @classmethod
    def encoded(cls, encoder) -> "TensorSource":
        """The optimizer component an `optim_state.OptimizerStateEncoder` built from lazy `(shape, dtype, loader)`
        entries and in-memory tensors (encoded scalars)."""
        entries = {k: v if isinstance(v, tuple) else (tuple(v.shape), v.dtype, lambda v=v: v.detach().clone())
                   for k, v in encoder.entries.items()}
        return cls(entries, encoder.metadata())

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._entries[name][2]()
        except KeyError:
            raise KeyError(f"{name!r} is not in this checkpoint") from None

    def get_slice(self, name: str) -> LoadedSlice:
        return LoadedSlice(lambda: self.get(name))

    def specs(self) -> Specs:
        return {n: (tuple(shape), safetensors_dtype(dtype)) for n, (shape, dtype, _) in self._entries.items()}

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][1]

    def close(self) -> None:
        pass
