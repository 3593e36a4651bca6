"""Codecs: how a component's logical tensors are stored in fewer bytes, and read back. Pure (torch only, no I/O).

Two codecs, each self-describing through the component's index metadata (`"codec"`), so a reader rebuilds the
logical tensors from what the folder says, not from the options of the run that reads it:

- `MomentCodec` (`ckpt_quant_stage` O1 / O2): optimizer moments as 8-bit or 4-bit (two per byte) codes with one
  fp32 scale per block of `BLOCK_SIZE` consecutive elements of the flattened tensor. Signed moments (Adam's
  `exp_avg`) are normalised by the block's largest magnitude and mapped to the nearest entry of a signed code
  book; second moments (`exp_avg_sq`) are stored through their square root, normalised by its block maximum and
  mapped to a code book *without zero*, so a non-zero `v` never decodes to 0 (the "zero-point problem": Adam's
  `m / (sqrt(v) + eps)` would explode). Code books are grids (`Grid`) written into the metadata. Why these choices:
  `bench/codec_choice.py` and the README.
- `ResidualCodec` (`residual_master_weight`): fp32 master weights stored as the 16-bit difference between their
  bits and the bits of their bf16 rounding, which the model files already hold: `master = bf16 << 16 + d`. The
  difference fits 16 bits except for exact ties rounded down (`d == 32768`, about 1 value in 130,000), listed by
  flat index. Exact by construction, and checked on every tensor before it is written.

Stored names: the codes (or the residual) keep the logical name; auxiliary tensors add a suffix (`:scales`,
`:ties`) and are never shown to an engine (`format.reader.LogicalReader`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .planning import ClosedForm, Mapped, OwnOnly, TensorSpec
from .headers import TORCH_DTYPE_NAMES, safetensors_dtype
from .state_shapes import (MOMENT_CODEC, RESIDUAL_CODEC, SCALES, SIGNED_MOMENTS, SQRT_MOMENTS, STAGE_BITS, TIES,
                           Problems, codec_metadata_problems, codec_stored_problems)

BLOCK_SIZE = 128
# The optimizer state names that are moments (`SIGNED_MOMENTS`, `SQRT_MOMENTS`: coded signed, or through the square
# root) and the stored names' suffixes live in `state_shapes`, which `verify` reads without torch. Any other state
# (step counts, Adamax's `exp_inf`...) stays exact.

@dataclass(frozen=True)
class Grid:
    """A code book whose entries are `sign(t) * |t| ** power` for `t = first + k * step`, k = 0 .. count - 1: codes
    are computed by arithmetic (nearest t after taking the power's root), not by a search, and decoded likewise."""

    first: float
    step: float
    count: int
    power: int = 1

    def values(self) -> list[float]:
        ts = [self.first + k * self.step for k in range(self.count)]
        return [math.copysign(abs(t) ** self.power, t) for t in ts]

    def as_dict(self) -> dict:
        return {"first": self.first, "step": self.step, "count": self.count, "power": self.power}


#: Code books by (kind, bits), values in [-1, 1] (signed) or (0, 1] (sqrt: no zero; the top value is 1 so a block's
#: largest element is exact). 8-bit: uniform. 4-bit: squares of a uniform grid, dense near zero where most of a
#: block's values are (signed: 15 levels, 0 and +-1 exact; square roots: a 256:1 range instead of 16:1).
CODE_BOOKS: dict[tuple[str, int], Grid] = {
    ("signed", 8): Grid(-1.0, 1 / 127, 255),
    ("sqrt", 8): Grid(1 / 256, 1 / 256, 256),
    ("signed", 4): Grid(-1.0, 1 / 7, 15, power=2),
    ("sqrt", 4): Grid(1 / 16, 1 / 16, 16, power=2),
}

def moment_kind(key: str) -> str | None:
    """"signed", "sqrt" or None (kept exact) for optimizer state key `<param>/<state>`."""
    state = key.rsplit("/", 1)[-1]
    return "signed" if state in SIGNED_MOMENTS else "sqrt" if state in SQRT_MOMENTS else None


def _numel(shape) -> int:
    return math.prod(shape)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, TORCH_DTYPE_NAMES[name])


# ---- block-wise code-book quantisation --------------------------------------------------------------------------
#: Elements encoded or decoded at a time, in reused buffers: temporaries stay in cache (a fresh multi-MB tensor per
#: operation costs more in page faults than the arithmetic), and memory stays bounded by a chunk.
CHUNK = 2**18


