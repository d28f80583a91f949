"""Wrappers that give torch optimizers megatron-core's optimizer contract."""
