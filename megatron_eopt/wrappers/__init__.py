"""Wrappers that give torch optimizers megatron-core's optimizer contract (their sharded format: megatron_core_formats/dist_checkpointing.py)."""
