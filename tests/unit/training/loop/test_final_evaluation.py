"""--final-eval-iters: the final validation reads the split's first N batches (the same set for
every run) and keeps each batch's loss; without it the final validation continues where the
periodic ones stopped, as Megatron-LM's iterator does. A fake data source whose batch i has loss
i checks which batches were read."""

import argparse

import pytest
import torch

from megatron_eopt.training.loop import evaluation


def _evaluator(monkeypatch, **flags) -> tuple[evaluation.Evaluator, list]:
    monkeypatch.setattr(evaluation.dist, "all_reduce", lambda tensor, group=None: None)  # one rank
    results = []
    args = argparse.Namespace(eval_interval=10, eval_iters=2, final_eval_iters=None, **flags)
    rank_samples = lambda split, batch_index: [torch.full((2, 3), float(batch_index))]  # noqa: E731
    loss_fn = lambda model, tokens: (tokens.sum(), tokens.numel())  # noqa: E731  mean loss = batch index
    evaluator = evaluation.Evaluator(args, ("train", "valid"), rank_samples, loss_fn, None, False,
                                     on_result=results.append)
    return evaluator, results


def test_final_eval_iters_reads_the_first_batches_and_keeps_each_loss(monkeypatch) -> None:
    evaluator, results = _evaluator(monkeypatch)
    evaluator.final(torch.nn.Linear(1, 1), 30)  # periodic ones read batches 0..5: the final one 6 and 7
    assert results[-1].loss == pytest.approx(6.5) and results[-1].batch_losses is None

    evaluator.args.final_eval_iters = 4
    model = torch.nn.Linear(1, 1)
    evaluator.final(model, 30)
    assert results[-1].final and results[-1].loss == pytest.approx(1.5)  # batches 0, 1, 2, 3
    assert results[-1].batch_losses == pytest.approx((0.0, 1.0, 2.0, 3.0))
    assert model.training  # back in training mode
