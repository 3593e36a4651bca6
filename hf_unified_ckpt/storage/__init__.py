"""Storage layer: how bytes land (safetensors shards, indexes, manifest, atomic commit, checksums) and how they are
read back (`reader.TensorReader`). Only `safetensors_io` imports torch."""
