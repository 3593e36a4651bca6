"""`hf-unified-ckpt export`: a unified checkpoint's weights as a plain Hugging Face model folder.

The folder holds what `from_pretrained` (or `PeftModel.from_pretrained`, for an adapter checkpoint) and
`push_to_hub` expect: sharded safetensors + index (or one file), `config.json`, `generation_config.json`, tokenizer
files. `--weights ema` or `master` takes each tensor from that component where it has one (the trainable
parameters) and from the model weights otherwise (buffers, frozen parameters); decoded through the codecs like any
read. Memory is bounded by one shard; nothing is written over an existing folder. `--merge-lora` merges a LoRA
adapter (those weights) into its base model instead (`merge_lora.py`; memory: the base model).

The checkpoint and the new folder are store references (`store.base`): local paths or URLs. The folder is written
into a staging folder published in one rename where the store renames atomically, else in place.
"""

from __future__ import annotations

import logging
import os

import torch
from tqdm.auto import tqdm

from ..format.components import EMA, MASTER, MODEL
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..engines.hf_model import ADAPTER_STEM
from ..checkpoint.folder.layout import UNIFIED, detect_layout
from ..options import parse_size
from ..format.planning import TensorSpec, plan_component
from ..checkpoint.folder.files import read_json, write_json
from ..format.headers import TORCH_DTYPE_NAMES
from ..checkpoint.folder.manifest import MANIFEST_NAME, verify_folder
from ..checkpoint.folder.safetensors_io import ComponentReader, write_index, write_shard
from ..store import as_ref, is_file, join, listing, local_paths_of, name_of, put_bytes, read_bytes, store_for

logger = logging.getLogger(__name__)

WEIGHTS = {"model": MODEL.name, "master": MASTER.name, "ema": EMA.name}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Files of a checkpoint that belong to training, not to a model folder.
_TRAINING_FILES = ("trainer_state.json", "training_args.bin", "scheduler.pt", "scaler.pt", MANIFEST_NAME)


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, weights: str = "model",
           dtype: str | None = None, max_shard_size: str | int = "5GB", show_progress: bool = True,
           merge_lora: bool = False, base_model: str | None = None) -> str:
    """Write `checkpoint`'s `weights` (model, master or ema) into the new folder `out_dir`, cast to `dtype` (fp32,
    bf16, fp16; default: each tensor's own dtype, fp32 for master and EMA tensors). With `merge_lora`, those
    weights of a LoRA adapter merged into its base model (`base_model`, default the adapter config's): a plain
    model folder. Returns `out_dir` (a reference)."""
    checkpoint, out_dir = as_ref(checkpoint), as_ref(out_dir)
    require_new_folder(out_dir)
    if base_model and not merge_lora:
        raise ValueError("--base-model is only used with --merge-lora; add --merge-lora or drop --base-model.")
    layout = detect_layout(checkpoint)
    if layout.kind != UNIFIED or not layout.complete:
        raise UnsupportedCheckpointError(f"{checkpoint} is not a complete unified checkpoint ({layout.kind}: "
                                         f"{layout.not_unified_why}); export reads unified folders (convert a legacy "
                                         "one first).")
    components = layout.manifest["components"]
    wanted = WEIGHTS[weights]
    if wanted not in components:
        raise UnsupportedCheckpointError(
            f"{checkpoint} has no '{weights}' weights (it holds {sorted(components)}); "
            + {"ema": "train with the word 'ema' in unified_checkpoint_config to keep an EMA.",
               "master": "it was saved without fp32 master weights (none existed, or they were removed or skipped)."
               }.get(weights, ""))
    refuse_damaged(checkpoint, layout.manifest)
    stem = components[MODEL.name]["file_stem"]
    if merge_lora and stem != ADAPTER_STEM:
        raise UnsupportedCheckpointError(f"--merge-lora needs a PEFT/LoRA checkpoint (adapter_model files); {checkpoint} "
                                         f"holds '{stem}' files, a whole model already: export it without --merge-lora.")
    store = store_for(out_dir)
    staging = store.stage(out_dir)
    store.remove(staging)
    store.make_folder(staging)
    try:
        with ComponentReader(checkpoint, stem) as model, \
                ComponentReader(checkpoint, components[wanted]["file_stem"], anchor=model) as chosen:
            write = _write_merged if merge_lora else _write_weights
            write(model, chosen, staging, stem, DTYPES[dtype] if dtype else None, parse_size(max_shard_size),
                  f"Exporting {weights} weights to {name_of(out_dir)}" if show_progress else None,
                  **({"checkpoint": checkpoint, "base_model": base_model} if merge_lora else {}))
    except BaseException:
        store.remove(staging)
        raise
    _copy_model_files(checkpoint, staging, set(layout.manifest["files"]), skip=("adapter_config.json",) * merge_lora)
    if (dtype or weights != "model") and not merge_lora:  # master and EMA are fp32 unless cast
        _set_config_dtype(join(staging, "config.json"), DTYPES[dtype] if dtype else torch.float32)
    publish_folder(staging, out_dir)
    logger.info("Exported the %s weights of %s to %s", weights, checkpoint, out_dir)
    return out_dir


