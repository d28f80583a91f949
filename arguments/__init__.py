"""Megatron-compatible command-line flags (see the trainer issue)."""
