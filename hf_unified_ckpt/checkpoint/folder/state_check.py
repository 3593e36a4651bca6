"""The per-parameter state of a unified checkpoint (optimizer state, master weights, EMA) checked against its
parameters' shapes before anything is loaded, by the rules of `format/state_shapes.py`: on a resume against the live
model, the same for every engine (`load/loading.py` calls `check_saved_state` before the engine reads a tensor), and by
`verify` against the shapes the checkpoint's model files record (`recorded_state_problems`). Both read safetensors
headers and index metadata only, and this module imports no torch (`verify` imports none).

Codecs check their own stored tensors against their metadata when a reader first lists its tensors
(`format.reader.LogicalReader`); `verify` runs the same rules here on the headers."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ...errors import CorruptCheckpointError, UnsupportedCheckpointError, count_and_first
from ...format.components import MODEL, REGISTRY, Role
from ...format.headers import tensor_specs
from ...format.state_shapes import (MOMENT_CODEC, RESIDUAL_CODEC, Specs, codec_metadata_problems,
                                   codec_stored_problems, logical_specs, optimizer_state_problems,
                                   parameter_state_problems)
from ...store import join
from .files import read_json
from .safetensors_header import read_safetensors_header

FIX = ("Nothing was loaded. Its files were changed after the save (and its manifest rewritten to match them: a CRC-32 "
       "finds damage, not forgery), or it was saved for another model or optimizer. Resume from another checkpoint, "
       "or with the model and optimizer of the run that saved it.")


def state_problems(components: Mapping, weights: Mapping[str, tuple[int, ...]],
                   weight_of: Callable[[str], str | None]) -> list[str]:
    """One line ("file: 'key' problem") per tensor of the optimizer, master-weights and EMA `components` (name ->
    a reader with `specs()`, `metadata` and `file_of(name)`) that does not fit the parameter shapes `weights` (by
    weight name; `weight_of` maps an optimizer key's parameter name to its weight name)."""
    lines = []
    for name, view in components.items():
        role = REGISTRY[name].role if name in REGISTRY else None
        if role is Role.OPTIMIZER:
            types = view.metadata.get("state_types")
            found = optimizer_state_problems(view.specs(), lambda param: weights.get(weight_of(param)),
                                             types if isinstance(types, dict) else {})
        elif role is Role.PARAMETER_STATE:
            found = parameter_state_problems(view.specs(), weights)
        else:
            continue
        lines += [f"{view.file_of(key) or name}: {key!r} {problem}" for key, problem in found]
    return lines


def check_saved_state(folder, engine, readers: Mapping) -> None:
    """Refuse, before `engine` loads anything, a checkpoint whose optimizer state, master weights or EMA (`readers`:
    component name -> `ComponentReader`, whose codecs check their stored tensors when first listed) do not fit the
    live parameters (the engine's weights specs: full shapes on every engine; optimizer keys named as
    `engine.naming` keys them): `CorruptCheckpointError` naming each file and key, what it holds and what was
    expected. When the checkpoint's weights themselves have other shapes than the model's, the model is another
    one: `UnsupportedCheckpointError`, as for the weights. Collective where the engine's `specs` is (FSDP's first
    call): all ranks call it; otherwise headers only, no tensor read."""
    live = {spec.name: tuple(spec.shape) for spec in engine.specs(MODEL.name)}
    lines = state_problems(readers, live, engine.naming.weight_key)
    if not lines:
        return
    recorded = readers[MODEL.name].specs()
    other = [f"{n}: checkpoint {tuple(recorded[n][0])} vs model {shape}" for n, shape in live.items()
             if n in recorded and tuple(recorded[n][0]) != shape]
    if other:
        raise UnsupportedCheckpointError(f"shape mismatch between checkpoint and model in {count_and_first(other)}. "
                                         "Build the same architecture (config) as the run that saved it.")
    shown = "\n  ".join(lines[:20]) + ("\n  ..." if len(lines) > 20 else "")
    raise CorruptCheckpointError(f"checkpoint {str(folder)!r} holds state that does not fit the parameters of the "
                                 f"model being trained ({len(lines)} problem(s)):\n  {shown}\n{FIX}")


class RecordedComponent:
    """One component as its files record it, for `verify`: its index metadata, the stored and logical specs of its
    tensors (headers only) and the file of each. A codec's metadata and stored tensors are checked against each
    other (`problems`: lines "file: problem"); a component whose codec metadata is malformed lists no tensors."""

    def __init__(self, folder: str | os.PathLike, entry: Mapping, anchor: Specs | None = None):
        index = entry.get("index")
        if index:
            data = read_json(join(folder, index), "index file")
            data = data if isinstance(data, dict) else {}
            metadata, self.weight_map = data.get("metadata"), data.get("weight_map")
        else:
            metadata = {}
            self.weight_map = {key: file for file in entry.get("files", [])
                               for key in tensor_specs(read_safetensors_header(join(folder, file)))}
        self.metadata = metadata if isinstance(metadata, dict) else {}
        self.weight_map = self.weight_map if isinstance(self.weight_map, dict) else {}
        headers = {file: tensor_specs(read_safetensors_header(join(folder, file)))
                   for file in set(self.weight_map.values())}
        self.stored = {k: headers[f][k] for k, f in self.weight_map.items() if k in headers[f]}
        self.problems: list[str] = []
        self._logical = self._read_codec(index or "its index", anchor)

    def _read_codec(self, index: str, anchor: Specs | None) -> dict:
        meta = self.metadata.get("codec")
        if not (isinstance(meta, dict) and meta.get("name") in (MOMENT_CODEC, RESIDUAL_CODEC)):
            return dict(self.stored)  # stored as read (an unknown codec: the resume refuses it by name)
        malformed = codec_metadata_problems(meta)
        if malformed:
            self.problems += [f"{index}: the {meta['name']!r} codec metadata is malformed: {p}" for p in malformed]
            return {}
        anchor = anchor if meta["name"] == RESIDUAL_CODEC else None
        self.problems += [f"{self.file_of(key) or index}: {key!r} {p}"
                          for key, p in codec_stored_problems(meta, self.stored, anchor)]
        return logical_specs(meta, self.stored)

    def specs(self) -> dict:
        return dict(self._logical)

    def file_of(self, name: str) -> str | None:
        return self.weight_map.get(name)


def recorded_state_problems(folder: str | os.PathLike, manifest: Mapping) -> list[str]:
    """What `verify` finds of a checkpoint's per-parameter state against the shapes its model files record (after
    its files passed their size, checksum and header checks): codecs whose metadata or stored tensors disagree, and
    optimizer state, master weights or EMA that do not fit the recorded weights (an optimizer key's parameter by its
    name, or, for a PEFT adapter, by its name with the adapter name left out). Headers and index files only."""
    components = manifest.get("components") or {}
    if not isinstance(components, dict) or not isinstance(components.get(MODEL.name), dict):
        return []
    model = RecordedComponent(folder, components[MODEL.name])
    views = {name: RecordedComponent(folder, entry, anchor=model.stored) for name, entry in components.items()
             if name != MODEL.name and isinstance(entry, dict)}
    weights = {name: tuple(shape) for name, (shape, _) in model.specs().items()}
    lines = [line for view in (model, *views.values()) for line in view.problems]
    return lines + state_problems(views, weights, lambda param: _recorded_name(param, weights))


def _recorded_name(param: str, weights: Mapping) -> str | None:
    """The weight an optimizer key's parameter name stands for in the model files: the same name, else the one name
    they hold with one dotted part left out (a PEFT adapter's key: `...lora_A.default.weight` saved as
    `...lora_A.weight`); None when there is none or several."""
    if param in weights:
        return param
    parts = param.split(".")
    found = {".".join(parts[:i] + parts[i + 1:]) for i in range(len(parts))} & set(weights)
    return found.pop() if len(found) == 1 else None
