"""What a checkpoint folder is, read and written over the store: file records and checksums, small files and
JSON, the manifest and its fields, safetensors shards, indexes and headers (read by byte ranges or memory-mapped),
staging and commit, the folder kinds (`layout`), rotation, the output_dir lease and the RNG state files. The bottom
of `checkpoint/`: it imports no other part of it, and what `info` / `verify` use of it imports no torch."""
