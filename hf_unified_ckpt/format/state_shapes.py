"""What a checkpoint's per-parameter state may look like, given its parameters' shapes: the rules a resume checks
against the live model and `verify` against the model files, from the safetensors headers and index metadata
only, before any tensor is read or any buffer is made from what a header says. Pure, and no torch (`verify` imports
none): each function returns `(key, problem)` pairs, and the caller names the file and the fix.

- Optimizer state (`<param>/<state>`): a per-element state (a moment: `exp_avg`, `exp_avg_sq`, ... `ELEMENTWISE`)
  has exactly its parameter's shape and a floating-point dtype (an I32 moment is refused, never cast); a factored
  second moment (Adafactor's row and column vectors, `FACTORED`) is floating-point, its parameter's shape with one of
  the last two dimensions dropped or 1; a step count (`step`) and any value saved as a Python number is 0-d. A state
  name this version does not know is left to its optimizer (bitsandbytes' 8-bit states are uint8 codes, per-block
  scales and a code book: no rule fits every optimizer).
- Master weights and EMA: floating-point, the shape of the weight they are keyed like.
- Codecs (`format/codecs.py`): their index metadata well formed (O1/O2 stage, bits, block size, code books, each
  encoded tensor's kind, shape and dtype; a residual's shape and tie count), and the stored tensors what the
  metadata says: codes and scales counted from the shape and block size, residual and ties, the bf16 weights a
  residual refines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

#: Tensor name -> (shape, safetensors dtype name), as `format.reader.Specs`.
Specs = Mapping[str, tuple[tuple[int, ...], str]]
Problems = list[tuple[str, str]]

SCALES, TIES = ":scales", ":ties"
#: Optimizer state names that are moments, by how O1/O2 code them: signed (first moments, momentum) or through the
#: square root (non-negative running squares).
SIGNED_MOMENTS = frozenset({"exp_avg", "momentum_buffer", "grad_avg"})
SQRT_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta"})
#: States that hold one value per element of their parameter (torch's optimizers' and transformers' Adafactor's):
#: refused in any other shape.
ELEMENTWISE = SIGNED_MOMENTS | SQRT_MOMENTS | {"exp_inf", "prev", "ax", "variance"}
#: Factored second moments (transformers' and torch's Adafactor): a row and a column vector per matrix.
FACTORED = frozenset({"exp_avg_sq_row", "exp_avg_sq_col", "row_var", "col_var"})
#: States that are one number per parameter.
SCALAR_STATES = frozenset({"step"})
FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
STAGE_BITS = {"O1": 8, "O2": 4}
MOMENT_CODEC, RESIDUAL_CODEC = "blockwise_codebook", "bf16_residual"


def _shown(shape) -> str:
    return str(list(shape))


def _numel(shape) -> int:
    return math.prod(shape)


# ---- optimizer state, master weights, EMA ---------------------------------------------------------------------
def optimizer_state_problems(specs: Specs, parameter_shape: Callable[[str], tuple[int, ...] | None],
                             state_types: Mapping[str, str]) -> Problems:
    """Each optimizer state tensor of `specs` (logical shapes and dtypes) that does not fit its parameter, whose shape
    `parameter_shape(name)` gives (None: unknown here; the engine refuses a state of no parameter of its own).
    `state_types` is the index metadata's record of values saved as Python numbers."""
    problems = []
    for key, (shape, dtype) in specs.items():
        param, _, state = key.partition("/")
        if not state:
            continue  # not a `<param>/<state>` key: refused by name where the state is read
        problem = _state_problem(state, tuple(shape), dtype, parameter_shape(param), state_types.get(key))
        if problem:
            problems.append((key, problem))
    return problems


def _state_problem(state: str, shape: tuple, dtype: str, param: tuple | None, kind: str | None) -> str:
    if kind is not None or state in SCALAR_STATES:
        what = f"a Python {kind}" if kind else f"'{state}'"
        return "" if shape == () else f"has shape {_shown(shape)}, expected [] ({what} is saved as a 0-d tensor)"
    if state not in ELEMENTWISE and state not in FACTORED:
        return ""  # a state this version does not know: its optimizer's business
    if dtype not in FLOATING:
        return (f"is {dtype}, expected a floating-point dtype (F32, BF16, F16): optimizer state is not cast from "
                "integers")
    if param is None:
        return ""
    if state in ELEMENTWISE:
        return "" if shape == param else f"has shape {_shown(shape)}, expected {_shown(param)} (its parameter's shape)"
    factored = _factored(param)
    return "" if shape in factored else (f"has shape {_shown(shape)}, expected one of "
                                         f"{sorted(map(list, factored))} (its parameter's shape, factored)")


def _factored(shape: tuple) -> set[tuple]:
    """The shapes of a factored second moment of a tensor of `shape`: one dimension of the last two dropped or 1."""
    if len(shape) < 2:
        return set()
    head, rows, cols = shape[:-2], shape[-2], shape[-1]
    return {head + (rows,), head + (cols,), head + (rows, 1), head + (1, cols)}


def parameter_state_problems(specs: Specs, weights: Mapping[str, tuple[int, ...]]) -> Problems:
    """Each tensor of a master-weights or EMA component (keyed like the weights) that is not floating-point or not of
    the shape `weights` gives its weight (a name `weights` lacks is left to the engine, which refuses it)."""
    problems = []
    for key, (shape, dtype) in specs.items():
        expected = weights.get(key)
        if dtype not in FLOATING:
            problems.append((key, f"is {dtype}, expected F32 (fp32 values of the weight)"))
        elif expected is not None and tuple(shape) != tuple(expected):
            problems.append((key, f"has shape {_shown(shape)}, expected {_shown(expected)} (its weight's shape)"))
    return problems


