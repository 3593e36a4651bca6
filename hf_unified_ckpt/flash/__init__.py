"""The memory tier (`flash`): checkpoints saved into node-local memory, made durable by a persister process
that outlives the trainer (`persister.py`), restored from memory at any topology."""
