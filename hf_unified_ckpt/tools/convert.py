"""Offline conversion of a legacy checkpoint folder (DeepSpeed or FSDP) into a unified one: no process group, one shard of tensors
in memory at a time (`max_shard_size`), written with the same save algorithm as training uses. A DeepSpeed model folder
written by `Trainer.save_model` (ZeRO partitions, no weights file, no trainer state) converts too: the result loads
with from_pretrained and carries the partitions' optimizer state and master weights, but no trainer state."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ..engines.conversion import WithConversion, weight_conversion
from ..format.components import MODEL, OPTIMIZER, Component, component
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .export import require_new_folder
from ..checkpoint.folder.files import read_json
from ..checkpoint.folder.layout import DEEPSPEED, FSDP, detect_layout
from ..legacy import legacy_components, open_legacy
from ..legacy.sources import TensorSource
from ..options import parse_options
from ..format.planning import TensorSpec
from ..checkpoint.save.saving import SaveRequest, save_checkpoint
from ..store import as_ref, is_file, is_folder, join, listing, read_bytes, remove

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Files of a legacy folder that the conversion regenerates or drops (weights, engine internals, scripts).
_NOT_COPIED = {"latest", "zero_to_fp32.py", "zero_to_torch.py", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model_fsdp.bin", "optimizer.bin"}


class OfflineEngine:
    """An `EngineAdapter` over tensor sources, for writing without a training engine (world size 1)."""

    engine = "offline"

    def __init__(self, sources: dict[str, TensorSource], saved_by: dict):
        self.sources = sources
        self._saved_by = saved_by

    def saved_by(self) -> dict:
        return dict(self._saved_by)

    def components(self) -> list[Component]:
        return [component(name) for name in self.sources]

    def specs(self, component: str) -> list[TensorSpec]:
        source = self.sources[component]
        return [TensorSpec(n, tuple(source.specs()[n][0]), source.dtype(n)) for n in source.keys()]

    def preferred_owners(self, component: str) -> dict[str, int]:
        return {}

    def exchange(self, component: str, names, owner: int) -> None:
        """Nothing to assemble: one process holds (lazily) everything."""

    def tensors(self, component: str, names) -> Mapping[str, torch.Tensor]:
        """The tensors `names`, each read from the legacy files when looked up (not kept: the writer streams a file
        tensor by tensor, reading the next while it writes one)."""
        return _OnLookup(self.sources[component], tuple(names))

    def fragments(self, component: str, names=None) -> dict:
        """None: the one process writes every tensor whole."""
        return {}

    def optimizer_metadata(self) -> dict:
        return self.sources[OPTIMIZER.name].metadata

    def config_files(self) -> dict[str, bytes]:
        """Nothing: the configs come with the legacy folder's other small files (`_extra_files`)."""
        return {}


class _OnLookup(Mapping):
    """`names` of a `TensorSource`, each computed anew when looked up."""

    def __init__(self, source: TensorSource, names: tuple[str, ...]):
        self._source, self._names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._source.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def convert(legacy_dir: str | os.PathLike, out_dir: str | os.PathLike, max_shard_size: str | int = "100MB",
            show_progress: bool = True, ckpt_quant_stage: str = "O0", direct_io: bool = True,
            trust_pickles: bool = False) -> str:
    """Convert `legacy_dir` (a DeepSpeed `checkpoint-N` or save_model folder, or an FSDP `checkpoint-N` folder)
    into a complete unified folder `out_dir` (a store reference: a local path or a URL), its optimizer moments
    compressed at `ckpt_quant_stage` (O0/O1/O2), written with direct I/O where asked and the filesystem takes it.
    Its pickles are read with `weights_only` and an allow-list (a file needing more is refused before anything is
    written), or whole with `trust_pickles` (a folder the user trusts). Returns `out_dir`."""
    legacy_dir, out_dir = as_ref(legacy_dir), as_ref(out_dir)
    require_new_folder(out_dir)
    layout = detect_layout(legacy_dir)
    if layout.kind not in (DEEPSPEED, FSDP) or not layout.complete:
        raise UnsupportedCheckpointError(
            f"{legacy_dir} is a {'complete' if layout.complete else 'incomplete'} '{layout.kind}' folder"
            f"{': ' + layout.reason if layout.reason else ''}; convert reads complete DeepSpeed folders "
            "(checkpoint-N with global_stepN/ ZeRO partitions, or a folder written by Trainer.save_model under "
            "ZeRO-3 without 16-bit weights) and FSDP folders (pytorch_model_fsdp_0/ + "
            "optimizer_0/, or pytorch_model_fsdp.bin + optimizer.bin).")
    legacy = open_legacy(layout, for_conversion=True, trust_pickles=trust_pickles)
    engine = with_weight_conversion(OfflineEngine(legacy_components(legacy), legacy.saved_by()), legacy_dir)
    options = parse_options(True, ckpt_quant_stage=ckpt_quant_stage, max_shard_size=max_shard_size)
    step = layout.global_step if layout.global_step is not None else legacy.global_step
    request = SaveRequest(out_dir, step, options, show_progress=show_progress, direct_io=direct_io)
    if is_folder(out_dir):
        remove(out_dir)  # empty (checked above): the commit renames the staging folder into place
    out = save_checkpoint(engine, request, _extra_files(legacy_dir))
    if not is_file(join(out, "config.json")):
        logger.warning("%s has no config.json (the Trainer's sharded FSDP save does not write one): the converted "
                       "folder resumes training, but from_pretrained needs a config.json copied next to it.",
                       legacy_dir)
    return out


def with_weight_conversion(engine, folder: str):
    """`engine` keyed as `save_pretrained` writes the model of `folder`'s config.json (a Mixture-of-Experts model's
    fused experts per expert: `engines.conversion`), worked out on a model built on the meta device; `engine` itself
    for a model without conversions, an adapter folder, or a folder without config.json."""
    if not is_file(join(folder, "config.json")) or is_file(join(folder, "adapter_config.json")):
        return engine
    config = read_json(join(folder, "config.json"), "config")
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{join(folder, 'config.json')} is not a JSON object; the folder is damaged.")
    module = _meta_model(config)
    conversion = None if module is None else weight_conversion(module, engine.specs(MODEL.name))
    return engine if conversion is None else WithConversion(engine, conversion)


def _meta_model(config: dict):
    """The model `config` (config.json) describes, built on the meta device (no memory); None when transformers
    does not know it."""
    import torch
    import transformers

    config = dict(config)
    try:
        built = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    except (KeyError, ValueError):
        return None
    cls = getattr(transformers, (built.architectures or [""])[0], None)
    if cls is None:
        return None
    with torch.device("meta"):
        return cls(built)


def _extra_files(legacy_dir: str) -> dict[str, bytes]:
    """The legacy folder's small files that the unified folder keeps (configs, tokenizer, trainer state, RNG
    state, scheduler), name in the unified folder -> bytes."""
    files = {}
    for name, size in sorted(listing(legacy_dir).items()):
        if size is None or name in _NOT_COPIED:
            continue
        files["rng_state_0.pth" if name == "rng_state.pth" else name] = read_bytes(join(legacy_dir, name))
    return files
