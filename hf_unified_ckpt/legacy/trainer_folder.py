"""The model weights of a checkpoint the plain Trainer wrote, for a model whose weights transformers converts when
loading (Mixture-of-Experts: `save_pretrained` writes the experts one by one, the model holds them fused). The
Trainer's own resume loads those files with `load_state_dict(strict=False)`, so the expert weights are skipped as
unexpected keys without an error (transformers #48805); here they are put together by the model's conversion."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.folder.safetensors_io import ComponentReader
from ..engines.conversion import weight_conversion
from ..engines.hf_model import MODEL_STEM, is_peft_model, live_model_state
from ..errors import UnsupportedCheckpointError, missing_and_unexpected
from ..format.planning import TensorSpec


def load_converted_weights(module: nn.Module, folder: str) -> bool:
    """Load the weights files (`model*.safetensors`) of the Trainer checkpoint `folder` into `module` through its
    weight conversion. Returns False, loading nothing, when the model has no conversion (or is a PEFT model: its
    adapter files are keyed as it holds them). Raises naming the tensors when the files do not match the model.
    Local only (no collective)."""
    if is_peft_model(module):
        return False
    live = live_model_state(module)
    conversion = weight_conversion(module, [TensorSpec.of(n, t) for n, t in live.items()])
    if conversion is None:
        return False
    with ComponentReader(folder, MODEL_STEM) as saved:
        reader = conversion.reader(saved)
        missing, unexpected = sorted(set(live) - set(reader.keys())), sorted(set(reader.keys()) - set(live))
        if missing or unexpected:
            raise UnsupportedCheckpointError(
                f"the weights of {folder} do not match the model: {missing_and_unexpected(missing, unexpected)}. "
                "Build the same architecture (config) as the run that saved it.")
        with torch.no_grad():
            for name, target in live.items():
                target.copy_(reader.get(name))
    return True
