"""Shard planning: which tensors go to which file, and which rank writes each file. Pure, deterministic.

Every rank computes the same plan from the same tensor specs, so no communication is needed to agree.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from huggingface_hub import split_state_dict_into_shards_factory

from .headers import safetensors_dtype

if TYPE_CHECKING:
    import torch

#: Below this many bytes per writer, splitting a component across ranks costs more than it saves.
MIN_PARALLEL_SHARD_BYTES = 64 * 2**20


#: Who holds which contiguous part of a sharded tensor: ((rank, first element, element count), ...) in element
#: order, tiling the flattened tensor exactly. A tensor with pieces is written in place by its holders. Either a
#: tuple (every rank's piece, from the census of pieces) or a closed form (`ClosedForm`: `Strided`, and what codecs
#: make of it: `Mapped`, `OwnOnly`), which answers for one rank in O(1) (`piece_of`) without listing the N pieces.
Pieces = tuple[tuple[int, int, int], ...]


class ClosedForm:
    """Base of the closed forms of `Pieces`: `of(rank)` answers for one rank in O(1), `holders()` lists the ranks
    holding a non-empty piece, without listing the pieces. A nominal base (not a protocol): the planning asks
    `isinstance` per piece per rank, where a runtime protocol's check would cost more than the answer."""

    __slots__ = ()

    def of(self, rank: int) -> tuple[int, int]:
        """(first element, count) `rank` holds (count 0: none)."""
        raise NotImplementedError

    def holders(self):
        """The ranks holding a non-empty piece, in element order."""
        raise NotImplementedError


class Strided(ClosedForm):
    """The pieces of a tensor of `numel` elements laid along a line split in runs of `size` elements, one run per
    rank in rank order, the tensor starting `shift` elements into the line: rank k holds elements
    `[k * size - shift, (k + 1) * size - shift)` of the tensor (clipped). ZeRO-3 and FSDP2's Shard(0) (shift 0),
    ZeRO-1/2 (the flat buffer of a parameter group, `shift` the parameter's offset in it). Iterates like `Pieces`:
    the non-empty pieces, in element order."""

    __slots__ = ("numel", "size", "shift")

    def __init__(self, numel: int, size: int, shift: int = 0):
        self.numel, self.size, self.shift = numel, size, shift

    def of(self, rank: int) -> tuple[int, int]:
        """(first element, count) `rank` holds (count 0: none)."""
        lo = max(0, rank * self.size - self.shift)
        hi = min(self.numel, (rank + 1) * self.size - self.shift)
        return (lo, hi - lo) if hi > lo else (0, 0)

    def holders(self) -> range:
        """The ranks holding a non-empty piece, in element order."""
        if not self.numel:
            return range(0)
        return range(self.shift // self.size, (self.shift + self.numel - 1) // self.size + 1)

    def rank_of(self, element: int) -> int:
        """The rank holding `element`."""
        return (element + self.shift) // self.size

    def majority(self) -> int:
        """The rank holding most elements (the lowest such rank on a tie): only the first, second and last holders
        can differ."""
        ranks = self.holders()
        return min({ranks[0], ranks[min(1, len(ranks) - 1)], ranks[-1]}, key=lambda r: (-self.of(r)[1], r))

    def __len__(self) -> int:
        return len(self.holders())

    def __iter__(self):
        return ((r, *self.of(r)) for r in self.holders())

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        r = self.holders()[i]
        return (r, *self.of(r))

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash((self.numel, self.size, self.shift))

    def __repr__(self) -> str:
        return f"Strided(numel={self.numel}, size={self.size}, shift={self.shift})"

    def __getstate__(self):
        return self.numel, self.size, self.shift

    def __setstate__(self, state):
        self.numel, self.size, self.shift = state


class Mapped(ClosedForm):
    """The pieces of a stored tensor made of a closed-form `base` (a codec's codes, scales...): rank r's piece is
    `fn(first, count)` of its piece of `base` (`Pieces` order: the base's)."""

    __slots__ = ("base", "fn")

    def __init__(self, base, fn):
        self.base, self.fn = base, fn

    def of(self, rank: int) -> tuple[int, int]:
        first, count = piece_of(self.base, rank)
        return self.fn(first, count) if count else (0, 0)

    def holders(self):
        return self.base.holders()

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self):
        return ((r, *self.fn(f, c)) for r, f, c in self.base)

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other)

    __hash__ = None

    def __getstate__(self):
        return self.base, self.fn

    def __setstate__(self, state):
        self.base, self.fn = state


