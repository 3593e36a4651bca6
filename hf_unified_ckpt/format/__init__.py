"""The checkpoint format, pure: no I/O, no collectives. Names (`names`), the components of a checkpoint
(`components`), optimizer-state flattening (`optim_state`), codecs (`codecs`), shard planning and safetensors headers
(`planning`, `headers`), checksums (`checksum`), the read protocol and codec seam (`reader`), the lineage guard of
compression (`lineage`)."""
