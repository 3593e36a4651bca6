"""Shard planning: which tensors go to which file, and which rank writes each file. Pure, deterministic.

Every rank computes the same plan from the same tensor specs, so no communication is needed to agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from huggingface_hub import split_state_dict_into_shards_factory

#: Below this many bytes per writer, splitting a component across ranks costs more than it saves.
MIN_PARALLEL_SHARD_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorSpec:
    """Name, full shape and dtype of one tensor, enough to plan without holding it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class ComponentPlan:
    """The files of one component (model, optimizer, ...) and their writers."""

    component: str
    filename_pattern: str
    files: dict[str, list[str]]  # file name -> tensor names, in write order
    owners: dict[str, int]  # file name -> writing rank
    total_size: int
    specs: dict[str, TensorSpec] = field(repr=False, default_factory=dict)
    file_stem: str = ""
    index_metadata: dict = field(repr=False, default_factory=dict)  # extra keys of the index file

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: file for file, names in self.files.items() for name in names}

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1


def target_shard_size(total_bytes: int, writers: int, max_shard_size: int,
                      min_parallel: int = MIN_PARALLEL_SHARD_BYTES) -> int:
    """Largest file size that still gives every writer a file, within [min_parallel, max_shard_size]."""
    per_writer = -(-total_bytes // max(writers, 1))
    return max(1, min(max_shard_size, max(per_writer, min_parallel)))


def assign_owners(file_sizes: dict[str, int], writers: int) -> dict[str, int]:
    """Largest file first, each to the least-loaded writer (ties to the lowest rank)."""
    load = [0] * max(writers, 1)
    owners = {}
    for name, size in sorted(file_sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += size
    return owners


def plan_component(component: str, specs: list[TensorSpec], writers: int, max_shard_size: int,
                   file_stem: str | None = None, min_parallel: int = MIN_PARALLEL_SHARD_BYTES,
                   owners: dict[str, int] | None = None) -> ComponentPlan:
    """Split `specs` (in their order) into files named like HF shards (`<stem>-0000k-of-0000n.safetensors`,
    or `<stem>.safetensors` for one file) and assign each file to a writer.

    `owners` pins tensors to the rank that holds them (sharded engines); the others are spread to balance
    bytes, then each rank's tensors are cut into files of at most `max_shard_size`."""
    stem = file_stem or component
    pattern = stem + "{suffix}.safetensors"
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs):
        raise ValueError(f"{component}: duplicate tensor names in the plan.")
    if owners:
        return _plan_pinned(component, specs, writers, max_shard_size, pattern, owners, stem)
    total = sum(s.nbytes for s in specs)
    split = split_state_dict_into_shards_factory(
        by_name, get_storage_size=lambda s: s.nbytes, filename_pattern=pattern,
        max_shard_size=target_shard_size(total, writers, max_shard_size, min_parallel),
    )
    files = {f: list(names) for f, names in split.filename_to_tensors.items()}
    if not files:  # a component with no tensors still gets one (empty) file, so it is self-describing
        files = {pattern.format(suffix=""): []}
    sizes = {f: sum(by_name[n].nbytes for n in names) for f, names in files.items()}
    return ComponentPlan(component, pattern, files, assign_owners(sizes, writers), total, by_name, stem)


def _plan_pinned(component: str, specs: list[TensorSpec], writers: int, max_shard_size: int, pattern: str,
                 owners: dict[str, int], stem: str) -> ComponentPlan:
    load = [0] * writers
    for s in specs:
        if s.name in owners:
            load[owners[s.name]] += s.nbytes
    rank_of = {}
    for s in specs:
        if s.name in owners:
            rank_of[s.name] = owners[s.name]
        else:
            rank_of[s.name] = min(range(writers), key=lambda r: (load[r], r))
            load[rank_of[s.name]] += s.nbytes
    chunks: list[tuple[int, list[str]]] = []
    for rank in range(writers):
        current, size = [], 0
        for s in (s for s in specs if rank_of[s.name] == rank):
            if current and size + s.nbytes > max_shard_size:
                chunks.append((rank, current))
                current, size = [], 0
            current.append(s.name)
            size += s.nbytes
        if current:
            chunks.append((rank, current))
    if not chunks:
        chunks = [(0, [])]
    n = len(chunks)
    names = [pattern.format(suffix="" if n == 1 else f"-{i + 1:05d}-of-{n:05d}") for i in range(n)]
    return ComponentPlan(component, pattern, {f: c for f, (_, c) in zip(names, chunks)},
                         {f: r for f, (r, _) in zip(names, chunks)}, sum(s.nbytes for s in specs),
                         {s.name: s for s in specs}, stem)
