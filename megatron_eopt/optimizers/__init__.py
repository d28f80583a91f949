"""Optimizer classes: emerging_optimizers subclasses that know tensor parallelism."""
