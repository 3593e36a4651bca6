"""Canonical parameter names: what `save_pretrained` of the unwrapped model would call a tensor. Pure."""

from __future__ import annotations

#: Path components inserted by wrappers (torch.compile, FSDP1, activation checkpointing).
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
#: Leading components inserted by DDP / DeepSpeed engine wrappers.
LEADING_WRAPPERS = ("module.",)


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes: `module._orig_mod.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight`
    becomes `model.layers.0.mlp.up_proj.weight`."""
    changed = True
    while changed:
        changed = False
        for prefix in LEADING_WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def optimizer_key(param_name: str, state_name: str) -> str:
    """The safetensors key of one piece of optimizer state: `<param name>/<state name>`."""
    if "/" in param_name:
        raise ValueError(f"parameter name {param_name!r} contains '/', which the optimizer key format reserves.")
    return f"{param_name}/{state_name}"


def split_optimizer_key(key: str) -> tuple[str, str]:
    """Inverse of `optimizer_key`."""
    param_name, sep, state_name = key.partition("/")
    if not sep or not param_name or not state_name:
        raise ValueError(f"optimizer key {key!r} is not of the form '<param name>/<state name>'.")
    return param_name, state_name
