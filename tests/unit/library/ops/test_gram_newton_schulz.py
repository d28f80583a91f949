"""Gram Newton-Schulz against the standard iteration (CPU).

- float64: the same polynomial as the standard iteration, equal to 1e-10 (measured <= 1e-13),
  for every coefficient type, wide and tall, 2-D and batched, with and without restarts.
- The coefficient of every step is the one emerging_optimizers' newton_schulz uses (recorded).
- FLOPs: `gram_flops`/`standard_flops` equal torch's FlopCounterMode count of the runs.
- fp32 ('highest'): within 1e-3 relative of emerging_optimizers' newton_schulz on Gaussian,
  1e-6-conditioned and rank-deficient inputs (measured <= 3e-5).
- bf16 ('medium', the stress test that chose the restart policy): against the float64
  polynomial, the Gram path's relative error is within 3x the standard bf16 iteration's (floor
  0.01) on the same inputs, for every (type, steps) that `gram_stable` admits.
"""

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils
from torch.utils.flop_counter import FlopCounterMode

from megatron_eopt.ops.gram_newton_schulz import (
    coefficient_schedule,
    gram_flops,
    gram_newton_schulz,
    gram_pays,
    gram_stable,
    restart_steps,
    standard_flops,
)
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, coefficient_types


def standard_float64(x: torch.Tensor, steps: int, coefficient_type: str) -> torch.Tensor:
    """The standard iteration, written out, in float64 (emerging_optimizers' takes fp32 only)."""
    transpose = x.size(-2) > x.size(-1)
    X = torch.nn.functional.normalize(x.mT if transpose else x, p=2, dim=(-2, -1), eps=1e-7)
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if transpose else X


def stress_inputs(m: int = 64, n: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, m, dtype=torch.float64, generator=g))
    rank_deficient = torch.ones(m, dtype=torch.float64)
    rank_deficient[m // 4:] = 0
    low_rank = torch.randn(m, 8, dtype=torch.float64, generator=g) @ torch.randn(8, n, dtype=torch.float64, generator=g)
    return {
        "gaussian": torch.randn(m, n, dtype=torch.float64, generator=g),
        "condition 1e6": u @ torch.diag(torch.logspace(0, -6, m, dtype=torch.float64)) @ v.T,
        "rank m/4": u @ torch.diag(rank_deficient) @ v.T,
        "rank 8 + noise": low_rank + 1e-3 * torch.randn(m, n, dtype=torch.float64, generator=g),
    }


@pytest.mark.parametrize("coefficient_type", coefficient_types())
@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (3, 24, 80)])
def test_float64_same_polynomial(coefficient_type: str, shape: tuple) -> None:
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for steps in (1, 5, 10):
        expected = standard_float64(x, steps, coefficient_type)
        for restarts in ((), restart_steps(steps), tuple(range(1, steps))):
            got = gram_newton_schulz(x, steps, coefficient_type, restarts=restarts)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["condition 1e6", "rank m/4"])
def test_float64_ill_conditioned_and_rank_deficient(name: str) -> None:
    x = stress_inputs()[name]
    torch.testing.assert_close(gram_newton_schulz(x, 5), standard_float64(x, 5, "quintic"), rtol=0, atol=1e-10)


@pytest.mark.parametrize("coefficient_type", coefficient_types())
def test_coefficients_are_emerging_optimizers(coefficient_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for steps in range(1, 13):
        used = []
        monkeypatch.setattr(muon_utils, "newton_schulz_step", lambda X, a, b, c, tp_group=None: used.append((a, b, c)) or X)
        muon_utils.newton_schulz(torch.ones(2, 3), steps, coefficient_type)
        assert coefficient_schedule(coefficient_type, steps) == [tuple(map(float, abc)) for abc in used]


@pytest.mark.parametrize("shape, steps", [((32, 128), 5), ((32, 32), 5), ((16, 80), 10), ((2, 16, 48), 8)])
def test_flop_counts_are_exact(shape: tuple, steps: int) -> None:
    x = torch.randn(shape)
    m, n = shape[-2:]
    batch = shape[0] if len(shape) == 3 else 1
    with torch.no_grad():
        for restarts in ((), restart_steps(steps)):
            with FlopCounterMode(display=False) as counter:
                gram_newton_schulz(x, steps, restarts=restarts)
            assert counter.get_total_flops() == batch * gram_flops(m, n, steps, restarts)
        with FlopCounterMode(display=False) as counter:
            muon_utils.newton_schulz(x, steps)
        assert counter.get_total_flops() == batch * standard_flops(m, n, steps)


def test_per_block_choice() -> None:
    five = restart_steps(5)
    assert five == (3,)
    assert gram_pays(1024, 4096, 5, five) and not gram_pays(1024, 1024, 5, five)
    assert gram_flops(1024, 4096, 5, five) / standard_flops(1024, 4096, 5) == pytest.approx(60 / 90)
    settings = NewtonSchulzSettings(gram=True)
    assert settings.takes_gram_path(4096, 1024, "medium")  # tall: transposed, Gram on 1024 x 1024
    assert not settings.takes_gram_path(4096, 1024, "medium", transpose=False)
    assert not NewtonSchulzSettings().takes_gram_path(1024, 4096, "medium")  # off by default
    assert not NewtonSchulzSettings(num_steps=8, coefficient_type="polar_express", gram=True).takes_gram_path(
        64, 1024, "medium")  # not stable in bf16: the standard path
    assert NewtonSchulzSettings(num_steps=8, coefficient_type="polar_express", gram=True).takes_gram_path(
        64, 1024, "highest")


@pytest.mark.parametrize("name", ["gaussian", "condition 1e6", "rank m/4", "rank 8 + noise"])
def test_fp32_equals_emerging_optimizers(name: str) -> None:
    x = stress_inputs()[name].float()
    with torch.no_grad():
        torch.set_float32_matmul_precision("highest")
        for coefficient_type in ("quintic", "polar_express"):
            expected = muon_utils.newton_schulz(x, 5, coefficient_type)
            got = gram_newton_schulz(x, 5, coefficient_type)
            assert ((got - expected).norm() / expected.norm()).item() <= 1e-3, coefficient_type


@pytest.mark.parametrize("coefficient_type, steps", [(t, s) for t in coefficient_types() for s in (5, 10)])
def test_bf16_stress(bf16_products, coefficient_type: str, steps: int) -> None:
    if not gram_stable(coefficient_type, steps, "medium"):
        pytest.skip(f"{coefficient_type} x {steps} steps takes the standard path in bf16 (gram_stable)")
    previous = torch.get_float32_matmul_precision()
    try:
        for seed in (0, 1):
            for name, x in stress_inputs(seed=seed).items():
                exact = standard_float64(x, steps, coefficient_type)
                torch.set_float32_matmul_precision("medium")
                standard = muon_utils.newton_schulz(x.float(), steps, coefficient_type).double()
                gram = gram_newton_schulz(x.float(), steps, coefficient_type).double()
                torch.set_float32_matmul_precision(previous)
                standard_error = ((standard - exact).norm() / exact.norm()).item()
                gram_error = ((gram - exact).norm() / exact.norm()).item()
                assert gram_error <= 3 * max(standard_error, 0.01), (name, seed, gram_error, standard_error)
    finally:
        torch.set_float32_matmul_precision(previous)
