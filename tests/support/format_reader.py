"""An independent reader of unified checkpoints, written from `docs/format.md` alone.

It imports json, math, os, zlib, dataclasses, safetensors and torch, and nothing of `hf_unified_ckpt`: the point is that
the format page is enough to read a checkpoint. `tests/architecture/test_docs_reader.py` checks that it gets the same tensors as
the plugin's own reader.

    ckpt = read_checkpoint("output/checkpoint-1000")     # verifies the manifest, sizes and CRC-32s first
    ckpt.model["model.embed_tokens.weight"]              # keyed as save_pretrained keys it
    ckpt.optimizer["model.norm.weight/exp_avg"]          # <param name>/<state name>, decoded from O1/O2 codes
    ckpt.master_weights, ckpt.ema                        # fp32, keyed like the weights (None when absent)

Section names in comments (`# format.md: ...`) point at the part of the specification each step implements.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

FORMAT_NAME = "hf-unified-checkpoint"
MANIFEST = "unified_checkpoint.json"
KNOWN_VERSIONS = (1, 2)
#: Codecs this reader decodes, with the highest codec version it knows (format.md: "Codecs").
KNOWN_CODECS = {"blockwise_codebook": 1, "bf16_residual": 1}
SCALES, TIES = ":scales", ":ties"
TIE = 32768

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class FormatError(Exception):
    """The folder is not a complete, intact unified checkpoint."""


class UnsupportedFormat(FormatError):
    """A format version or codec this reader does not know."""


@dataclass
class Checkpoint:
    """What a checkpoint holds, as logical tensors (codecs decoded)."""

    manifest: dict
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None = None
    #: `<param>/<state>` -> "bool" | "int" | "float" | "none" for values that were Python scalars (or None).
    optimizer_state_types: dict[str, str] = field(default_factory=dict)
    #: Each param group's hyper-parameters (decoded) and "params": the parameter names.
    optimizer_param_groups: list[dict] = field(default_factory=list)
    #: The optimizer index metadata beyond total_size, param_groups, state_types and codec (e.g. "loss_scaler").
    optimizer_extra: dict = field(default_factory=dict)
    master_weights: dict[str, torch.Tensor] | None = None
    ema: dict[str, torch.Tensor] | None = None


# ---- format.md: "The manifest" -----------------------------------------------------------------------------------
def _plain(name, where: str) -> str:
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or os.path.isabs(name)):
        raise FormatError(f"{where} names {name!r}, which is not a plain file name inside the folder")
    return name


def read_manifest(folder: str | os.PathLike) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise FormatError(f"{folder} has no {MANIFEST}: not a committed checkpoint")
    with open(path, "rb") as f:
        try:
            manifest = json.loads(f.read().decode("utf-8"))
        except ValueError as e:
            raise FormatError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") not in KNOWN_VERSIONS:
        raise UnsupportedFormat(f"{path}: format_version {manifest.get('format_version')!r} is not one of "
                                f"{KNOWN_VERSIONS}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
        raise FormatError(f"{path} has no valid 'files' table")
    for name in files:
        _plain(name, "the manifest")
    for comp, entry in manifest.get("components", {}).items():
        for name in list(entry["files"]) + ([entry["index"]] if entry.get("index") else []):
            if _plain(name, f"component {comp!r}") not in files:
                raise FormatError(f"component {comp!r} lists {name!r}, which 'files' does not")
    return manifest


def verify(folder: str | os.PathLike, manifest: dict, checksums: bool = True) -> None:
    """Every file the manifest lists is present, of its size and (with `checksums`) of its CRC-32."""
    if manifest.get("checksum_algorithm", "crc32") != "crc32":
        raise UnsupportedFormat(f"checksum_algorithm {manifest['checksum_algorithm']!r}")
    for name, record in sorted(manifest["files"].items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FormatError(f"{name}: missing")
        if os.path.getsize(path) != record["size"]:
            raise FormatError(f"{name}: {os.path.getsize(path)} bytes, the manifest says {record['size']}")
        if checksums:
            crc = 0
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
            if f"{crc:08x}" != record["crc32"]:
                raise FormatError(f"{name}: CRC-32 {crc:08x}, the manifest says {record['crc32']}")


# ---- format.md: "Tensor files and index files" -------------------------------------------------------------------
def _stored(folder: str | os.PathLike, entry: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(index metadata, every stored tensor by name) of one component."""
    if entry.get("index"):
        with open(os.path.join(folder, entry["index"]), "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
        metadata, weight_map = index.get("metadata") or {}, index["weight_map"]
        for file in set(weight_map.values()):
            if _plain(file, entry["index"]) not in entry["files"]:
                raise FormatError(f"{entry['index']} names {file!r}, which the component does not list")
    else:  # one file, no index: the model weights as from_pretrained reads them
        if len(entry["files"]) != 1:
            raise FormatError(f"a component without an index has {len(entry['files'])} files")
        metadata, weight_map = {}, None
    tensors = {}
    for file in entry["files"]:
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    raise FormatError(f"{file} holds {name!r}, which the index puts in {weight_map.get(name)!r}")
                tensors[name] = handle.get_tensor(name)
    if weight_map is not None and set(weight_map) != set(tensors):
        raise FormatError(f"{entry['index']} and the files disagree on {sorted(set(weight_map) ^ set(tensors))[:5]}")
    return metadata, tensors


# ---- format.md: "Moment codec: blockwise_codebook (O1, O2)" -----------------------------------------------------
def _decode_moment(codes: torch.Tensor, scales: torch.Tensor, entry: dict, codec: dict) -> torch.Tensor:
    bits, block = int(codec["bits"]), int(codec["block_size"])
    grid = codec["grids"][entry["kind"]]
    if int(grid["power"]) not in (1, 2) or bits not in (4, 8):
        raise UnsupportedFormat(f"grid power {grid['power']} / {bits} bits")
    shape = entry["shape"]
    n = math.prod(shape)
    if bits == 8:
        k = codes[:n]
    else:  # two codes per byte, the element of even index in the low nibble
        k = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:n]
    step = torch.tensor(grid["step"], dtype=torch.float32)
    first = torch.tensor(grid["first"], dtype=torch.float32)
    t = k.to(torch.float32) * step + first  # fp32, two roundings
    if int(grid["power"]) == 2:
        t = t * t.abs()
    x = t * scales.to(torch.float32).repeat_interleave(block)[:n]
    if entry["kind"] == "sqrt":
        x = x * x
    return x.to(_DTYPES[entry["dtype"]]).reshape(shape)


