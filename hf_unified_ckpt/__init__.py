"""hf_unified_ckpt: engine- and world-size-independent safetensors checkpoints for the Hugging Face Trainer."""

__version__ = "0.1.0"

from .arguments import UnifiedCheckpointArguments, UnifiedCheckpointFields, with_unified_checkpoint  # noqa: E402
from .integration import UnifiedCheckpointCallback, UnifiedCheckpointMixin, attach  # noqa: E402
from .layout import Layout, detect_layout, newest_complete  # noqa: E402
from .options import UnifiedCheckpointOptions, parse_options  # noqa: E402

__all__ = [
    "__version__", "UnifiedCheckpointArguments", "UnifiedCheckpointFields", "with_unified_checkpoint",
    "UnifiedCheckpointCallback", "UnifiedCheckpointMixin", "attach", "Layout", "detect_layout",
    "newest_complete", "UnifiedCheckpointOptions", "parse_options",
]
