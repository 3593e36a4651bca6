"""Checkpoint algorithms, the same for every engine and every store (`..store`), in four parts by role (each may
import only the parts listed after it; docs/architecture.md, "Inside checkpoint/", is the table
`tests/architecture/test_layers.py` enforces):

- `folder/`: what a checkpoint folder is and its files over the store (file records, manifest, indexes and shards,
  headers, commit, folder kinds, rotation, the output_dir lease, RNG state); imports no other part;
- `write/`: the write strategies that put the bytes of planned files into the store; imports `folder`;
- `save/`: the save algorithm (sync and async), its snapshot, executors and writer process, the EMA; imports
  `folder` and `write`;
- `load/`: verify-then-load and machine-local folders (`placement`, `file_service`); imports `folder`.

The sub-packages' `__init__`s import nothing, so that `checkpoint.folder.layout` stays free of torch."""
