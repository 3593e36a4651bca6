"""A codec's round trip without a file: `Stored`, a reader over a dict of stored tensors, and `round_trip`, a tensor
encoded and decoded by the optimizer-moment codec of a quantization stage."""

from __future__ import annotations

import torch

from hf_unified_ckpt.format.codecs import MomentCodec
from hf_unified_ckpt.format.planning import TensorSpec


class Stored:
    """A reader over a dict of stored tensors (what a codec decodes from)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name):
        return self.tensors[name]

    def get_slice(self, name):
        return self.tensors[name]

    def specs(self):
        from hf_unified_ckpt.format.headers import safetensors_dtype

        return {n: (tuple(t.shape), safetensors_dtype(t.dtype)) for n, t in self.tensors.items()}


def round_trip(stage: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (optimizer state `key`) as it reads back after `MomentCodec(stage)` stored it."""
    codec = MomentCodec(stage)
    codec.stored_specs(TensorSpec(key, tuple(tensor.shape), tensor.dtype))
    return codec.decode(key, Stored(codec.encode(key, tensor)))
