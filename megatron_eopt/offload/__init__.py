"""Optimizer state kept on the host between steps (docs/memory.md)."""
