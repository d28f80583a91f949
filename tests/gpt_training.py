"""Training a small megatron-core GPTModel for a few steps: the loop the optimizer tests share.

    with model_parallel(tp=2, seed=7):
        model = build_gpt_model(SETTINGS)
        optimizer = get_megatron_optimizer(config, [model])
        run = train_steps(model, optimizer, token_batch(SETTINGS, batch=4, seed=1000), steps=4)
        run.losses, run.grad_norms, snapshot(model)

One step is: zero the gradients, the forward pass (``gpt_loss``, or the mean of the per-micro-batch
losses when the batch is a list), the backward pass (of the loss scaled by the optimizer when
``scale_loss``), the gradients averaged over a data-parallel group when one is given (what DDP does
before the optimizer runs), the optimizer's step, then ``after_step(step)``. What differs between
tests (the data, the averaging, loss scaling, how a step is taken) is an argument, so every test
keeps its numbers. Runs in a worker rank or in the test process alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_eopt import get_megatron_optimizer
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)

# One step's data: a batch [b, seq + 1], or micro-batches whose mean loss is the step's loss.
StepBatch = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass
class TrainedSteps:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[Any] = field(default_factory=list)  # what each step returned as its norm


def token_batch(settings: GPTModelSettings, batch: int, seed: int, batches: int | None = None) -> torch.Tensor:
    """Random tokens ``[batch, seq + 1]`` from ``seed``; ``batches`` of them stacked when given."""
    shape = (batch, settings.seq_length + 1) if batches is None else (batches, batch, settings.seq_length + 1)
    return torch.randint(0, settings.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def model_parallel(tp: int, seed: int, **sizes: Any) -> Iterator[None]:
    """megatron-core's parallel_state at tensor parallelism ``tp`` (the rest DP), torn down after."""
    initialize_model_parallel(tp, seed=seed, **sizes)
    try:
        yield
    finally:
        destroy_model_parallel()


def checked_step(optimizer) -> Any:
    """Our optimizers' step: fails if the step was skipped; returns the gradient norm."""
    ok, grad_norm, _ = optimizer.step()
    assert ok, "the optimizer skipped a step"
    return grad_norm


def unchecked_step(optimizer) -> Any:
    """A step whose result is not looked at (a torch optimizer returns None)."""
    result = optimizer.step()
    return result[1] if isinstance(result, tuple) else None


def train_steps(
    model: torch.nn.Module,
    optimizer,
    batch: StepBatch | Callable[[int], StepBatch],
    steps: int | range,
    *,
    average_grads_over: dist.ProcessGroup | None = None,
    scale_loss: bool = False,
    take_step: Callable[[Any], Any] = checked_step,
    after_step: Callable[[int], None] | None = None,
) -> TrainedSteps:
    """Take ``steps`` steps (a count from 0, or a range of step numbers) on ``batch``: the same
    batch every step, or ``batch(step)``. Returns each step's loss and gradient norm."""
    trained = TrainedSteps()
    for step in range(steps) if isinstance(steps, int) else steps:
        optimizer.zero_grad()
        loss = step_loss(model, batch(step) if callable(batch) else batch)
        (optimizer.scale_loss(loss) if scale_loss else loss).backward()
        if average_grads_over is not None:
            average_grads(model, average_grads_over)
        trained.grad_norms.append(take_step(optimizer))
        trained.losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return trained


def step_loss(model: torch.nn.Module, batch: StepBatch) -> torch.Tensor:
    if torch.is_tensor(batch):
        return gpt_loss(model, batch)
    return torch.stack([gpt_loss(model, micro) for micro in batch]).mean()


def average_grads(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """What DDP does before the optimizer runs: each gradient averaged over the DP group."""
    size = dist.get_world_size(group)
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)
        param.grad /= size


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> a copy of the parameter's value."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def snapshot(model: torch.nn.Module) -> dict:
    """name -> (value, partition_dim or -1, partition_stride): what `local_shard` needs."""
    return {
        name: (p.detach().clone(),
               getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1,
               getattr(p, "partition_stride", 1))
        for name, p in model.named_parameters()
    }


def local_shard(full: torch.Tensor, partition_dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """The part of a TP=1 tensor that TP rank `rank` of `size` holds (megatron's layout)."""
    if partition_dim < 0:
        return full
    # With partition_stride k the tensor is k blocks (e.g. [gate; up]), each split over ranks.
    blocks = full.chunk(stride, dim=partition_dim)
    return torch.cat([block.chunk(size, dim=partition_dim)[rank] for block in blocks], dim=partition_dim)


def train_gpt(settings: GPTModelSettings, config, tp: int, steps: int, seed: int, tokens: torch.Tensor) -> dict:
    """`steps` steps of our optimizer on one batch at tensor parallelism `tp` (megatron parallel_state):
    the losses, gradient norms, parameters (`snapshot`), param groups and this rank's TP rank."""
    with model_parallel(tp, seed):
        model = build_gpt_model(settings)
        optimizer = get_megatron_optimizer(config, [model])
        run = train_steps(model, optimizer, tokens, steps)
        return {
            "losses": run.losses,
            "norms": run.grad_norms,
            "params": snapshot(model),
            "groups": [(g["group_key"], len(g["params"])) for g in optimizer.param_groups],
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        }
