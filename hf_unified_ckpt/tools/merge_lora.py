"""`export --merge-lora`: a PEFT/LoRA checkpoint's adapter merged into its base model, with PEFT's own
`merge_and_unload` (its scaling, fan-in/fan-out and DoRA rules, not a re-derivation).

The base model is loaded whole on the CPU (`from_pretrained` of `--base-model`, default the adapter config's
`base_model_name_or_path`): memory is one copy of the base model, not one shard. Imports transformers and PEFT.
The checkpoint is a store reference (`store.base`): its adapter config is read through its store.
"""

from __future__ import annotations

import os

from torch import nn

from ..errors import UnsupportedCheckpointError
from ..checkpoint.folder.files import read_json
from ..store import as_ref, join

#: The adapter config PEFT writes next to the adapter weights.
ADAPTER_CONFIG = "adapter_config.json"

#: PEFT task type -> the transformers auto class that builds its base model.
_AUTO_CLASSES = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification",
                 "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM", "TOKEN_CLS": "AutoModelForTokenClassification",
                 "QUESTION_ANS": "AutoModelForQuestionAnswering", "FEATURE_EXTRACTION": "AutoModel"}


def adapter_config(checkpoint: str | os.PathLike) -> dict:
    """The adapter config of `checkpoint` (its adapter_config.json), as a dict."""
    return read_json(join(checkpoint, ADAPTER_CONFIG), "adapter config")


def base_model_path(checkpoint: str | os.PathLike, base_model: str | None) -> str:
    """Where the base model is: `base_model` when given, else the adapter config's `base_model_name_or_path`."""
    if base_model:
        return base_model
    found = adapter_config(checkpoint).get("base_model_name_or_path")
    if not found:
        raise UnsupportedCheckpointError(
            f"{join(checkpoint, ADAPTER_CONFIG)} names no base model (base_model_name_or_path is empty: the model was "
            "built from a config, not loaded). Pass --base-model PATH_OR_HUB_ID, a folder from_pretrained loads.")
    return found


def _peft_config(checkpoint: str):
    """`checkpoint`'s adapter config as PEFT's config object (what `PeftConfig.from_pretrained` builds from the
    same JSON, read here through the store)."""
    from peft import PeftConfig

    values = adapter_config(checkpoint)
    values.pop("runtime_config", None)  # runtime only: PeftConfig.from_json_file drops it too
    return PeftConfig.from_peft_type(**PeftConfig.check_kwargs(**values))


def _base_class(base_model: str, config):
    """The class that builds the base model: its config's architecture, else the PEFT task type's auto class."""
    import transformers

    try:
        architectures = transformers.AutoConfig.from_pretrained(base_model).architectures or []
    except OSError as e:
        raise UnsupportedCheckpointError(f"cannot read the base model's config at {base_model!r} ({e}); pass "
                                         "--base-model with a folder or Hub id that from_pretrained loads.") from None
    if architectures and hasattr(transformers, architectures[0]):
        return getattr(transformers, architectures[0])
    task = str(getattr(config.task_type, "value", config.task_type))
    return getattr(transformers, _AUTO_CLASSES.get(task, "AutoModel"))


def merged_model(checkpoint: str | os.PathLike, adapter: dict, base_model: str) -> nn.Module:
    """The base model at `base_model` with the LoRA adapter described by `checkpoint`'s adapter config and holding
    `adapter` (tensors by adapter key, as `PeftModel.save_pretrained` names them) merged in."""
    from peft import get_peft_model, set_peft_model_state_dict

    config = _peft_config(as_ref(checkpoint))
    try:
        base = _base_class(base_model, config).from_pretrained(base_model, dtype="auto")
    except OSError as e:
        raise UnsupportedCheckpointError(f"cannot load the base model {base_model!r} ({e}); pass --base-model with "
                                         "a folder or Hub id that from_pretrained loads.") from None
    model = get_peft_model(base, config)
    result = set_peft_model_state_dict(model, adapter)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UnsupportedCheckpointError(f"the adapter does not fit the base model {base_model!r}: unexpected "
                                         f"{sorted(unexpected)[:5]}; pass the base model the adapter was trained on.")
    return model.merge_and_unload()
