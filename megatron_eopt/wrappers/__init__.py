"""Wrappers that give torch optimizers megatron-core's optimizer contract (their sharded format: checkpointing/megatron_sharded.py)."""
