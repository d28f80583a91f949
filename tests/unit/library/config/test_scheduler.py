"""megatron-core's OptimizerParamScheduler drives our param groups.

The expected lr and weight decay are computed here from the formulas (linear warmup, cosine
decay to each group's own min_lr; linear weight-decay increment times wd_mult), independently
of megatron-core's implementation.
"""

import math

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.linear = torch.nn.Linear(4, 4)


def expected_lr(step: int, max_lr: float, min_lr: float, warmup: int, decay: int) -> float:
    if step <= warmup:
        return max_lr * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def test_scheduler_sets_per_group_lr_and_weight_decay() -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=5e-4, weight_decay=0.1)
    optimizer = get_megatron_optimizer(config, Model())
    groups = {g["group_key"]: g for g in optimizer.param_groups}
    decoupled = next(g for g in groups.values() if g["is_decoupled_lr"])
    default = next(g for g in groups.values() if g["default_config"])
    no_decay = next(g for g in groups.values() if g["wd_mult"] == 0.0)
    assert decoupled["max_lr"] == 5e-3 and decoupled["min_lr"] == 5e-4
    # Before any scheduler: lr is the group's max_lr, weight decay is wd * wd_mult.
    assert decoupled["lr"] == 5e-3 and default["lr"] == 1e-3
    assert default["weight_decay"] == pytest.approx(0.1) and no_decay["weight_decay"] == 0.0

    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=10, lr_decay_steps=100,
        lr_decay_style="cosine", start_wd=0.05, end_wd=0.15, wd_incr_steps=100, wd_incr_style="linear",
    )
    for step in (5, 40, 100):
        scheduler.step(step - scheduler.num_steps)
        wd = 0.05 + (0.15 - 0.05) * step / 100
        assert default["lr"] == pytest.approx(expected_lr(step, 1e-3, 1e-4, 10, 100), rel=1e-9)
        assert decoupled["lr"] == pytest.approx(expected_lr(step, 5e-3, 5e-4, 10, 100), rel=1e-9)
        assert default["weight_decay"] == pytest.approx(wd, rel=1e-9)
        assert no_decay["weight_decay"] == 0.0
    # The torch optimizer inside sees the same groups the scheduler wrote.
    inner = [g for child in optimizer.chained_optimizers for g in child.optimizer.param_groups]
    assert [g["lr"] for g in inner] == [g["lr"] for g in optimizer.param_groups]