# ---- codec metadata ------------------------------------------------------------------------------------------------
def _count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shape(value) -> bool:
    return isinstance(value, list) and all(_count(d) for d in value)


def codec_metadata_problems(meta: Mapping) -> list[str]:
    """What is malformed in the `codec` entry of an index's metadata (a known codec's; empty: well formed)."""
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict):
        return ["'tensors' is not an object"]
    if meta.get("name") == MOMENT_CODEC:
        return _moment_metadata_problems(meta, tensors)
    return _residual_metadata_problems(tensors) if meta.get("name") == RESIDUAL_CODEC else []


def _residual_metadata_problems(tensors: Mapping) -> list[str]:
    out = []
    for name, entry in tensors.items():
        if not (isinstance(entry, dict) and _shape(entry.get("shape")) and _count(entry.get("ties"))):
            out.append(f"tensors[{name!r}] is not {{'shape': [...], 'ties': count}}")
        elif entry["ties"] > _numel(entry["shape"]):
            out.append(f"tensors[{name!r}] lists {entry['ties']} ties in {_numel(entry['shape'])} elements")
    return out


def _moment_metadata_problems(meta: Mapping, tensors: Mapping) -> list[str]:
    stage, bits, block, grids = meta.get("stage"), meta.get("bits"), meta.get("block_size"), meta.get("grids")
    if stage not in STAGE_BITS or bits != STAGE_BITS[stage]:
        return [f"stage {stage!r} with bits {bits!r}; expected one of {STAGE_BITS}"]
    out = [] if _count(block, 1) else [f"block_size {block!r} is not a positive integer"]
    if not isinstance(grids, dict):
        return out + ["'grids' is not an object"]
    for kind, grid in grids.items():
        if not _grid(grid, bits):
            out.append(f"grids[{kind!r}] is not a code book of {bits}-bit codes "
                       "({'first', 'step' > 0, 'count', 'power' 1 or 2})")
    for name, entry in tensors.items():
        if not (isinstance(entry, dict) and entry.get("kind") in grids and _shape(entry.get("shape"))
                and entry.get("dtype") in FLOATING):
            out.append(f"tensors[{name!r}] is not {{'kind': one of {sorted(grids)}, 'shape': [...], "
                       "'dtype': a floating-point dtype}")
    return out


def _grid(grid, bits: int) -> bool:
    if not (isinstance(grid, dict) and set(grid) == {"first", "step", "count", "power"}):
        return False
    count = grid["count"]
    return (_number(grid["first"]) and _number(grid["step"]) and grid["step"] > 0 and grid["power"] in (1, 2)
            and _count(count, 1) and count <= 2 ** bits and (count <= 16) == (bits == 4))


def codec_stored_problems(meta: Mapping, stored: Specs, anchor: Specs | None = None) -> Problems:
    """Each tensor a (well-formed) codec's metadata describes whose stored tensors are missing or not what it says:
    O1/O2 codes (U8, one byte per 8 / bits elements) and scales (F32, one per block); a residual (I16, the
    weight's shape), its ties (I64, as many as listed) and, with `anchor` (the model files' specs), the BF16 weight
    it refines."""
    tensors = meta["tensors"]
    wanted: dict[str, tuple[tuple, str, str]] = {}
    for name, entry in tensors.items():
        n = _numel(entry["shape"])
        if meta.get("name") == MOMENT_CODEC:
            wanted[name] = ((-(-n * meta["bits"] // 8),), "U8", "codes")
            wanted[name + SCALES] = ((-(-n // meta["block_size"]),), "F32", "scales")
        elif meta.get("name") == RESIDUAL_CODEC:
            wanted[name] = (tuple(entry["shape"]), "I16", "residual")
            if entry["ties"]:
                wanted[name + TIES] = ((entry["ties"],), "I64", "ties")
    problems = [(key, _stored_problem(stored.get(key), *expected)) for key, expected in wanted.items()]
    if anchor is not None and meta.get("name") == RESIDUAL_CODEC:
        problems += [(name, _stored_problem(anchor.get(name), tuple(entry["shape"]), "BF16", "bf16 model weight"))
                     for name, entry in tensors.items()]
    return [(key, problem) for key, problem in problems if problem]


def _stored_problem(found, shape: tuple, dtype: str, what: str) -> str:
    if found is None:
        return f"is missing (its {what}, {dtype} {_shown(shape)}, per the codec metadata)"
    if (tuple(found[0]), found[1]) != (shape, dtype):
        return (f"is {found[1]} {_shown(found[0])}, expected {dtype} {_shown(shape)} (its {what}, per the codec "
                "metadata)")
    return ""


def logical_specs(meta: Mapping | None, stored: Specs) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors an engine sees of a component stored through the (well-formed) codec `meta` (None: as stored)."""
    if not meta:
        return dict(stored)
    hidden = {MOMENT_CODEC: SCALES, RESIDUAL_CODEC: TIES}[meta["name"]]
    out = {name: spec for name, spec in stored.items() if not name.endswith(hidden)}
    for name, entry in meta["tensors"].items():
        out[name] = (tuple(entry["shape"]), entry.get("dtype", "F32"))
    return out
