"""`TensorSource`: the read interface of `storage.safetensors_io.ComponentReader` over tensors computed on
demand, so engines load from legacy folders exactly as from unified ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                torch.bool: "BOOL", torch.float64: "F64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8"}


class _Rows:
    def __init__(self, load: Callable[[], torch.Tensor]):
        self._load = load

    def __getitem__(self, index):
        return self._load()[index]


class TensorSource:
    """Named tensors, each produced by a loader when asked for (one tensor in memory at a time)."""

    def __init__(self, entries: dict[str, tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]],
                 metadata: dict | None = None):
        self._entries = entries
        self.metadata = metadata or {}

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._entries[name][2]()
        except KeyError:
            raise KeyError(f"{name!r} is not in this checkpoint") from None

    def get_slice(self, name: str) -> _Rows:
        return _Rows(lambda: self.get(name))

    def specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(shape), _DTYPE_NAMES[dtype]) for n, (shape, dtype, _) in self._entries.items()}

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][1]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
