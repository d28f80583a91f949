"""Loss curves of trainer runs: the metrics file, smoothing, final losses, validation points, and
the iteration at which one run reaches another's final loss. Used by `make demo` and
benchmarks/convergence.py.

Training losses are per logged iteration (`--metrics-jsonl`, `--log-interval 1`) and smoothed over
WINDOW iterations. Validation losses are the trainer's periodic evaluations, from the metrics file's
evaluation records (VALIDATION_LINE finds their printed lines, for progress). The final evaluation
(`on validation set`) is left out: it reads other batches at the same iteration.
"""

import json
import re
import statistics
from typing import Optional

WINDOW = 10
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+0-9.eE]+|nan|inf)")


def smoothed(losses: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last `window` losses (fewer at the start) at each iteration."""
    return [statistics.fmean(losses[max(0, i + 1 - window):i + 1]) for i in range(len(losses))]


def iterations_to_reach(losses: list[float], target: float) -> Optional[int]:
    """First iteration (1-based, >= WINDOW) whose smoothed loss is <= target; None if never."""
    return next((i + 1 for i, loss in enumerate(smoothed(losses)) if i + 1 >= WINDOW and loss <= target), None)


def final_loss(losses: list[float]) -> float:
    return statistics.fmean(losses[-WINDOW:])


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """A --metrics-jsonl file's training records (one per logged iteration: `loss`, `lr`, ...)
    and evaluation records (`split`, `final`, `eval_loss`, `eval_ppl`), each in file order."""
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if "eval_loss" not in r], [r for r in records if "eval_loss" in r]


def validation_curve(evaluations: list[dict]) -> list[tuple[int, float]]:
    """(iteration, loss) of each periodic validation among read_metrics' evaluation records."""
    return [(r["iteration"], r["eval_loss"]) for r in evaluations if r["split"] == "valid" and not r["final"]]


def validation_reach(points: list[tuple[int, float]], target: float) -> Optional[float]:
    """The iteration at which the validation curve `points` first falls to `target`, linearly
    interpolated between the two evaluations around the crossing (the first evaluation's
    iteration if it is already at or below); None if no evaluation is."""
    previous = None
    for iteration, loss in points:
        if loss <= target:
            if previous is None:
                return float(iteration)
            before_iteration, before_loss = previous
            fraction = (before_loss - target) / (before_loss - loss)
            return before_iteration + fraction * (iteration - before_iteration)
        previous = (iteration, loss)
    return None
