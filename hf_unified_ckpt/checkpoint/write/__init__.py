"""The write strategies (`writer.StorageWriter` and its kinds): how the bytes of the planned files land in the
store, in place (into the memory tier over spare files, snapshots placed: `memory_tier`), through a few
aggregators, whole by one rank, or as parts of one multipart upload (with the hand-overs between ranks it needs),
and what each rank reports of its part (`reports`). Imports `folder` only."""
