"""Checkpoint algorithms, the same for every engine and every store (`..store`): save (sync and async) and the
persist job, verify and load, folder kinds (`layout`), machine-local folders (`placement`, `file_service`),
rotation, RNG state, the EMA, and the format's files over the store (indexes, manifest, commit, writers)."""
