"""`export --merge-lora`: a PEFT/LoRA checkpoint's adapter merged into its base model, with PEFT's own
`merge_and_unload` (its scaling, fan-in/fan-out and DoRA rules, not a re-derivation).

The base model is loaded whole on the CPU (`from_pretrained` of `--base-model`, default the adapter config's
`base_model_name_or_path`): memory is one copy of the base model, not one shard. Imports transformers and PEFT.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .errors import UnsupportedCheckpointError

#: PEFT task type -> the transformers auto class that builds its base model.
_AUTO_CLASSES = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification",
                 "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM", "TOKEN_CLS": "AutoModelForTokenClassification",
                 "QUESTION_ANS": "AutoModelForQuestionAnswering", "FEATURE_EXTRACTION": "AutoModel"}


def base_model_path(checkpoint: Path, base_model: str | None) -> str:
    """Where the base model is: `base_model` when given, else the adapter config's `base_model_name_or_path`."""
    if base_model:
        return base_model
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    found = config.get("base_model_name_or_path")
    if not found:
        raise UnsupportedCheckpointError(
            f"{checkpoint}/adapter_config.json names no base model (base_model_name_or_path is empty: the model was "
            "built from a config, not loaded). Pass --base-model PATH_OR_HUB_ID, a folder from_pretrained loads.")
    return found


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


def merged_model(checkpoint: Path, adapter: dict, base_model: str) -> nn.Module:
    """The base model at `base_model` with the LoRA adapter described by `checkpoint`'s adapter config and holding
    `adapter` (tensors by adapter key, as `PeftModel.save_pretrained` names them) merged in."""
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    config = PeftConfig.from_pretrained(str(checkpoint))
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
