"""The memory tier (`flash`): checkpoints saved into node-local memory, made durable by a persister process
that outlives the trainer (`persister.py`), restored from memory at any topology. `tier.py` is the training job's
side (lease, persister start, eviction, the end of training); this package's `__init__` imports nothing, so the
persister (`python -m hf_unified_ckpt.flash.persister`) loads no torch."""
