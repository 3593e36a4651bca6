"""Offline tools on checkpoints: the `hf-unified-ckpt` command line (`cli`), legacy → unified conversion
(`convert`), export of a model folder (`export`), LoRA merging (`merge_lora`)."""