def quantize(x: torch.Tensor, grid: Grid, kind: str, block: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `x` flattened: uint8 codes (two per byte when the grid has at most 16 entries, low nibble
    first) of the nearest grid entry of each element divided by its block's scale, and one fp32 scale per block
    (the block's largest magnitude, or largest square root). A block holding a non-finite value gets a non-finite
    scale and does not decode to finite values (the training it came from had diverged)."""
    flat = x.detach().reshape(-1)
    n, bits = flat.numel(), _bits(grid)
    codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
    scales = torch.empty(-(-n // block), dtype=torch.float32)
    step = max(block, CHUNK // block * block)  # even, and a whole number of blocks
    work = torch.empty(min(n, step), dtype=torch.float32)
    integers = torch.zeros(min(n, step) + 1, dtype=torch.int32)  # float -> int32 -> uint8: 3x faster than direct
    for start in range(0, n, step):
        part = flat[start:start + step].to(torch.float32)
        m = part.numel()
        full = m // block * block
        for lo, hi in ((0, full), (full, m)):  # whole blocks, then a ragged last block
            if hi > lo:
                width = block if hi - lo >= block else hi - lo
                first = (start + lo) // block
                w = work[lo:hi].view(-1, width)
                scales[first:first + w.shape[0]] = _encode_rows(part[lo:hi].view(-1, width), w, grid, kind)
        ints = integers[:m]
        ints.copy_(work[:m])
        if bits == 8:
            codes[start:start + m].copy_(ints)
        else:
            integers[m] = 0  # an odd last chunk pairs its last code with 0
            pairs = integers[:m + m % 2]
            codes[start // 2:start // 2 + len(pairs) // 2].copy_(pairs[0::2] | (pairs[1::2] << 4))
    return codes, scales


def _encode_rows(rows: torch.Tensor, w: torch.Tensor, grid: Grid, kind: str) -> torch.Tensor:
    """Leave in `w` the codes (as floats) of `rows`, one block per row; return the scale of each row."""
    torch.sqrt(rows, out=w) if kind == "sqrt" else torch.abs(rows, out=w)
    scale = w.amax(dim=1)
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)
    if grid.power == 2:
        w.mul_(inverse[:, None]).sqrt_().div_(grid.step)  # t / step, t = (|value| / scale) ** (1 / 2)
    else:
        w.mul_((inverse / grid.step)[:, None])  # t / step, t = |value| / scale
    if kind != "sqrt" and grid.first < 0:
        w.copysign_(rows)
    w.sub_(grid.first / grid.step).round_().clamp_(0, grid.count - 1)  # the nearest k of t = first + k * step
    return scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, grid: Grid, kind: str, n: int,
               block: int = BLOCK_SIZE) -> torch.Tensor:
    """Inverse of `quantize`: the `n` decoded fp32 values (flat), chunk by chunk."""
    out = torch.empty(n, dtype=torch.float32)
    step = max(block, CHUNK // block * block)
    for start in range(0, n, step):
        stop = min(n, start + step)
        values = out[start:stop]
        values.copy_(unpack(codes, _bits(grid), n, start, stop))
        values.mul_(grid.step).add_(grid.first)
        if grid.power == 2:
            values.mul_(values.abs())
        full = (stop - start) // block * block  # chunks start on a block: only the last block may be ragged
        values[:full].view(-1, block).mul_(scales[start // block:(start + full) // block, None])
        values[full:].mul_(scales[(start + full) // block:(start + full) // block + 1])
        if kind == "sqrt":
            values.square_()
    return out


def _bits(grid: Grid) -> int:
    return 4 if grid.count <= 16 else 8


def unpack(packed: torch.Tensor, bits: int, n: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Codes `start:stop` (default: all `n`) of `quantize`'s codes (two per byte for 4 bits, low nibble first)."""
    stop = n if stop is None else stop
    if bits == 8:
        return packed[start:stop]
    first = start // 2
    pairs = packed[first:-(-stop // 2)]
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=1).reshape(-1)[start - 2 * first:stop - 2 * first]


# ---- the optimizer-moment codec -----------------------------------------------------------------------------------
class _BlockRange:
    """(first, count) of the codes (bytes, with `bits`) or the scales (one per block: without `bits`) of the blocks
    that start among elements `[first, first + count)` of a tensor of `n` elements. Picklable (a plan crosses to
    the writer process)."""

    __slots__ = ("block", "bits", "n")

    def __init__(self, block: int, bits: int | None = None, n: int = 0):
        self.block, self.bits, self.n = block, bits, n

    def __call__(self, first: int, count: int) -> tuple[int, int]:
        k0, k1 = -(-first // self.block), -(-(first + count) // self.block)
        if self.bits is None:
            return k0, max(k1 - k0, 0)
        c0, c1 = k0 * self.block * self.bits // 8, -(-min(k1 * self.block, self.n) * self.bits // 8)
        return c0, max(c1 - c0, 0)

    def __getstate__(self):
        return self.block, self.bits, self.n

    def __setstate__(self, state):
        self.block, self.bits, self.n = state


class MomentCodec:
    """Save and read side of O1/O2 for the optimizer component (see the module docstring).

    It is a `planning.HaloEncoder` (piecewise): in a folder every rank sees, each rank encodes and writes in place
    the blocks that start among its elements (their codes and scales). A block straddling the end of its piece needs the first elements
    of the next pieces: before the save, every rank shares the elements it holds ahead of its first block start
    (`halo`: fewer than a block per tensor), and the block's owner completes its last block with them
    (`receive_halos`, `encode_piece`). The file is the one a whole-tensor encode writes."""

    name = MOMENT_CODEC
    version = 1

    def __init__(self, stage: str, block: int = BLOCK_SIZE, grids: Mapping[str, Grid] | None = None):
        if stage not in STAGE_BITS:
            raise ValueError(f"no moment codec for ckpt_quant_stage {stage!r}; expected one of {list(STAGE_BITS)}")
        self.stage, self.bits, self.block = stage, STAGE_BITS[stage], block
        self.grids = dict(grids or {kind: CODE_BOOKS[(kind, self.bits)] for kind in ("signed", "sqrt")})
        self.tensors: dict[str, dict] = {}
        self.halos: dict[str, dict[int, torch.Tensor]] = {}  # name -> {first element: the elements from there}

    # in place: blocks by where they start
    def _blocks(self, first: int, count: int) -> tuple[int, int]:
        """The blocks `[k0, k1)` whose first element lies in `[first, first + count)`."""
        return -(-first // self.block), -(-(first + count) // self.block)

    def stored_pieces(self, name: str, pieces: tuple) -> dict[str, tuple]:
        """The pieces of the codes and scales of `name`, held as `pieces` ((rank, first element, count), in element
        order): each rank's are those of the blocks that start among its elements."""
        entry = self.tensors.get(name)
        if entry is None:
            return {name: pieces}
        codes, scales = _BlockRange(self.block, self.bits, _numel(entry["shape"])), _BlockRange(self.block)
        if isinstance(pieces, ClosedForm):  # mapped rank by rank when asked
            return {name: Mapped(pieces, codes), name + SCALES: Mapped(pieces, scales)}
        return {name: tuple((r, *codes(f, c)) for r, f, c in pieces),
                name + SCALES: tuple((r, *scales(f, c)) for r, f, c in pieces)}

    def halo(self, name: str, first: int, values: torch.Tensor) -> torch.Tensor | None:
        """What this rank shares of its piece of `name` (elements from `first`): those ahead of its first block
        start, which the owner of the block they belong to needs (a copy; None when there are none)."""
        if name not in self.tensors:
            return None
        ahead = min(values.numel(), self._blocks(first, 0)[0] * self.block - first)
        return values[:ahead].detach().to(torch.float32).clone() if ahead > 0 else None

    def receive_halos(self, halos: Mapping[str, Mapping[int, torch.Tensor]]) -> None:
        """Every rank's `halo`s, by tensor and first element."""
        self.halos = {name: dict(h) for name, h in halos.items()}

    def encode_piece(self, name: str, values: torch.Tensor, start: int, rank: int) -> dict[str, torch.Tensor]:
        """The codes and scales of the blocks that start among this rank's elements `values` (flat, from element
        `start`), its last block completed from the halos of the pieces after it."""
        entry = self.tensors.get(name)
        if entry is None:
            return {name: values}
        k0, k1 = self._blocks(start, values.numel())
        if k1 <= k0:  # no block starts among these elements: this rank writes nothing of the tensor (its halo did)
            return {name: torch.empty(0, dtype=torch.uint8), name + SCALES: torch.empty(0, dtype=torch.float32)}
        e0, e1 = k0 * self.block, min(k1 * self.block, _numel(entry["shape"]))
        parts, end = [values[e0 - start:]], start + values.numel()
        for first, head in sorted(self.halos.get(name, {}).items()):
            if first == end and end < e1:
                parts.append(head[:e1 - end])
                end += parts[-1].numel()
        if end < e1:
            raise ValueError(f"{name}: rank {rank} lacks elements [{end}, {e1}) of its last block; the pieces changed "
                             "after the save was planned.")
        codes, scales = quantize(torch.cat(parts) if len(parts) > 1 else parts[0], self.grids[entry["kind"]],
                                 entry["kind"], self.block)
        return {name: codes, name + SCALES: scales}

    # save side
    def encodes(self, spec: TensorSpec) -> bool:
        return len(spec.shape) > 0 and spec.dtype.is_floating_point and moment_kind(spec.name) is not None

    def stored_specs(self, spec: TensorSpec) -> list[TensorSpec]:
        """What `spec` is stored as: itself, or its codes and scales (sizes known before any data)."""
        if not self.encodes(spec):
            return [spec]
        n = _numel(spec.shape)
        self.tensors[spec.name] = {"kind": moment_kind(spec.name), "shape": list(spec.shape),
                                   "dtype": safetensors_dtype(spec.dtype)}
        return [TensorSpec(spec.name, (-(-n * self.bits // 8),), torch.uint8),
                TensorSpec(spec.name + SCALES, (-(-n // self.block),), torch.float32)]

    def encode(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        entry = self.tensors.get(name)
        if entry is None:
            return {name: tensor}
        codes, scales = quantize(tensor, self.grids[entry["kind"]], entry["kind"], self.block)
        return {name: codes, name + SCALES: scales}

    def metadata(self) -> dict:
        """The `codec` entry of the index metadata: everything a reader needs to decode."""
        return {"name": self.name, "version": self.version, "stage": self.stage, "bits": self.bits,
                "block_size": self.block, "scale_dtype": "F32",
                "grids": {k: g.as_dict() for k, g in self.grids.items()},
                "books": {k: g.values() for k, g in self.grids.items()}, "tensors": self.tensors}

    @classmethod
    def from_metadata(cls, meta: Mapping) -> "MomentCodec":
        codec = cls(meta["stage"], int(meta["block_size"]), {k: Grid(**g) for k, g in meta["grids"].items()})
        codec.tensors = dict(meta["tensors"])
        return codec

    # read side (format.reader.Codec, RowDecoder)
    def logical_specs(self, stored_specs, metadata) -> dict:
        out = {n: s for n, s in stored_specs.items() if not self.hidden(n)}
        for name, entry in self.tensors.items():
            out[name] = (tuple(entry["shape"]), entry["dtype"])
        return out

    def hidden(self, name: str) -> bool:
        return name.endswith(SCALES)

    def problems(self, stored_specs) -> Problems:
        """Codes and scales missing or not counted as the shape and block size say (`state_shapes`)."""
        return codec_stored_problems(self.metadata(), stored_specs)

    def decode_rows(self, name: str, reader, rows: slice) -> torch.Tensor:
        """Rows `rows` of moment `name`, decoded from the codes and scales of the blocks that cover them only."""
        entry = self.tensors[name]
        shape = entry["shape"]
        start, stop, _ = rows.indices(shape[0])
        stop = max(start, stop)
        width = _numel(shape[1:])
        lo, hi = start * width, stop * width
        first, last = lo // self.block, -(-hi // self.block)
        begin, end = first * self.block, min(_numel(shape), last * self.block)  # begin: even (whole blocks)
        per_byte = 8 // self.bits
        codes = reader.get_slice(name)[begin // per_byte:-(-end // per_byte)] if end > begin else torch.empty(0)
        scales = reader.get_slice(name + SCALES)[first:last] if end > begin else torch.empty(0)
        values = dequantize(codes.to(torch.uint8), scales, self.grids[entry["kind"]], entry["kind"], end - begin,
                            self.block)
        return values[lo - begin:hi - begin].to(_dtype(entry["dtype"])).reshape(stop - start, *shape[1:])

    def decode(self, name: str, reader) -> torch.Tensor:
        return self.decode_rows(name, reader, slice(None))


# ---- fp32 master weights as a residual over their bf16 rounding ---------------------------------------------------
#: The difference a tie rounded down to even leaves (`master_bits - bf16_bits << 16`): one more than int16 holds.
TIE = 32768


class _Residuals:
    """Chunk by chunk (`CHUNK` values, in reused buffers), the int32 difference `d = master_bits - bf16_bits << 16`
    of fp32 values over their round-to-nearest-even bf16 (as DeepSpeed rounds its bf16 weights). Every operation is
    int32 (the two patterns share their sign, so the difference never overflows)."""

    def __init__(self, n: int):
        m = min(n, CHUNK)
        self.rounded = torch.empty(m, dtype=torch.bfloat16)
        self.high = torch.empty(m, dtype=torch.int32)
        self.diff = torch.empty(m, dtype=torch.int32)
        self.ties = torch.empty(m, dtype=torch.bool)

    def chunk(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, tie mask) of fp32 `part` (views into the buffers, valid until the next call)."""
        m = part.numel()
        rounded, high, diff, ties = self.rounded[:m], self.high[:m], self.diff[:m], self.ties[:m]
        rounded.copy_(part)
        high.view(torch.float32).copy_(rounded)  # exact: bf16 -> fp32 only appends 16 zero bits
        torch.sub(part.view(torch.int32), high, out=diff)
        torch.eq(diff, TIE, out=ties)
        return diff, ties


def _fp32_flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to(torch.float32).contiguous()


def residual_of(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int16 residual, int64 flat indices of ties) of fp32 `master` over `master.to(bfloat16)` (round to nearest
    even, as DeepSpeed rounds its bf16 weights). Raises ValueError if any element cannot be rebuilt exactly: each
    chunk is rebuilt from what is stored and compared bit for bit."""
    flat = _fp32_flat(master)
    n = flat.numel()
    residual, ties, work = torch.empty(n, dtype=torch.int16), [], _Residuals(n)
    rebuilt = torch.empty(min(n, CHUNK), dtype=torch.int32)
    for start in range(0, n, CHUNK):
        part = flat[start:start + CHUNK]
        diff, tie = work.chunk(part)
        out, back = residual[start:start + part.numel()], rebuilt[:part.numel()]
        tied = bool(tie.any())
        if tied:
            ties.append(tie.nonzero().reshape(-1) + start)
            diff.masked_fill_(tie, 0)
        out.copy_(diff)  # wraps where d does not fit int16: the comparison below then fails
        torch.add(work.high[:part.numel()], out, out=back)
        if tied:
            back.add_(tie, alpha=TIE)
        if not torch.equal(back, part.view(torch.int32)):
            raise ValueError("a master weight is not within 16 bits of its bf16 rounding (a NaN payload?)")
    ties = torch.cat(ties) if ties else torch.empty(0, dtype=torch.int64)
    return residual.reshape(master.shape), ties


def rebuild_master(bf16: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor | None) -> torch.Tensor:
    """Inverse of `residual_of`, given the bf16 weights."""
    out = torch.empty(residual.numel(), dtype=torch.float32)
    low, high = residual.reshape(-1), bf16.reshape(-1)
    for start in range(0, out.numel(), CHUNK):
        part = out[start:start + CHUNK]
        part.copy_(high[start:start + CHUNK])
        part.view(torch.int32).add_(low[start:start + CHUNK])
    if ties is not None and ties.numel():
        out.view(torch.int32)[ties] += TIE
    return out.reshape(residual.shape)


def rounds_to(master: torch.Tensor, bf16: torch.Tensor) -> bool:
    """Whether bf16 `bf16` is exactly the round-to-nearest-even of fp32 `master` (chunk by chunk)."""
    flat, low = _fp32_flat(master), bf16.detach().reshape(-1)
    if low.numel() != flat.numel():
        return False
    rounded = torch.empty(min(flat.numel(), CHUNK), dtype=torch.bfloat16)
    for start in range(0, flat.numel(), CHUNK):
        part = rounded[:min(CHUNK, flat.numel() - start)]
        part.copy_(flat[start:start + CHUNK])
        if not torch.equal(part.view(torch.int16), low[start:start + CHUNK].view(torch.int16)):
            return False
    return True


def count_ties(hp: torch.Tensor, lp: torch.Tensor) -> int | None:
    """For a local fragment: the number of ties `residual_of` lists, or None when `lp` (the model's weights) is not
    exactly the bf16 rounding of `hp` (the fp32 master: fp16 training, or weights changed apart from their master)
    or rounds to NaN (whose payload the residual may not hold), so the tensor is stored as plain fp32. Cheaper than
    encoding: a tie rounded down is a value whose low 17 bits are exactly 0x8000 (an even bf16 and half an ulp)."""
    return count_ties_many([(None, hp, lp)])[None]


def count_ties_many(fragments) -> dict:
    """`count_ties` of every (name, hp, lp) of `fragments`, by name, in one pass over their elements: the fragments
    laid end to end in windows of `CHUNK` elements (small ones share a window, a large one spans several), each
    window checked by a few whole-window integer operations and reductions, its ties found through the 64-bit words
    of their mask (about 1 value in 130,000 is a tie) and attributed to their fragments by a search of the few
    positions found, not by operations per fragment (a 405B model's ZeRO-3 rank at 16,384 ranks holds 1,137)."""
    out, window = {}, _TieWindow()
    for name, hp, lp in fragments:
        n = hp.numel()
        if lp.dtype != torch.bfloat16 or lp.numel() != n:
            out[name] = None
            continue
        out[name] = 0
        flat, low = _flat(hp), _flat(lp)
        if n <= CHUNK:
            window.add(name, flat, low, n, out)
            continue
        for start in range(0, n, CHUNK):
            window.add(name, flat[start:start + CHUNK], low[start:start + CHUNK], min(CHUNK, n - start), out)
    window.flush(out)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a flat tensor without autograd, at the cost of no call where it is one already."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.reshape(-1)


class _TieWindow:
    """Fragments gathered into one window of at most `CHUNK` elements, counted together in reused buffers."""

    def __init__(self):
        self.parts: list[tuple[object, torch.Tensor, torch.Tensor]] = []
        self.ends: list[int] = []  # where each part ends in the window
        self.used = 0
        self.buffers: dict[str, torch.Tensor] = {}

    def add(self, name, high: torch.Tensor, low: torch.Tensor, n: int, out: dict) -> None:
        """Part `name` of `n` elements (fp32 `high`, bf16 `low`), counted at the latest when the window is full."""
        if self.used + n > CHUNK:
            self.flush(out)
        self.parts.append((name, high, low))
        self.used += n
        self.ends.append(self.used)

    def _buffer(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        if key not in self.buffers:  # only the elements used are touched (a few fragments: a few pages)
            self.buffers[key] = torch.empty(CHUNK, dtype=dtype)
        return self.buffers[key]

    def flush(self, out: dict) -> None:
        parts, ends, m = self.parts, self.ends, self.used
        self.parts, self.ends, self.used = [], [], 0
        if not m:
            return
        high, low = self._gathered(parts, m)
        rounded = self._buffer("rounded", torch.bfloat16)[:m]
        rounded.copy_(high)
        bits, low_bits, work = rounded.view(torch.int16), low.view(torch.int16), self._buffer("work", torch.int16)[:m]
        spans = list(zip([0] + ends[:-1], ends))
        failed = set()
        if any(int(v) for v in torch.aminmax(torch.sub(bits, low_bits, out=work))):  # not the master's rounding
            failed |= {i for i, (a, b) in enumerate(spans) if not torch.equal(bits[a:b], low_bits[a:b])}
        if int(torch.bitwise_and(bits, 0x7FFF, out=work).max()) > 0x7F80:  # a NaN (exponent ones, mantissa not 0)
            failed |= {i for i, (a, b) in enumerate(spans) if b > a and int(work[a:b].max()) > 0x7F80}
        counts = self._ties(high, m, ends)
        for i, (name, _, _) in enumerate(parts):
            out[name] = None if i in failed or out[name] is None else out[name] + counts[i]

    def _gathered(self, parts: list, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's fp32 and bf16 elements: the fragment itself when it fills it alone, else copied end to end."""
        if len(parts) == 1:
            return parts[0][1].to(torch.float32), parts[0][2]
        high, low = self._buffer("high", torch.float32)[:m], self._buffer("low", torch.bfloat16)[:m]
        torch.cat([p[1] for p in parts], out=high)  # (converted to fp32 where a master is not)
        torch.cat([p[2] for p in parts], out=low)
        return high, low

    def _ties(self, high: torch.Tensor, m: int, ends: list[int]) -> list[int]:
        """Ties per part of the window (parts ending at `ends`): the words of the tie mask that are not zero, then
        the positions within them."""
        low17 = torch.bitwise_and(high.view(torch.int32), 0x1FFFF, out=self._buffer("low17", torch.int32)[:m])
        mask = self._buffer("mask", torch.bool)
        torch.eq(low17, TIE, out=mask[:m])
        mask[m:-(-m // 8) * 8] = False  # the last word's bytes past the window
        words = mask[:-(-m // 8) * 8].view(torch.int64).nonzero().reshape(-1)
        if not words.numel():
            return [0] * len(ends)
        hits = mask.view(-1, 8)[words]
        positions = (words[:, None] * 8 + torch.arange(8))[hits]
        if len(ends) == 1:
            return [positions.numel()]
        owner = torch.searchsorted(torch.tensor(ends), positions, right=True)
        return torch.bincount(owner, minlength=len(ends)).tolist()


def _check_ties(name: str, found: int, planned: int) -> None:
    if found != planned:
        raise ValueError(f"master weight {name!r} changed between planning the save and writing it ({found} ties, "
                         f"{planned} planned); its residual would not rebuild it exactly, so it is not written.")


class ResidualCodec:
    """Save and read side of `residual_master_weight` for the master-weights component. `census` maps each
    master tensor that qualifies to its number of ties, and `by_rank` to the ties among each rank's elements
    (collected before the save, from every rank's fragments); others are stored as plain fp32. On read, `anchor`
    is the model-weights reader (its bf16 tensors).

    The residual is elementwise, so it is a `planning.PiecewiseEncoder`: in a folder every rank sees, each rank encodes and writes its
    own elements (`encode_piece`); the ties of a tensor are laid out rank after rank in element order, each rank's
    at the offset the census gives it (`stored_pieces`), so the file is the one a whole-tensor encode writes."""

    name = RESIDUAL_CODEC
    version = 1

    def __init__(self, census: Mapping[str, int] | None = None, anchor=None,
                 by_rank: Mapping[str, Mapping[int, int]] | None = None):
        self.census = dict(census or {})
        self.by_rank = {name: dict(ranks) for name, ranks in (by_rank or {}).items()}
        #: A rank-local census (`saving.residual_census` with a rule): name -> (this rank, the first of its ties in the
        #: tensor's ties), `by_rank` then holding this rank's counts only.
        self.own_offset: dict[str, tuple[int, int]] = {}
        self.anchor = anchor
        self.tensors: dict[str, dict] = {}

    # save side
    def stored_specs(self, spec: TensorSpec) -> list[TensorSpec]:
        if spec.name not in self.census or spec.dtype != torch.float32:
            return [spec]
        ties = self.census[spec.name]
        self.tensors[spec.name] = {"shape": list(spec.shape), "ties": ties}
        out = [TensorSpec(spec.name, spec.shape, torch.int16)]
        return out + ([TensorSpec(spec.name + TIES, (ties,), torch.int64)] if ties else [])

    def stored_pieces(self, name: str, pieces: tuple) -> dict[str, tuple] | None:
        """The pieces of each stored tensor of logical `name`, held as `pieces` ((rank, first element, count), in
        element order): the residual's are the same; the ties' follow the census of each rank's ties. None when the
        census does not account for every tie (the tensor is then assembled and encoded whole)."""
        entry = self.tensors.get(name)
        if entry is None or not entry["ties"]:
            return {name: pieces}
        if name in self.own_offset:  # a rank-local census: this rank's ties and where they go, nobody else's
            rank, offset = self.own_offset[name]
            return {name: pieces, name + TIES: OwnOnly(rank, offset, self.by_rank[name].get(rank, 0), pieces)}
        ties, offset = [], 0
        for rank, _, count in pieces:
            held = self.by_rank.get(name, {}).get(rank, 0) if count else 0
            ties.append((rank, offset, held))
            offset += held
        return {name: pieces, name + TIES: tuple(ties)} if offset == entry["ties"] else None

    def encode(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        entry = self.tensors.get(name)
        if entry is None:
            return {name: tensor}
        residual, ties = residual_of(tensor)  # rebuilt and compared bit for bit, chunk by chunk
        _check_ties(name, ties.numel(), entry["ties"])
        return {name: residual, **({name + TIES: ties} if entry["ties"] else {})}

    def encode_piece(self, name: str, values: torch.Tensor, start: int, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s stored pieces of `name` from its elements `values` (flat, from element `start`): its part
        of the residual and its ties (as flat indices of the whole tensor)."""
        entry = self.tensors.get(name)
        if entry is None:
            return {name: values}
        residual, ties = residual_of(values)
        _check_ties(name, ties.numel(), self.by_rank.get(name, {}).get(rank, 0) if entry["ties"] else 0)
        return {name: residual, **({name + TIES: ties + start} if entry["ties"] else {})}

    def metadata(self) -> dict:
        return {"name": self.name, "version": self.version, "anchor": "model", "tensors": self.tensors}

    @classmethod
    def from_metadata(cls, meta: Mapping, anchor) -> "ResidualCodec":
        codec = cls(anchor=anchor)
        codec.tensors = dict(meta["tensors"])
        return codec

    # read side
    def logical_specs(self, stored_specs, metadata) -> dict:
        out = {n: s for n, s in stored_specs.items() if not self.hidden(n)}
        for name, entry in self.tensors.items():
            out[name] = (tuple(entry["shape"]), "F32")
        return out

    def hidden(self, name: str) -> bool:
        return name.endswith(TIES)

    def problems(self, stored_specs) -> Problems:
        """Residuals, ties and the bf16 weights of `anchor` missing or not what the metadata says (`state_shapes`)."""
        anchor = self.anchor.specs() if self.anchor is not None else None
        return codec_stored_problems(self.metadata(), stored_specs, anchor)

    def decode(self, name: str, reader) -> torch.Tensor:
        return self.decode_rows(name, reader, slice(None))

    def decode_rows(self, name: str, reader, rows: slice) -> torch.Tensor:
        """Rows `rows` of master weight `name`: those rows of the residual and of the bf16 weights, and the ties
        among them."""
        if self.anchor is None:
            raise UnsupportedCheckpointError(f"master weight {name!r} is stored as a residual over the bf16 model "
                                             "weights, which are not available to this reader.")
        shape = self.tensors[name]["shape"]
        if not shape:  # a 0-d weight: no rows to slice
            bf16, residual, lo, hi = self.anchor.get(name), reader.get(name), 0, 1
        else:
            start, stop, _ = rows.indices(shape[0])
            stop = max(start, stop)
            width = _numel(shape[1:])
            lo, hi = start * width, stop * width
            bf16, residual = self.anchor.get_slice(name)[start:stop], reader.get_slice(name)[start:stop]
        ties = reader.get(name + TIES) if self.tensors[name]["ties"] else None
        if ties is not None:
            ties = ties[(ties >= lo) & (ties < hi)] - lo
        master = rebuild_master(bf16, residual, ties)
        if not rounds_to(master, bf16):
            raise CorruptCheckpointError(f"the residual of master weight {name!r} does not belong to the model "
                                         "weights next to it (they are not its bf16 rounding).")
        return master


KNOWN = {MomentCodec.name: MomentCodec, ResidualCodec.name: ResidualCodec}


def codec_from_metadata(metadata: Mapping, where: str, anchor=None, index: str = "its index file"):
    """The read-side codec an index's metadata names, or None (stored as logical). A codec this version does not
    know (or a newer version of one) is refused by name: codes are never loaded as values. Malformed metadata (a
    block size, shape or tie count that is not one, `state_shapes.codec_metadata_problems`) is refused before
    anything is read or allocated from it."""
    meta = metadata.get("codec") if metadata else None
    if meta is None:
        return None
    version = meta.get("version", 0) if isinstance(meta, dict) else None
    if not isinstance(version, int):
        raise CorruptCheckpointError(f"{where}: the 'codec' entry of {index} is malformed: {meta!r:.200}. The index "
                                     "was changed after the save; nothing was read. Resume from another checkpoint.")
    cls = KNOWN.get(meta.get("name"))
    if cls is None or version > cls.version:
        raise UnsupportedCheckpointError(
            f"{where} is stored with codec {meta.get('name')!r} version {meta.get('version')}, which this "
            f"hf_unified_ckpt does not know (it reads {sorted(f'{n} v{c.version}' for n, c in KNOWN.items())}). "
            "Upgrade hf_unified_ckpt to read it.")
    problems = codec_metadata_problems(meta)
    if problems:
        raise CorruptCheckpointError(
            f"{where}: {index}: the {meta['name']!r} codec metadata is malformed: {'; '.join(problems[:5])}"
            f"{'; ...' if len(problems) > 5 else ''}. The index was changed after the save; nothing was read. "
            "Resume from another checkpoint.")
    return cls.from_metadata(meta, anchor) if cls is ResidualCodec else cls.from_metadata(meta)
