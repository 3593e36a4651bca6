"""The naming policy: what `save_pretrained` of the unwrapped model would call a tensor, and the optimizer keys.
Pure; `hf_model.naming_policy(module)` builds a `NamingPolicy` from a live model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .components import MODEL, Component

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


@dataclass(frozen=True)
class NamingPolicy:
    """Which live tensor is saved under which key, decided once from the unwrapped model (`hf_model.naming_policy`)
    and used by every engine: wrapper prefixes stripped (`canonical_name`), tied weights written once under the
    name `save_pretrained` keeps, PEFT adapter keys as `PeftModel.save_pretrained` writes them, and the stem of
    the weights' files.

    `tied` maps each tied name that is not written to the name it shares its tensor with; `adapter_map` (PEFT models
    only, None otherwise) maps each canonical live name PEFT saves to the key it saves it under (the adapter name
    removed, `modules_to_save` copies under the wrapped module's name), exactly as `get_peft_model_state_dict`
    names it."""

    file_stem: str = "model"
    tied: Mapping[str, str] = field(default_factory=dict)
    adapter_map: Mapping[str, str] | None = None

    @property
    def weights(self) -> Component:
        """The weights component, with this model's file stem (`adapter_model` for PEFT)."""
        return replace(MODEL, file_stem=self.file_stem)

    def key(self, live_name: str) -> str | None:
        """The key a live state-dict name is saved under, or None when `save_pretrained` does not write it (a tied
        name; a PEFT model's base weights)."""
        name = canonical_name(live_name)
        if self.adapter_map is not None:
            return self.adapter_map.get(name)
        return None if name in self.tied else name

    def weight_key(self, live_name: str) -> str | None:
        """The key a live parameter's values are written under in the weights files (a tied parameter listed once
        under either of its names: the written one), or None when they are not written (a PEFT base weight)."""
        if self.adapter_map is not None:
            return self.adapter_map.get(canonical_name(live_name))
        return self.stored_key(live_name)

    def stored_key(self, live_name: str) -> str:
        """The key a live tensor's optimizer state and master weights are keyed by: canonical, and for a tied name
        the name its tensor is saved under (for a PEFT model the canonical live name, adapter name included)."""
        name = canonical_name(live_name)
        return self.tied.get(name, name)

    def saved(self, state: Mapping[str, object]) -> dict[str, object]:
        """`state` (live names) restricted to what is saved, by saved key, in order."""
        return {key: value for name, value in state.items() if (key := self.key(name)) is not None}

    def to_live(self, saved: Mapping[str, object]) -> dict[str, object]:
        """`saved` (by saved key) by canonical live name, as loading a state dict into the live model expects: every
        tied name shares its source's value; a PEFT model's adapter keys go back to the live names they came from."""
        if self.adapter_map is not None:
            return {live: saved[key] for live, key in self.adapter_map.items() if key in saved}
        return {**saved, **{t: saved[s] for t, s in self.tied.items() if s in saved and t not in saved}}
