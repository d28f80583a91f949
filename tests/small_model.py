"""A three-layer model and a step on seeded random gradients: the optimizer tests that compare two
runs of the same optimizer (offloaded and not) step both on the same model and gradients."""

import torch


def small_model(config) -> torch.nn.Module:
    """Linear, LayerNorm, Linear from seed 0, in bf16 where `config.bf16`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    return model.to(torch.bfloat16 if config.bf16 else torch.float32)


def step_on_random_grads(model: torch.nn.Module, optimizer, seed: int) -> None:
    """One successful step on gradients drawn from `seed`, then zero_grad()."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
    assert optimizer.step()[0]
    optimizer.zero_grad()
