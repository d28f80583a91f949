"""Thresholds placed between data points, never on one.

A value computed two ways (the optimizer in fp32, a test in float64) can land on either side of a
threshold placed exactly on it, and which side depends on the CPU's rounding (docs/testing.md).
"""

import torch

# The least distance, relative to the threshold, from it to every data point: far above fp32
# round-off (~1e-6) of the values, so both computations agree on which points exceed it.
MARGIN = 1e-3


def threshold_between(values: torch.Tensor, above: int = 1, below: int = 1) -> tuple[float, float]:
    """(threshold midway in the widest gap between two sorted `values` that leaves at least `above`
    of them above it and `below` below it, its relative distance to the nearest value)."""
    ordered = values.flatten().double().sort().values
    if len(ordered) < above + below:
        raise ValueError(f"{len(ordered)} values cannot leave {above} above and {below} below a threshold")
    gaps = ordered[1:] - ordered[:-1]
    widest = (below - 1) + int(gaps[below - 1:len(ordered) - above].argmax())
    low, high = ordered[widest].item(), ordered[widest + 1].item()
    threshold = (low + high) / 2
    return threshold, (high - low) / 2 / abs(threshold)