def _decode_optimizer(stored: dict[str, torch.Tensor], codec: dict) -> dict[str, torch.Tensor]:
    out = {n: t for n, t in stored.items() if not n.endswith(SCALES)}
    for name, entry in codec["tensors"].items():
        out[name] = _decode_moment(stored[name], stored[name + SCALES], entry, codec)
    return out


# ---- format.md: "Residual codec: bf16_residual" -------------------------------------------------------------------
def _rebuild_master(name: str, residual: torch.Tensor, ties: torch.Tensor | None, bf16: torch.Tensor) -> torch.Tensor:
    if bf16.dtype != torch.bfloat16 or bf16.shape != residual.shape:
        raise FormatError(f"{name}: the model weight is {bf16.dtype} {tuple(bf16.shape)}, not bf16 like its residual")
    bits = (bf16.reshape(-1).view(torch.int16).to(torch.int32) << 16) + residual.reshape(-1).to(torch.int32)
    if ties is not None and ties.numel():
        bits[ties] += TIE
    master = bits.view(torch.float32).reshape(residual.shape)
    if not torch.equal(master.to(torch.bfloat16).view(torch.int16), bf16.view(torch.int16)):
        raise FormatError(f"{name}: the rebuilt master weight does not round to the model weight next to it")
    return master


def _decode_master(stored: dict[str, torch.Tensor], codec: dict, model: dict[str, torch.Tensor]) -> dict:
    out = {n: t for n, t in stored.items() if not n.endswith(TIES)}
    for name, entry in codec["tensors"].items():
        ties = stored.get(name + TIES) if entry["ties"] else None
        if entry["ties"] and (ties is None or ties.numel() != entry["ties"]):
            raise FormatError(f"{name}: {entry['ties']} ties listed, {0 if ties is None else ties.numel()} stored")
        if codec.get("anchor", "model") != "model":
            raise UnsupportedFormat(f"residual anchored on {codec['anchor']!r}, not the model weights")
        out[name] = _rebuild_master(name, stored[name], ties, model[name])
    return out


# ---- format.md: "Optimizer state" ---------------------------------------------------------------------------------
def decode_hparam(value):
    if isinstance(value, list):
        return [decode_hparam(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_hparam(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    return value


def _codec_of(metadata: dict, component: str) -> dict | None:
    codec = metadata.get("codec")
    if codec is None:
        return None
    known = KNOWN_CODECS.get(codec.get("name"))
    if known is None or int(codec.get("version", 0)) > known:
        raise UnsupportedFormat(f"component {component!r} is stored with codec {codec.get('name')!r} version "
                                f"{codec.get('version')!r}")
    return codec


# ---- format.md: "Reader obligations" ------------------------------------------------------------------------------
def read_checkpoint(folder: str | os.PathLike, checksums: bool = True) -> Checkpoint:
    manifest = read_manifest(folder)
    verify(folder, manifest, checksums)
    components = manifest["components"]
    read = {name: _stored(folder, entry) for name, entry in components.items()}
    for name, (metadata, _) in read.items():
        codec = _codec_of(metadata, name)
        if manifest["format_version"] == 1 and codec is not None:
            raise FormatError(f"component {name!r} names a codec in a version 1 checkpoint")
    _, model = read["model"]
    ckpt = Checkpoint(manifest, model)
    if "optimizer" in read:
        metadata, stored = read["optimizer"]
        codec = _codec_of(metadata, "optimizer")
        ckpt.optimizer = stored if codec is None else _decode_optimizer(stored, codec)
        ckpt.optimizer_state_types = dict(metadata.get("state_types", {}))
        ckpt.optimizer_param_groups = [{k: (v if k == "params" else decode_hparam(v)) for k, v in g.items()}
                                       for g in metadata.get("param_groups", [])]
        ckpt.optimizer_extra = {k: v for k, v in metadata.items()
                                if k not in ("total_size", "param_groups", "state_types", "codec")}
    if "master_weights" in read:
        metadata, stored = read["master_weights"]
        codec = _codec_of(metadata, "master_weights")
        ckpt.master_weights = stored if codec is None else _decode_master(stored, codec, model)
    if "ema" in read:
        metadata, stored = read["ema"]
        codec = _codec_of(metadata, "ema")
        if codec is not None:
            raise UnsupportedFormat(f"the ema component names codec {codec['name']!r}, which format.md gives no "
                                    "meaning for that component")
        ckpt.ema = stored
    return ckpt


def optimizer_value(ckpt: Checkpoint, key: str):
    """One saved per-parameter optimizer value as the optimizer held it: None, a Python bool/int/float, or a tensor."""
    kind = ckpt.optimizer_state_types.get(key)
    if kind == "none":
        return None
    value = ckpt.optimizer[key]
    return {"bool": bool, "int": int, "float": float}[kind](value.item()) if kind else value
