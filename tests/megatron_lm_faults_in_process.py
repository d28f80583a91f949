"""Faults in Megatron-LM's loop inside the harness's workers (tests/megatron_lm_in_process.py):
an inf in the loss on one rank at one iteration, and what the optimizer held before and after it.

    run = run_distributed(run_with_inf_loss, 2, args=(argv, rank, iteration))

Each rank returns a `FaultRun`: the loop's records (loss scale and skipped flag per iteration),
and this rank's parameters and optimizer state as the faulted iteration began and as it ended.
"""

import contextlib
import copy
import dataclasses
from typing import Any, Iterator, Optional

from tests.megatron_lm_in_process import Run, _local, _torch_states, run_megatron_lm


@dataclasses.dataclass
class FaultRun:
    run: Run
    before: Optional[dict] = None  # {"parameters": ..., "optimizer": ...} as the faulted iteration began
    after: Optional[dict] = None  # the same as it ended


def state_of(model: list, optimizer: Any) -> dict:
    """This rank's parameters and optimizer state (ours: state_dict(); megatron-core's: its torch
    optimizers' state), copied."""
    ours = type(optimizer).__module__.split(".")[0] == "megatron_eopt"
    return {
        "parameters": {f"{i}.{name}": _local(p.detach()).clone() for i, chunk in enumerate(model)
                       for name, p in chunk.named_parameters()},
        "optimizer": _local(copy.deepcopy(optimizer.state_dict() if ours else _torch_states(optimizer))),
    }


def states_equal(first: Any, second: Any) -> bool:
    """Bitwise equal, through nested dicts and lists."""
    import torch

    if isinstance(first, dict):
        return isinstance(second, dict) and first.keys() == second.keys() and all(
            states_equal(first[k], second[k]) for k in first)
    if isinstance(first, (list, tuple)):
        return isinstance(second, (list, tuple)) and len(first) == len(second) and all(
            states_equal(a, b) for a, b in zip(first, second))
    if torch.is_tensor(first):
        return torch.is_tensor(second) and first.dtype == second.dtype and torch.equal(first, second)
    return first == second


def all_finite(state: Any) -> bool:
    """No NaN or inf in any floating-point tensor, through nested dicts and lists."""
    import torch

    if isinstance(state, dict):
        return all(all_finite(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(value) for value in state)
    return not (torch.is_tensor(state) and state.is_floating_point() and not torch.isfinite(state).all())


@contextlib.contextmanager
def _around_iteration(iteration: int, result: FaultRun) -> Iterator[None]:
    """Snapshots of the state before and after Megatron-LM's train_step of `iteration`."""
    import megatron.training.training as training
    from megatron.training import get_args

    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        now = get_args().curr_iteration + 1  # the loop sets curr_iteration to N - 1 before step N
        if now == iteration:
            result.before = state_of(model, optimizer)
        output = original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        if now == iteration:
            result.after = state_of(model, optimizer)
        return output

    training.train_step = train_step
    try:
        yield
    finally:
        training.train_step = original


@contextlib.contextmanager
def _inf_loss(on_rank: int, rank: int, iteration: int) -> Iterator[None]:
    """The loss of each micro-batch of `iteration` on `on_rank` times inf: the scaled loss's
    gradients overflow (inf, and NaN where inf meets 0), as an fp16 overflow does."""
    import torch
    from megatron.training import get_args

    from megatron_eopt.integrations import megatron_lm_gpt

    original = megatron_lm_gpt.loss_func

    def loss_func(loss_mask, per_token_loss):
        loss, *rest = original(loss_mask, per_token_loss)
        if rank == on_rank and get_args().curr_iteration + 1 == iteration:
            loss = loss * torch.tensor(float("inf"))
        return (loss, *rest)

    megatron_lm_gpt.loss_func = loss_func
    try:
        yield
    finally:
        megatron_lm_gpt.loss_func = original


def run_with_inf_loss(rank: int, world_size: int, argv: list[str], on_rank: int, iteration: int) -> FaultRun:
    result = FaultRun(Run())
    with _around_iteration(iteration, result), _inf_loss(on_rank, rank, iteration):
        result.run = run_megatron_lm(rank, world_size, argv)
    return result
