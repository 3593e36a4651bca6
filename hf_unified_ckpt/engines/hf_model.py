"""What `save_pretrained` would write for a model, computed without writing: tensor names, tied-weight
dedup, config files. Works for transformers models, PEFT models and plain `nn.Module`s."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from torch import nn

from ..errors import UnsupportedCheckpointError, count_and_first
from ..format.names import NamingPolicy, canonical_name

MODEL_STEM, ADAPTER_STEM = "model", "adapter_model"


def is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def naming_policy(module: nn.Module) -> NamingPolicy:
    """The naming policy of the unwrapped `module`: a PEFT model saves its adapter keys (`adapter_model` files);
    a transformers model leaves out the tied names it declares (`all_tied_weights_keys`, what `save_pretrained`
    leaves out); another module leaves out every name of a parameter shared under several names but the first."""
    if is_peft_model(module):
        return NamingPolicy(ADAPTER_STEM, adapter_map=_adapter_map(module))
    declared = getattr(module, "all_tied_weights_keys", None)
    if declared is not None:
        return NamingPolicy(MODEL_STEM, {canonical_name(t): canonical_name(s) for t, s in dict(declared).items()})
    shared: dict[int, list[str]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        shared[id(param)].append(canonical_name(name))
    return NamingPolicy(MODEL_STEM, {n: names[0] for names in shared.values() for n in names[1:]})


def _adapter_map(module: nn.Module) -> dict[str, str]:
    """Canonical live name -> adapter key of every tensor PEFT saves, from PEFT's own `get_peft_model_state_dict`
    applied to the live tensors (identity tells which live tensor each saved key is; works for partitioned and
    sharded parameters, whose values are never read)."""
    from peft import get_peft_model_state_dict

    live = module.state_dict(keep_vars=True)
    name_of = {id(t): canonical_name(n) for n, t in live.items()}
    saved = get_peft_model_state_dict(module, state_dict=live)
    unknown = sorted(k for k, t in saved.items() if id(t) not in name_of)
    if unknown:
        raise UnsupportedCheckpointError(
            f"PEFT saves {count_and_first(unknown, 'tensor')} that are not tensors of the model (computed when "
            "saved); unified checkpoints of this PEFT method are not supported. Set unified_checkpoint=False.")
    return {name_of[id(t)]: key for key, t in saved.items()}


def live_model_state(module: nn.Module, naming: NamingPolicy | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors that are saved, by the names its checkpoints key them before any weight conversion
    (`engines.conversion`): tied names once, a PEFT model's adapter keys (references, no copies)."""
    if is_peft_model(module):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(module)
    return (naming or naming_policy(module)).saved(module.state_dict())


def parameter_names(module: nn.Module, naming: NamingPolicy) -> dict[int, str]:
    """id(param) -> the name its optimizer state is keyed by (a tied parameter: the name its weights are saved
    under)."""
    return {id(param): naming.stored_key(name) for name, param in module.named_parameters()}


def model_config_files(module: nn.Module) -> dict[str, bytes]:
    """config.json / generation_config.json (or adapter_config.json and PEFT's adapter card README.md), as
    `save_pretrained` would write them: name -> bytes."""
    from ..store.capture import files_written_by

    return files_written_by(lambda folder: _save_configs(module, folder))


def _save_configs(module: nn.Module, folder: str) -> None:
    if is_peft_model(module):
        config = copy.deepcopy(module.peft_config[module.active_adapter])
        config.inference_mode = True
        config.save_pretrained(folder)
        module.create_or_update_model_card(folder)  # the adapter card, as PeftModel.save_pretrained writes it
    elif hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
        config = copy.deepcopy(module.config)
        if hasattr(module, "dtype"):
            config.dtype = str(module.dtype).split(".")[1]
        config.architectures = [type(module).__name__.removeprefix("FSDP")]
        config.save_pretrained(folder)
        generation = getattr(module, "generation_config", None)
        if generation is not None and getattr(module, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
