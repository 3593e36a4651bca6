"""DeepSpeed AutoTP: where each tensor-parallel parameter's local shard lies in its full tensor.

AutoTP (`tensor_parallel.autotp_size` in the DeepSpeed config, ZeRO stage 1 or 2) replaces the linears it shards by
its own layers (`LinearLayer`: rows, `LinearAllreduce`: columns, the vocabulary-parallel head), whose parameters
are plain tensors holding this rank's slice under the full name; ZeRO then partitions those slices over the
data-parallel group. Each sharded parameter carries DeepSpeed's own description of its split
(`deepspeed.module_inject.layers.DS_AUTOTP_UC_META`: the dimension, the full shape, every rank's size along it),
which is all the unified save and load need: a `TPSplit` per parameter, read from it once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UnsupportedCheckpointError
from .base import Fragment


@dataclass(frozen=True)
class TPSplit:
    """One parameter split along `dim` over the tensor-parallel ranks: `sizes[r]` slices of the full tensor of
    shape `shape` lie on TP rank r, in order; this rank is TP rank `index`."""

    dim: int
    sizes: tuple[int, ...]
    index: int
    shape: tuple[int, ...]

    @property
    def offset(self) -> int:
        return sum(self.sizes[:self.index])

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[self.index] if d == self.dim else n for d, n in enumerate(self.shape))

    def globalize(self, piece: Fragment) -> Fragment | None:
        """`piece` (a range of the flattened local shard) as a range of the flattened full tensor: possible when
        the split is along dim 0 (whole rows), None otherwise (columns interleave; the tensor is gathered)."""
        if self.dim != 0:
            return None
        row = math.prod(self.shape[1:])
        return Fragment(self.shape, self.offset * row + piece.start, piece.values)


def autotp_splits(named: Sequence[tuple[str, torch.nn.Parameter]], tp_index: int) -> dict[str, TPSplit]:
    """The `TPSplit` of every parameter AutoTP shards (replicated ones, such as norms, embeddings and row-parallel
    biases, are absent); refuses layouts whose local shard is not one slice of the full tensor. Local only."""
    from deepspeed.module_inject.layers import DS_AUTOTP_UC_META

    out = {}
    for name, p in named:
        meta = getattr(p, DS_AUTOTP_UC_META, None)
        if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
            continue
        if meta.get("sub_param_shard_widths") or meta.get("unsupported_reason"):
            raise UnsupportedCheckpointError(
                f"DeepSpeed AutoTP shards {name!r} as sub-parameters (a fused projection such as qkv_proj: "
                f"{meta.get('unsupported_reason') or 'each part split separately'}); unified checkpoints support "
                "AutoTP layers whose shard is one slice of the full tensor. Use a model with separate q/k/v "
                "projections, or transformers' tensor parallelism.")
        split = TPSplit(int(meta["partition_dim"]), tuple(int(s) for s in meta["partition_sizes"]), tp_index,
                        tuple(int(n) for n in meta["logical_shape"]))
        if tuple(p.shape) != split.local_shape:
            raise UnsupportedCheckpointError(
                f"DeepSpeed AutoTP describes {name!r} as {split.sizes} slices of {split.shape} along dim "
                f"{split.dim}, but TP rank {tp_index} holds {tuple(p.shape)}, not {split.local_shape}.")
        out[name] = split
    return out


def gather_split(local: torch.Tensor, split: TPSplit, group) -> torch.Tensor:
    """The full tensor from every TP rank's slice `local` (each padded to the largest slice for gloo's equal-size
    all-gather). Collective over the tensor-parallel `group`: all its ranks must call it."""
    import torch.distributed as tdist

    padded_shape = list(split.local_shape)
    padded_shape[split.dim] = max(split.sizes)
    padded = local.new_zeros(padded_shape)
    padded.narrow(split.dim, 0, local.shape[split.dim]).copy_(local)
    pieces = [torch.empty_like(padded) for _ in split.sizes]
    tdist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([t.narrow(split.dim, 0, n) for t, n in zip(pieces, split.sizes)], dim=split.dim)


def read_split_range(reader, name: str, split: TPSplit, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of this rank's flattened slice of tensor `name`, reading only the rows of
    the full tensor that cover them (rows: dim 0 of the full tensor, which the slice shares unless split there)."""
    from ..format.reader import read_flat_range

    row = math.prod(split.shape[1:])
    if split.dim == 0:
        return read_flat_range(reader, name, split.shape, split.offset * row + start, count)
    local_row = math.prod(split.local_shape[1:])
    first, last = start // local_row, -(-(start + count) // local_row)
    rows = read_flat_range(reader, name, split.shape, first * row, (last - first) * row)
    local = rows.view(last - first, *split.shape[1:]).narrow(split.dim, split.offset, split.sizes[split.index])
    begin = start - first * local_row
    return local.reshape(-1)[begin:begin + count]
