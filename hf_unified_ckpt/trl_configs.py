"""TRL config classes with the unified-checkpoint fields (importing this module requires `trl`)."""

from __future__ import annotations

from trl import DPOConfig, SFTConfig

from .arguments import with_unified_checkpoint

UnifiedSFTConfig = with_unified_checkpoint(SFTConfig, name="UnifiedSFTConfig", module=__name__)
UnifiedDPOConfig = with_unified_checkpoint(DPOConfig, name="UnifiedDPOConfig", module=__name__)

__all__ = ["UnifiedSFTConfig", "UnifiedDPOConfig"]
