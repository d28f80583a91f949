"""megatron_eopt/training/curves.py: the interpolated iteration at which a validation curve reaches
a target, and the training-loss helpers (read_metrics: tests/unit/training/logging/test_training_log.py)."""

import pytest

from megatron_eopt.training import curves

def test_validation_reach_interpolates_between_evaluations() -> None:
    points = [(50, 4.0), (100, 3.0), (150, 2.0), (200, 1.5)]
    assert curves.validation_reach(points, 2.5) == pytest.approx(125.0)  # halfway from 3.0 to 2.0
    assert curves.validation_reach(points, 2.0) == pytest.approx(150.0)
    assert curves.validation_reach(points, 1.6) == pytest.approx(150 + 50 * 0.4 / 0.5)
    assert curves.validation_reach(points, 5.0) == 50.0  # already there at the first evaluation
    assert curves.validation_reach(points, 1.0) is None
    # A curve that rises again: the first crossing counts.
    assert curves.validation_reach([(10, 3.0), (20, 1.0), (30, 4.0), (40, 0.5)], 2.0) == pytest.approx(15.0)


def test_training_loss_helpers() -> None:
    losses = [float(i) for i in range(20, 0, -1)]  # 20, 19, ..., 1
    assert curves.final_loss(losses) == pytest.approx(sum(range(1, 11)) / 10)
    # Smoothed over 10: at iteration i (>= 10) the mean of 20-i+1 .. 20-i+10 is 25.5 - i.
    assert curves.iterations_to_reach(losses, 12.0) == 14
