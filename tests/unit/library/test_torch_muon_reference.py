"""Our Muon against an outside reference, torch.optim.Muon (torch >= 2.9), where their settings coincide.

The mapping (docs/tp-muon.md, "torch.optim.Muon"): adjust_lr_fn='original' is
muon_scale_mode='shape_scaling'; 'match_rms_adamw' is 'spectral' with muon_match_adamw_rms=True;
torch's ns_coefficients (3.4445, -4.7750, 2.0315) repeated are muon_coefficient_type='simple';
ns_steps is muon_num_ns_steps; nesterov is muon_nesterov; both decay p by (1 - lr * wd)
(decoupled_weight_decay=True) and keep an EMA momentum. torch always casts the Newton-Schulz input
to bf16; to compare at fp32 round-off its step runs with `Tensor.bfloat16` returning the fp32
tensor, so the reference is torch's own code in fp32, and ours runs muon_fp32_matmul_prec='highest'.
Matrices: tall, wide and square; no gradient clipping; 4 steps.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.runtime.process_groups import ParallelGroups

SHAPES = {"tall": (48, 16), "wide": (16, 40), "square": (24, 24)}
LR, WEIGHT_DECAY, MOMENTUM, STEPS = 0.02, 0.1, 0.9, 4
SCALE_MODES = {"original": {"muon_scale_mode": "shape_scaling"},
               "match_rms_adamw": {"muon_scale_mode": "spectral", "muon_match_adamw_rms": True}}


class Matrices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=generator)))


def _grads(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _ours(adjust_lr_fn: str, nesterov: bool) -> Matrices:
    model = Matrices()
    config = OptimizerConfig(optimizer="muon", lr=LR, min_lr=0.0, weight_decay=WEIGHT_DECAY, clip_grad=0.0,
                             muon_momentum=MOMENTUM, muon_nesterov=nesterov, muon_coefficient_type="simple",
                             muon_num_ns_steps=5, muon_fp32_matmul_prec="highest", **SCALE_MODES[adjust_lr_fn])
    optimizer = get_megatron_optimizer(config, [model], config_overrides={},
                                       pg_collection=ParallelGroups.single_process())
    for step in range(STEPS):
        for name, grad in _grads(step).items():
            getattr(model, name).grad = grad
        assert optimizer.step()[0]
    return model


def _torch(adjust_lr_fn: str, nesterov: bool, monkeypatch) -> Matrices:
    model = Matrices()
    optimizer = torch.optim.Muon(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                                 nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())  # its Newton-Schulz in fp32
        for step in range(STEPS):
            for name, grad in _grads(step).items():
                getattr(model, name).grad = grad
            optimizer.step()
    return model


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("adjust_lr_fn", sorted(SCALE_MODES))
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_equals_torch_optim_muon(adjust_lr_fn: str, nesterov: bool, monkeypatch) -> None:
    ours, reference = _ours(adjust_lr_fn, nesterov), _torch(adjust_lr_fn, nesterov, monkeypatch)
    start = Matrices()
    for name in SHAPES:
        moved = (getattr(reference, name) - getattr(start, name)).abs().max().item()
        error = (getattr(ours, name) - getattr(reference, name)).abs().max().item()
        assert moved > 1e-2, (name, moved)  # the comparison is about steps that moved the matrix
        assert error <= 2e-6, (name, adjust_lr_fn, nesterov, error)