def refuse_damaged(checkpoint: str, manifest: dict) -> None:
    """Verify every file of `checkpoint` (sizes, headers and CRC-32s, as `verify`) before anything is written;
    refuse a damaged one, naming its files. Files of a bucket with a CRC-32 per block are checked as they are read."""
    problems = verify_folder(checkpoint, manifest, checked_on_read=local_paths_of(store_for(checkpoint)) is None)
    if problems:
        shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        raise CorruptCheckpointError(f"{checkpoint} failed verification ({len(problems)} problem(s)): {shown}. "
                                     "Nothing was written; export an earlier checkpoint, or restore the files.")


def require_new_folder(out_dir: str | os.PathLike) -> None:
    """Refuse to write into `out_dir` when it is a file or a folder that holds anything."""
    if is_file(out_dir) or listing(out_dir):
        raise FileExistsError(f"{as_ref(out_dir)} exists and is not empty; choose a new folder (nothing was written).")


def publish_folder(staging: str, out_dir: str) -> None:
    """Make the folder written into `staging` (`Store.stage(out_dir)`) the folder `out_dir`, which is missing or
    empty (`require_new_folder`)."""
    store = store_for(out_dir)
    if staging != out_dir and store.is_folder(out_dir):
        store.remove(out_dir)  # empty (checked before writing)
    store.publish(staging, out_dir)


def _write_weights(model, chosen, folder: str, stem: str, dtype, max_shard_size: int, progress: str | None) -> None:
    """The model's tensors, each from `chosen` where it has it, cast, in shards of at most `max_shard_size`."""
    model_specs, chosen_specs = model.specs(), chosen.specs()

    def dtype_of(name: str) -> torch.dtype:
        return dtype or getattr(torch, TORCH_DTYPE_NAMES[(chosen_specs.get(name) or model_specs[name])[1]])

    specs = [TensorSpec(n, tuple(shape), dtype_of(n)) for n, (shape, _) in model_specs.items()]
    _write_sharded(folder, stem, specs, lambda n: (chosen if n in chosen else model).get(n).to(dtype_of(n)),
                   max_shard_size, progress)


def _write_merged(model, chosen, folder: str, stem: str, dtype, max_shard_size: int, progress: str | None,
                  checkpoint: str, base_model: str | None) -> None:
    """The adapter (each tensor from `chosen` where it has it) merged into its base model, written as
    `save_pretrained` names the merged model's tensors, with its config files."""
    from ..engines.conversion import model_state_for_save
    from ..engines.hf_model import MODEL_STEM, model_config_files
    from .merge_lora import base_model_path, merged_model

    adapter = {n: (chosen if n in chosen else model).get(n) for n in model.keys()}
    merged = merged_model(checkpoint, adapter, base_model_path(checkpoint, base_model))
    if dtype is not None:
        merged = merged.to(dtype)
    state = model_state_for_save(merged)
    _write_sharded(folder, MODEL_STEM, [TensorSpec.of(n, t) for n, t in state.items()],
                   lambda n: state[n].detach().contiguous(), max_shard_size, progress)
    for name, data in sorted(model_config_files(merged).items()):
        put_bytes(join(folder, name), data)


def _write_sharded(folder: str, stem: str, specs: list[TensorSpec], get, max_shard_size: int,
                   progress: str | None) -> None:
    """Tensors `get(name)` of `specs` in shards of at most `max_shard_size`, with an index when sharded."""
    plan = plan_component(MODEL.name, specs, 1, max_shard_size, file_stem=stem, min_parallel=0)
    for file, names in tqdm(plan.files.items(), desc=progress, unit="file", disable=progress is None):
        write_shard(join(folder, file), {n: get(n) for n in names})
    if plan.is_sharded:
        write_index(folder, stem, plan.weight_map, plan.total_size)


def _set_config_dtype(config: str, dtype: torch.dtype) -> None:
    """Record the exported dtype in config.json, so that `from_pretrained(..., dtype="auto")` loads it as such."""
    if is_file(config):
        values = read_json(config, "config")
        values["dtype"] = str(dtype).removeprefix("torch.")
        values.pop("torch_dtype", None)
        write_json(config, values)


def _copy_model_files(checkpoint: str, folder: str, listed: set[str], skip: tuple[str, ...] = ()) -> None:
    """Configs, generation config, adapter config and tokenizer files: every small file of the checkpoint that is
    not a tensor file, an index, a training file, or in `skip`."""
    for name, size in sorted(listing(checkpoint).items()):
        if (size is not None and not name.endswith((".safetensors", ".safetensors.index.json", ".pth"))
                and name not in _TRAINING_FILES and name in listed and name not in skip):
            put_bytes(join(folder, name), read_bytes(join(checkpoint, name)))
