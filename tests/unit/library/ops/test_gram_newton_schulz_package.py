"""GPU tier: our Gram Newton-Schulz against the `gram-newton-schulz` package (Dao AI Lab), alone and
as the optimizer's backend (muon_gram_newton_schulz_package).

The package computes in float16 (we in bf16 under 'medium'), so the two agree to bf16
round-off only: 5e-2 relative (Frobenius), the same coefficients and restart steps given to
both. Skips with the reason when there is no CUDA device or no package.
"""

import importlib.util

import pytest
import torch

from megatron_eopt.ops.gram_newton_schulz import coefficient_schedule, gram_newton_schulz, restart_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"),
    pytest.mark.skipif(importlib.util.find_spec("gram_newton_schulz") is None,
                       reason="the gram-newton-schulz package (needs quack-kernels, nvidia-cutlass-dsl) is not installed"),
]


@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024)])
def test_equals_package(shape: tuple) -> None:
    from gram_newton_schulz import GramNewtonSchulz

    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    restarts = restart_steps(5)
    package = GramNewtonSchulz(ns_coefficients=[list(abc) for abc in coefficient_schedule("quintic", 5)],
                               gram_newton_schulz_reset_iterations=list(restarts))
    expected = package(x.clone()).float()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        got = gram_newton_schulz(x, 5, "quintic", restarts=restarts)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert ((got - expected).norm() / expected.norm()).item() <= 5e-2


def test_optimizer_with_package_kernels_equals_ours() -> None:
    """One TensorParallelMuon step on CUDA fc1/fc2-like weights: with the package (its kernels)
    within 5e-2 relative of ours at 'medium', and the blocks reported as the package's."""
    from megatron_eopt.ops.gram_newton_schulz_package import PACKAGE_PATH
    from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

    generator = torch.Generator("cuda").manual_seed(0)
    shapes = {"fc1": (4096, 1024), "fc2": (1024, 4096)}
    grads = {n: torch.randn(s, device="cuda", generator=generator) for n, s in shapes.items()}
    updates = {}
    for package in (False, True):
        params = {n: torch.nn.Parameter(torch.zeros(s, device="cuda")) for n, s in shapes.items()}
        optimizer = TensorParallelMuon([{"params": list(params.values()), "param_fqns": list(params)}], lr=1.0,
                                       momentum=0.0, weight_decay=0.0, fp32_matmul_prec="medium",
                                       gram_newton_schulz=True, gram_newton_schulz_package=package)
        for n, p in params.items():
            p.grad = grads[n].clone()
        optimizer.step()
        updates[package] = {n: p.detach().clone() for n, p in params.items()}
        if package:
            assert set(optimizer.newton_schulz_paths.values()) == {(PACKAGE_PATH,)}
    for n in shapes:
        assert ((updates[True][n] - updates[False][n]).norm() / updates[False][n].norm()).item() <= 5e-2, n
