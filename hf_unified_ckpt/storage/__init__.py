"""Storage layer: how bytes land (safetensors shards, indexes, manifest, atomic commit, checksums)."""
