"""Readers of checkpoints written without this library (DeepSpeed `global_step*`, FSDP), tensor by tensor."""