class OwnOnly(ClosedForm):
    """A stored tensor's pieces where only this rank's is known (the residual's ties: each rank's offset is the sum
    of the ties of the ranks before it, `dist.exclusive_scan_ints`): `of(rank)` of another rank, and listing them,
    raise LookupError. A rank-local plan asks only for its own."""

    __slots__ = ("rank", "first", "count", "base")

    def __init__(self, rank: int, first: int, count: int, base):
        self.rank, self.first, self.count, self.base = rank, first, count, base

    def of(self, rank: int) -> tuple[int, int]:
        if rank != self.rank:
            raise LookupError(f"rank {self.rank}'s plan knows only its own piece of this tensor")
        return self.first, self.count

    def holders(self):
        return self.base.holders()

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self):
        raise LookupError(f"rank {self.rank}'s plan knows only its own piece of this tensor (a rank-local plan)")

    __hash__ = None

    def __getstate__(self):
        return self.rank, self.first, self.count, self.base

    def __setstate__(self, state):
        self.rank, self.first, self.count, self.base = state


def piece_of(pieces, rank: int) -> tuple[int, int]:
    """(first element, count) of `rank`'s piece in `pieces` (count 0: none): O(1) for a closed form, a scan of a
    tuple."""
    if isinstance(pieces, ClosedForm):
        return pieces.of(rank)
    return next(((first, count) for r, first, count in pieces if r == rank and count), (0, 0))


