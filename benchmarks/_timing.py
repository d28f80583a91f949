"""Interleaved step timing, shared by the single-process and the torchrun benchmarks."""

import json
import os
import statistics
import time
from typing import Callable, Optional


def interleaved_times(
    steps: dict[str, Callable[[], None]],
    prepare: dict[str, Callable[[], None]],
    warmup: int,
    repeats: int,
    before: Callable[[], None] = lambda: None,
    after: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds of each step in each round after `warmup` rounds.

    Every round runs each alternative once, the order rotated from round to round so that none
    always runs first (on a shared machine, load drifts between rounds, not within one);
    `prepare[name]` and `before` run untimed before the step, `after` inside the timing.
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            prepare[name]()
            before()
            start = time.perf_counter()
            steps[name]()
            after()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(row) for name, row in times.items()}


def write_json(path: Optional[str], record: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of numerator / denominator time: both ran in the same round, close in time."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))
