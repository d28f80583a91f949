"""Checkpoints without torch.distributed (one plain process): the same API, the same guarantees."""

import os

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])


def _step(model, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    optimizer.zero_grad()
    model(torch.randn(32, 8, generator=generator)).square().mean().backward()
    assert optimizer.step()[0]


def test_resume_without_torch_distributed_is_exact(tmp_path) -> None:
    assert not torch.distributed.is_initialized()
    model, optimizer = _model_and_optimizer(0)
    for step in range(6):
        _step(model, optimizer, step)
    expected = [p.detach().clone() for p in model.parameters()]

    model, optimizer = _model_and_optimizer(0)
    for step in range(3):
        _step(model, optimizer, step)
    save_checkpoint(str(tmp_path), 3, model, optimizer, extra={"consumed_samples": 96})
    model, optimizer = _model_and_optimizer(1)  # other initial values: all must come from the file
    loaded = load_checkpoint(str(tmp_path), model, optimizer)
    assert (loaded.iteration, loaded.extra) == (3, {"consumed_samples": 96})
    for step in range(3, 6):
        _step(model, optimizer, step)
    for value, reference in zip(model.parameters(), expected):
        assert torch.equal(value, reference)
    assert os.path.basename(latest_checkpoint(str(tmp_path))) == "iter_0000003"


def test_bad_arguments_are_named(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    with pytest.raises(ValueError, match="iteration must be an int >= 0"):
        save_checkpoint(str(tmp_path), -1, model, optimizer)
    with pytest.raises(TypeError, match="extra must be JSON-serialisable"):
        save_checkpoint(str(tmp_path), 1, model, optimizer, extra={"x": object()})
    with pytest.raises(TypeError, match="returned by get_megatron_optimizer"):
        save_checkpoint(str(tmp_path), 1, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="no checkpoint for iteration 7"):
        load_checkpoint(str(tmp_path), model, optimizer, iteration=7)