class Encoder(Protocol):
    """The save side of a codec (`codecs.py`): what a logical tensor is stored as, known before any data (so every
    rank plans the same files), and the stored tensors made of it when it is written."""

    def stored_specs(self, spec: TensorSpec) -> list[TensorSpec]: ...

    def encode(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def metadata(self) -> dict: ...


@runtime_checkable
class PiecewiseEncoder(Encoder, Protocol):
    """An encoder whose stored tensors can be written in place by the ranks holding the pieces of a logical tensor
    (`piecewise`). Its first stored tensor keeps the logical name. A code whose units cross pieces (O1/O2's
    blocks) is a `HaloEncoder`."""

    def stored_pieces(self, name: str, pieces: Pieces) -> dict[str, Pieces] | None:
        """The pieces of each stored tensor of `name`, or None (the tensor is assembled and encoded whole)."""

    def encode_piece(self, name: str, values: torch.Tensor, start: int, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s pieces of the stored tensors of `name`, from its flat elements `values` starting at
        element `start`."""


@runtime_checkable
class HaloEncoder(PiecewiseEncoder, Protocol):
    """A piecewise encoder whose units cross the ranks' pieces (O1/O2's blocks): each rank shares what the owner of
    a unit its piece starts in needs (`halo`, or point to point: `rule_plan.exchange_halos`), and every rank is
    given the halos before it encodes (`receive_halos`)."""

    def halo(self, name: str, first: int, values: torch.Tensor) -> torch.Tensor | None:
        """What this rank shares of its piece of `name` (elements from `first`), or None."""

    def receive_halos(self, halos: Mapping[str, Mapping[int, torch.Tensor]]) -> None:
        """Every rank's halos, by tensor and first element."""


def piecewise(codec: Encoder | None) -> bool:
    """Whether the tensors `codec` stores can be written in place piece by piece (always, without a codec)."""
    return codec is None or isinstance(codec, PiecewiseEncoder)


class TensorSpec(NamedTuple):
    """Name, full shape and dtype of one tensor, enough to plan without holding it (a named tuple: the adapters make
    one per tensor per component and question, thousands per save, and a frozen dataclass costs several times more
    to make)."""

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
    """Largest file first, each to the least-loaded writer (ties to the lowest rank): O(F log N) with a heap of
    the writers by (load, rank); a writer with no file yet is taken from a counter, not listed."""
    load = _Loads(max(writers, 1))
    owners = {}
    for name, size in sorted(file_sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        owners[name] = load.take(size)
    return owners


class _Loads:
    """The least-loaded of `n` writers (ties to the lowest rank), O(log) per take: the writers with no load yet
    are ranks `fresh..n-1` (the lowest first), the others in a heap of (load, rank)."""

    def __init__(self, n: int, loads: dict[int, int] | None = None):
        self.n, self.heap = n, [(v, r) for r, v in (loads or {}).items()]
        heapq.heapify(self.heap)
        self.used = set(loads or ())
        self.fresh = 0

    def _next_fresh(self) -> int | None:
        while self.fresh < self.n and self.fresh in self.used:
            self.fresh += 1
        return self.fresh if self.fresh < self.n else None

    def take(self, size: int) -> int:
        fresh = self._next_fresh()
        if fresh is not None and (not self.heap or (0, fresh) < self.heap[0]):
            self.used.add(fresh)
            heapq.heappush(self.heap, (size, fresh))
            return fresh
        load, rank = heapq.heappop(self.heap)
        heapq.heappush(self.heap, (load + size, rank))
        return rank


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
    pinned: dict[int, int] = {}
    for s in specs:
        if s.name in owners:
            pinned[owners[s.name]] = pinned.get(owners[s.name], 0) + size[s.name]
    load = _Loads(writers, pinned)
    rank_of = {}
    for s in specs:
        rank_of[s.name] = owners[s.name] if s.name in owners else load.take(size[s.name])
    by_rank: dict[int, list[TensorSpec]] = {}
    for s in specs:
        by_rank.setdefault(rank_of[s.name], []).append(s)
    chunks: list[tuple[int, list[str]]] = []
    for rank in sorted(by_rank):
        current, used = [], 0
        for s in by_rank[rank]:
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


_MISSING = object()
#: The keys of `FilePlan._mine`'s answers, (question, rank), one object each.
_KEYS: dict[tuple[str, int], tuple[str, int]] = {}


class once:
    """A property worked out on first access and kept in the instance's `_cache` dict (a field of its own): what
    `functools.cached_property` does, without its lock (Python 3.11 takes one per first access, a few microseconds
    on each of the thousands of file plans a save makes) and without the instance's `__dict__` (asking for it makes
    one, about 500 bytes per file plan, where the fields are otherwise kept inline). Two threads that race compute
    the same value twice."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        cache = instance._cache
        value = cache.get(self.name, _MISSING)
        if value is _MISSING:
            value = cache[self.name] = self.fn(instance)
        return value



@dataclass(frozen=True)
class FilePlan:
    """One file of the checkpoint, fixed before any byte is written: its component, its safetensors header
    (every tensor's dtype, shape and data offsets, in the order safetensors lays them out: wider dtypes first,
    then by name), the rank that writes the header and the write items that fill its data section.

    The items are held compactly (`layout`: per stored tensor its byte range, and its pieces where it is written in
    place), so that a rank asks for its own (`items_of`, `writes`, `pieces_held`) in O(tensors of the file) even
    when the pieces are a closed form over N ranks; `items` and `writers` list every rank's (O(N) per tensor)."""

    component: str
    name: str
    tensor_names: tuple[str, ...]  # in the component plan's order (the order of collectives that assemble them)
    header_rank: int
    header: dict = field(repr=False)
    #: (stored name, first byte, end byte, element size, its pieces or None: written whole by the header rank), in
    #: the component plan's order.
    layout: tuple[tuple[str, int, int, int, object], ...] = field(repr=False)
    codec: Encoder | None = field(repr=False, default=None)
    pieces: dict[str, Pieces] = field(repr=False, default_factory=dict)  # stored tensors written in place, by holder
    held: dict[str, Pieces] = field(repr=False, default_factory=dict)  # their logical tensors: every rank's elements
    #: What was worked out of this plan: the `once` answers by name, `_mine`'s by (question, rank).
    _cache: dict = field(repr=False, init=False, compare=False, default_factory=dict)

    def stored_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors to write for the logical `tensors` (name -> tensor): encoded by the codec, if any."""
        if self.codec is None:
            return tensors
        return {n: t for name, tensor in tensors.items() for n, t in self.codec.encode(name, tensor).items()}

    def _mine(self, kind: str, rank: int, work):
        """`work(rank)`, worked out once per file plan and rank (a rank asks for its own: a plan reused by later
        saves answers from it; `with_codec` keeps it)."""
        cache, key = self._cache, (kind, rank)
        key = _KEYS.setdefault(key, key)  # one key object for every file plan (thousands per save)
        found = cache.get(key, _MISSING)
        if found is _MISSING:
            found = cache[key] = work(rank)
        return found

    def pieces_held(self, rank: int) -> list[str]:
        """The logical tensors of which `rank` holds a non-empty piece written in place."""
        return list(self._mine("held", rank, self._pieces_held))

    def _pieces_held(self, rank: int) -> tuple[str, ...]:
        held = self.held
        return tuple(n for n in self.tensor_names if n in held and piece_of(held[n], rank)[1])

    def first_held(self, name: str, rank: int) -> tuple[int, int]:
        """(first element, count) of `rank`'s piece of logical tensor `name` (written in place)."""
        return piece_of(self.held[name], rank)

    def encoded(self, tensors: Mapping[str, torch.Tensor], rank: int) -> Mapping[str, torch.Tensor]:
        """What `rank` writes of this file, by stored name, from its logical `tensors` (its pieces of
        `pieces_held(rank)`, flat, and on the header rank the `whole_names`): `tensors` itself without a codec (a
        mapping that computes on access stays lazy), else encoded, its pieces piece by piece."""
        if self.codec is None:
            return tensors
        out = {}
        for name in self.pieces_held(rank):
            start = self.first_held(name, rank)[0]
            out.update(self.codec.encode_piece(name, _on_host(tensors[name]), start, rank))
        if rank == self.header_rank:
            out.update(self.stored_tensors({n: _on_host(tensors[n]) for n in self.whole_names}))
        return out

    @once
    def whole_names(self) -> tuple[str, ...]:
        """Logical tensors the header rank writes whole (assembled there first where they are sharded)."""
        return tuple(n for n in self.tensor_names if n not in self.held)

    def items_of(self, rank: int) -> list[WriteItem]:
        """`rank`'s write items, in the component plan's order: O(tensors of the file), once per rank."""
        return list(self._mine("items", rank, self._items_of))

    def _items_of(self, rank: int) -> tuple[WriteItem, ...]:
        out = []
        for name, start, end, itemsize, pieces in self.layout:
            if pieces is None:
                if rank == self.header_rank:
                    out.append(WriteItem(name, start, end, rank))
                continue
            first, count = piece_of(pieces, rank)
            if count:
                out.append(WriteItem(name, start + first * itemsize, start + (first + count) * itemsize, rank))
        return tuple(out)

    def writes(self, rank: int) -> bool:
        """Whether `rank` writes any byte of this file (its header, or a piece)."""
        return rank == self.header_rank or self._mine("writes", rank, self._writes)

    def _writes(self, rank: int) -> bool:
        return any(piece_of(p, rank)[1] for *_, p in self.layout if p is not None)

    def writes_alone(self, rank: int) -> bool:
        """Whether `rank` writes every byte of this file (no other rank writes any)."""
        return rank == self.header_rank and all(
            len(h) == 0 or (len(h) == 1 and h.holders()[0] == rank) if isinstance(h, ClosedForm)
            else {r for r, _, c in h if c} <= {rank} for h in self.held.values())

    def with_codec(self, codec: Encoder) -> "FilePlan":
        """This file with another codec object of the same plan (a later save's halos), its header kept."""
        out = dataclasses.replace(self, codec=codec)
        out._cache.update(self._cache)
        out._cache["header_bytes"] = self.header_bytes
        return out

    def with_pieces(self, codec: Encoder, stored: dict[str, Pieces]) -> "FilePlan":
        """This file with another codec object and its stored tensors' pieces taken from `stored` (a later save of
        the same stored shapes: the residual's ties, laid out anew), its header kept."""
        layout = tuple((n, a, b, size, stored[n] if p is not None else None) for n, a, b, size, p in self.layout)
        out = dataclasses.replace(self, codec=codec, layout=layout,
                                  pieces={n: stored[n] for n in self.pieces})
        out._cache.update(header_bytes=self.header_bytes, data_bytes=self.data_bytes)
        return out

    @once
    def items(self) -> tuple[WriteItem, ...]:
        """Every rank's write items (O(N) per tensor written in place: for multipart plans and checks)."""
        out = []
        for name, start, end, itemsize, pieces in self.layout:
            if pieces is None:
                out.append(WriteItem(name, start, end, self.header_rank))
                continue
            out += [WriteItem(name, start + first * itemsize, start + (first + count) * itemsize, rank)
                    for rank, first, count in pieces if count]
        return tuple(out)

    @property
    def writers(self) -> frozenset[int]:
        return frozenset(item.rank for item in self.items) | {self.header_rank}

    @once
    def data_bytes(self) -> int:
        return max((end for _, _, end, _, _ in self.layout), default=0)

    @once
    def header_bytes(self) -> bytes:
        """The file's first bytes: the header's length (8 bytes, little-endian) and the JSON header, padded with
        spaces to a multiple of 8 as safetensors pads it (so tensor data stays aligned)."""
        return header_bytes(self.header)

    @property
    def size(self) -> int:
        return len(self.header_bytes) + self.data_bytes


def file_plans(plan: ComponentPlan, pieces: dict[str, Pieces] | None = None) -> list[FilePlan]:
    """The files of a component plan with their headers and write items (stored tensors, after the codec). A
    tensor in `pieces` is written in place by its holders, each its own byte range (through a `PiecewiseEncoder`:
    each stored tensor's pieces); every other tensor whole by its file's owner. Pure: every rank computes the same
    list; O(tensors) whatever the number of ranks when the pieces are closed forms."""
    logical = pieces or {}
    stored = stored_pieces(plan, logical)
    out = []
    for file, names in plan.files.items():
        specs = [s for n in names for s in plan.stored_specs(n)]
        header, offsets = safetensors_header(specs)
        owner, layout, mine = plan.owners[file], [], {}
        for s in specs:
            start, end = offsets[s.name]
            held = stored.get(s.name)
            if held is not None:
                mine[s.name] = held
            layout.append((s.name, start, end, s.dtype.itemsize, held))
        held = {n: logical[n] for n in names if n in stored}  # a stored tensor of each keeps its logical name
        out.append(FilePlan(plan.component, file, tuple(names), owner, header, tuple(layout), plan.codec, mine, held))
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


#: One encoder for every header (`json.dumps` with separators makes one per call).
_HEADER_JSON = json.JSONEncoder(separators=(",", ":"))


def header_bytes(header: dict) -> bytes:
    """A safetensors file's first bytes for `header`: its length (8 bytes, little-endian) and the JSON, padded with
    spaces to a multiple of 8 as safetensors pads it."""
    raw = _HEADER_JSON.encode(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def safetensors_header(specs: list[TensorSpec]) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The header `safetensors.torch.save_file` writes for these tensors (with `{"format": "pt"}` metadata; the same
    bytes, see `FilePlan.header_bytes`), and each tensor's byte range in the data section."""
    offsets, start = {}, 0
    header = {"__metadata__": {"format": "pt"}}
    ordered = sorted(specs, key=_layout_order) if len(specs) > 1 else specs
    for spec in ordered:  # in layout order, like safetensors
        end = start + spec.nbytes
        offsets[spec.name] = (start, end)
        header[spec.name] = {"dtype": _dtype_name(spec.dtype), "shape": list(spec.shape), "data_offsets": [start, end]}
        start = end
    return header, offsets


def _layout_order(spec: TensorSpec) -> tuple[int, str]:
    """safetensors' order of a file's tensors: wider dtypes first, then by name."""
    return -spec.dtype.itemsize, spec.name


#: torch dtype -> its safetensors name, as met (`safetensors_dtype` per tensor is a string operation).
_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = safetensors_dtype(dtype)
    return name


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU, where the codecs compute (a synchronous save hands them live device tensors)."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()
