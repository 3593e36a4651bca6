"""Shard planning: which tensors go to which file, and which rank writes each file. Pure, deterministic.

Every rank computes the same plan from the same tensor specs, so no communication is needed to agree.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from huggingface_hub import split_state_dict_into_shards_factory

from .headers import safetensors_dtype

if TYPE_CHECKING:
    import torch

#: Below this many bytes per writer, splitting a component across ranks costs more than it saves.
MIN_PARALLEL_SHARD_BYTES = 64 * 2**20


#: Who holds which contiguous part of a sharded tensor: ((rank, first element, element count), ...) in element
#: order, tiling the flattened tensor exactly. A tensor with pieces is written in place by its holders.
Pieces = tuple[tuple[int, int, int], ...]


class Encoder(Protocol):
    """The save side of a codec (`codecs.py`): what a logical tensor is stored as, known before any data (so every
    rank plans the same files), and the stored tensors made of it when it is written."""

    def stored_specs(self, spec: TensorSpec) -> list[TensorSpec]: ...

    def encode(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def metadata(self) -> dict: ...


class PiecewiseEncoder(Encoder, Protocol):
    """An encoder whose stored tensors can be written in place by the ranks holding the pieces of a logical tensor:
    `piecewise` is True. Its first stored tensor keeps the logical name. A code whose units cross pieces (O1/O2's
    blocks) also has `halo(name, first, values)` (what a rank shares of its piece when the save is planned) and
    `receive_halos(halos)` (every rank's), which `save.census_of_pieces` calls."""

    piecewise: bool

    def stored_pieces(self, name: str, pieces: Pieces) -> dict[str, Pieces] | None:
        """The pieces of each stored tensor of `name`, or None (the tensor is assembled and encoded whole)."""

    def encode_piece(self, name: str, values: torch.Tensor, start: int, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s pieces of the stored tensors of `name`, from its flat elements `values` starting at
        element `start`."""


def piecewise(codec: Encoder | None) -> bool:
    """Whether the tensors `codec` stores can be written in place piece by piece (always, without a codec)."""
    return codec is None or bool(getattr(codec, "piecewise", False))


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
    codec: Encoder | None = field(repr=False, default=None)  # how logical tensors are stored (None: as they are)
    stored: dict[str, list[TensorSpec]] = field(repr=False, default_factory=dict)  # logical name -> stored specs

    def stored_specs(self, name: str) -> list[TensorSpec]:
        """What logical tensor `name` is stored as (itself without a codec)."""
        return self.stored.get(name) or [self.specs[name]]

    @property
    def weight_map(self) -> dict[str, str]:
        """Stored tensor name -> file (the index's weight map: codes and scales included)."""
        return {s.name: file for file, names in self.files.items() for n in names for s in self.stored_specs(n)}

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
                   owners: dict[str, int] | None = None, codec: Encoder | None = None) -> ComponentPlan:
    """Split `specs` (in their order) into files named like HF shards (`<stem>-0000k-of-0000n.safetensors`,
    or `<stem>.safetensors` for one file) and assign each file to a writer.

    `owners` pins tensors to the rank that holds them (sharded engines); the others are spread to balance
    bytes, then each rank's tensors are cut into files of at most `max_shard_size`. With a `codec`, files are sized
    by the stored bytes, and a logical tensor's stored tensors (codes and scales) stay in one file."""
    stem = file_stem or component
    pattern = stem + "{suffix}.safetensors"
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs):
        raise ValueError(f"{component}: duplicate tensor names in the plan.")
    stored = {s.name: codec.stored_specs(s) for s in specs} if codec is not None else {}
    size = {s.name: sum(x.nbytes for x in stored.get(s.name, [s])) for s in specs}
    extra = {"specs": by_name, "file_stem": stem, "codec": codec, "stored": stored}
    if owners:
        files, file_owners = _plan_pinned(specs, size, writers, max_shard_size, pattern, owners)
        return ComponentPlan(component, pattern, files, file_owners, sum(size.values()), **extra)
    total = sum(size.values())
    split = split_state_dict_into_shards_factory(
        by_name, get_storage_size=lambda s: size[s.name], filename_pattern=pattern,
        max_shard_size=target_shard_size(total, writers, max_shard_size, min_parallel),
    )
    files = {f: list(names) for f, names in split.filename_to_tensors.items()}
    if not files:  # a component with no tensors still gets one (empty) file, so it is self-describing
        files = {pattern.format(suffix=""): []}
    sizes = {f: sum(size[n] for n in names) for f, names in files.items()}
    return ComponentPlan(component, pattern, files, assign_owners(sizes, writers), total, **extra)


def _plan_pinned(specs: list[TensorSpec], size: dict[str, int], writers: int, max_shard_size: int, pattern: str,
                 owners: dict[str, int]) -> tuple[dict[str, list[str]], dict[str, int]]:
    load = [0] * writers
    for s in specs:
        if s.name in owners:
            load[owners[s.name]] += size[s.name]
    rank_of = {}
    for s in specs:
        if s.name in owners:
            rank_of[s.name] = owners[s.name]
        else:
            rank_of[s.name] = min(range(writers), key=lambda r: (load[r], r))
            load[rank_of[s.name]] += size[s.name]
    chunks: list[tuple[int, list[str]]] = []
    for rank in range(writers):
        current, used = [], 0
        for s in (s for s in specs if rank_of[s.name] == rank):
            if current and used + size[s.name] > max_shard_size:
                chunks.append((rank, current))
                current, used = [], 0
            current.append(s.name)
            used += size[s.name]
        if current:
            chunks.append((rank, current))
    if not chunks:
        chunks = [(0, [])]
    n = len(chunks)
    names = [pattern.format(suffix="" if n == 1 else f"-{i + 1:05d}-of-{n:05d}") for i in range(n)]
    return {f: c for f, (_, c) in zip(names, chunks)}, {f: r for f, (r, _) in zip(names, chunks)}


@dataclass(frozen=True)
class WriteItem:
    """The bytes of one tensor (or of a part of it) in a file: `[start, end)` of the file's data section (after
    the header), written by `rank`. A part is the rank's own contiguous range of the flattened tensor."""

    name: str
    start: int
    end: int
    rank: int


@dataclass(frozen=True)
class FilePlan:
    """One file of the checkpoint, fixed before any byte is written: its component, its safetensors header
    (every tensor's dtype, shape and data offsets, in the order safetensors lays them out: wider dtypes first,
    then by name), the rank that writes the header and the write items that fill its data section."""

    component: str
    name: str
    tensor_names: tuple[str, ...]  # in the component plan's order (the order of collectives that assemble them)
    header_rank: int
    header: dict = field(repr=False)
    items: tuple[WriteItem, ...] = field(repr=False)
    codec: Encoder | None = field(repr=False, default=None)
    pieces: dict[str, Pieces] = field(repr=False, default_factory=dict)  # stored tensors written in place, by holder
    held: dict[str, Pieces] = field(repr=False, default_factory=dict)  # their logical tensors: every rank's elements

    def stored_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors to write for the logical `tensors` (name -> tensor): encoded by the codec, if any."""
        if self.codec is None:
            return tensors
        return {n: t for name, tensor in tensors.items() for n, t in self.codec.encode(name, tensor).items()}

    def pieces_held(self, rank: int) -> list[str]:
        """The logical tensors of which `rank` holds a non-empty piece written in place."""
        return [n for n in self.tensor_names if any(r == rank and count for r, _, count in self.held.get(n, ()))]

    def encoded(self, tensors: Mapping[str, torch.Tensor], rank: int) -> Mapping[str, torch.Tensor]:
        """What `rank` writes of this file, by stored name, from its logical `tensors` (its pieces of
        `pieces_held(rank)`, flat, and on the header rank the `whole_names`): `tensors` itself without a codec (a
        mapping that computes on access stays lazy), else encoded, its pieces piece by piece."""
        if self.codec is None:
            return tensors
        out = {}
        for name in self.pieces_held(rank):
            start = next(first for r, first, count in self.held[name] if r == rank and count)
            out.update(self.codec.encode_piece(name, _on_host(tensors[name]), start, rank))
        if rank == self.header_rank:
            out.update(self.stored_tensors({n: _on_host(tensors[n]) for n in self.whole_names}))
        return out

    @property
    def whole_names(self) -> tuple[str, ...]:
        """Logical tensors the header rank writes whole (assembled there first where they are sharded)."""
        return tuple(n for n in self.tensor_names if n not in self.held)

    def items_of(self, rank: int) -> list[WriteItem]:
        return [item for item in self.items if item.rank == rank]

    @property
    def writers(self) -> frozenset[int]:
        return frozenset(item.rank for item in self.items) | {self.header_rank}

    @property
    def data_bytes(self) -> int:
        return max((item.end for item in self.items), default=0)

    @property
    def header_bytes(self) -> bytes:
        """The file's first bytes: the header's length (8 bytes, little-endian) and the JSON header, padded with
        spaces to a multiple of 8 as safetensors pads it (so tensor data stays aligned)."""
        return header_bytes(self.header)

    @property
    def size(self) -> int:
        return len(self.header_bytes) + self.data_bytes


def file_plans(plan: ComponentPlan, pieces: dict[str, Pieces] | None = None) -> list[FilePlan]:
    """The files of a component plan with their headers and write items (stored tensors, after the codec). A
    tensor in `pieces` is written in place by its holders, each its own byte range (through a `piecewise` codec:
    each stored tensor's pieces); every other tensor whole by its file's owner. Pure: every rank computes the same
    list."""
    logical = pieces or {}
    stored = stored_pieces(plan, logical)
    out = []
    for file, names in plan.files.items():
        specs = [s for n in names for s in plan.stored_specs(n)]
        header, offsets = safetensors_header(specs)
        owner, items, mine = plan.owners[file], [], {}
        for s in specs:
            start, end = offsets[s.name]
            if s.name not in stored:
                items.append(WriteItem(s.name, start, end, owner))
                continue
            mine[s.name] = stored[s.name]
            items += [WriteItem(s.name, start + first * s.dtype.itemsize, start + (first + count) * s.dtype.itemsize,
                                rank) for rank, first, count in stored[s.name] if count]
        held = {n: logical[n] for n in names if n in stored}  # a stored tensor of each keeps its logical name
        out.append(FilePlan(plan.component, file, tuple(names), owner, header, tuple(items), plan.codec, mine, held))
    return out


def stored_pieces(plan: ComponentPlan, pieces: dict[str, Pieces]) -> dict[str, Pieces]:
    """`pieces` of logical tensors as pieces of the stored tensors (the same without a codec; none through a codec
    that is not piecewise)."""
    if plan.codec is None:
        return pieces
    if not piecewise(plan.codec):
        return {}
    return {stored: p for name, held in pieces.items() if name in plan.specs
            for stored, p in (plan.codec.stored_pieces(name, held) or {}).items()}


def tiling(numel: int, held: list[tuple[int, int, int]]) -> Pieces | None:
    """The pieces `held` ((rank, first element, count) from every rank) in element order if together they cover
    `[0, numel)` exactly once (empty ones dropped), else None (the tensor is assembled instead)."""
    parts = sorted((first, rank, count) for rank, first, count in held if count)
    end = 0
    for first, _, count in parts:
        if first != end:
            return None
        end += count
    return tuple((rank, first, count) for first, rank, count in parts) if numel and end == numel else None


def header_bytes(header: dict) -> bytes:
    """A safetensors file's first bytes for `header`: its length (8 bytes, little-endian) and the JSON, padded with
    spaces to a multiple of 8 as safetensors pads it."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def safetensors_header(specs: list[TensorSpec]) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The header `safetensors.torch.save_file` writes for these tensors (with `{"format": "pt"}` metadata; the same
    bytes, see `FilePlan.header_bytes`), and each tensor's byte range in the data section."""
    offsets, start = {}, 0
    ordered = sorted(specs, key=lambda s: (-s.dtype.itemsize, s.name))
    for spec in ordered:
        offsets[spec.name] = (start, start + spec.nbytes)
        start += spec.nbytes
    header = {s.name: {"dtype": safetensors_dtype(s.dtype), "shape": list(s.shape),
                       "data_offsets": list(offsets[s.name])} for s in ordered}  # in layout order, like safetensors
    return {"__metadata__": {"format": "pt"}, **header}, offsets


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU, where the codecs compute (a synchronous save hands them live device tensors)."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()
