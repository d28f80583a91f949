"""The AOL-preconditioned Newton-Schulz (Turbo-Muon, ops/aol.py) against references written here (CPU).

- float64: `aol_newton_schulz` equals the iteration written out below (row scales from the Gram
  matrix's absolute row sums, then the standard steps) to 1e-12, wide, tall and batched, for
  every coefficient type; its fp32 run ('highest') is within 1e-4 of it (cans: up to 1.6e-5).
- The preconditioned input's spectral norm is at most 1 (the AOL bound) on Gaussian, heavy-tailed,
  ill-conditioned and rank-deficient inputs; a zero matrix stays zero, with no NaN.
- The Gram path with the preconditioner equals the standard path with it: float64 to 1e-10, fp32
  to 1e-5; the batched call equals the calls on each matrix.
- `NewtonSchulzSettings(aol=True)` takes these paths; the package and syrk kernels refuse it, and so
  does a schedule whose polynomial turns singular values near 1 negative (emerging_optimizers' 'aol'
  x 4, checked against the polynomial evaluated here); the 'aol' coefficients without it warn once.
- benchmarks/polar_error.py's floor for any iteration on D X holds (Turbo-Muon stays above it).
"""

import warnings
from typing import Optional

import pytest
import torch

from megatron_eopt.ops.aol import aol_newton_schulz, aol_precondition
from megatron_eopt.ops.gram_newton_schulz import coefficient_schedule, gram_newton_schulz
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, coefficient_types
from megatron_eopt.runtime import once
from tests.unit.library.ops.test_gram_newton_schulz import stress_inputs


def aol_float64(x: torch.Tensor, steps: int, coefficient_type: str, transpose: Optional[bool] = None) -> torch.Tensor:
    """Turbo-Muon written out in float64: unit Frobenius norm, rows scaled by 1/sqrt of the Gram
    matrix's absolute row sums, then the standard steps (each forming its own Gram matrix).
    `transpose`: which side is the rows (default: the smaller, emerging_optimizers' rule)."""
    transpose = x.size(-2) > x.size(-1) if transpose is None else transpose
    X = torch.nn.functional.normalize(x.mT if transpose else x, p=2, dim=(-2, -1), eps=1e-7)
    row_sums = (X @ X.mT).abs().sum(dim=-1)
    X = X / row_sums.clamp_min(torch.finfo(torch.float64).tiny).sqrt().unsqueeze(-1)
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if transpose else X


@pytest.fixture(autouse=True)
def fp32_products():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("coefficient_type", coefficient_types())
def test_equals_the_iteration_written_out(coefficient_type: str) -> None:
    for shape in [(24, 80), (80, 24), (3, 24, 80)]:
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        for steps in (1, 4, 5):
            expected = aol_float64(x, steps, coefficient_type)
            assert (aol_newton_schulz(x, steps, coefficient_type) - expected).abs().max() <= 1e-12, (shape, steps)
            fp32 = aol_newton_schulz(x.float(), steps, coefficient_type)
            assert fp32.dtype == torch.float32
            assert (fp32.double() - expected).abs().max() <= 1e-4, (shape, steps)


def test_preconditioned_spectral_norm_is_at_most_one() -> None:
    g = torch.Generator().manual_seed(3)
    inputs = {**stress_inputs(), "heavy-tailed": torch.randn(64, 256, dtype=torch.float64, generator=g) ** 3,
              "one large entry": torch.randn(64, 256, dtype=torch.float64, generator=g).index_put_(
                  (torch.tensor([5]), torch.tensor([7])), torch.tensor([1e4], dtype=torch.float64))}
    for name, x in inputs.items():
        scaled, gram = aol_precondition(x, x @ x.mT)
        assert torch.linalg.matrix_norm(scaled, ord=2) <= 1 + 1e-12, name
        assert (gram - scaled @ scaled.mT).abs().max() <= 1e-12 * x.abs().max() ** 2, name  # D A D, not recomputed
    zero = torch.zeros(8, 16)
    for result in (aol_newton_schulz(zero, 4), gram_newton_schulz(zero, 4, "aol", aol=True)):
        assert torch.equal(result, zero)


def test_gram_path_and_batches_equal_the_standard_path() -> None:
    for shape in [(16, 96), (96, 16), (3, 16, 96)]:
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        for coefficient_type, steps in (("aol", 4), ("quintic", 5), ("polar_express", 8)):
            standard = aol_newton_schulz(x, steps, coefficient_type)
            assert (gram_newton_schulz(x, steps, coefficient_type, aol=True) - standard).abs().max() <= 1e-10
            fp32 = gram_newton_schulz(x.float(), steps, coefficient_type, aol=True)
            assert (fp32.double() - standard).abs().max() <= 1e-5, (shape, coefficient_type)
    batch = torch.randn(3, 24, 80, generator=torch.Generator().manual_seed(5))
    together = aol_newton_schulz(batch, 4)
    for i in range(3):
        assert (together[i] - aol_newton_schulz(batch[i], 4)).abs().max() <= 1e-6


def test_the_scaled_side_does_not_depend_on_the_orientation() -> None:
    """D X has another polar factor than X D: an orientation fixed against the transpose rule (as
    'distributed' TP mode fixes it) still scales the side the rule puts first, in both paths, and
    that side is what the float64 iteration written out above scales."""
    for shape in [(24, 80), (80, 24), (32, 32)]:
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        expected = aol_float64(x, 4, "quintic")
        other_way = not x.size(0) > x.size(1)
        assert (aol_newton_schulz(x, 4, "quintic", transpose=other_way) - expected).abs().max() <= 1e-12, shape
        assert (gram_newton_schulz(x, 4, "quintic", transpose=other_way, aol=True) - expected).abs().max() <= 1e-10
        assert (aol_float64(x, 4, "quintic", transpose=other_way) - expected).abs().max() > 1e-3  # the side matters


def test_settings_route_aol_and_refuse_kernels_without_it() -> None:
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(6))
    settings = NewtonSchulzSettings(4, "quintic", aol=True)
    assert torch.equal(settings.orthogonalize(x), aol_newton_schulz(x, 4, "quintic"))
    gram = NewtonSchulzSettings(4, "quintic", aol=True, gram=True)
    assert gram.takes_gram_path(16, 96, "highest")
    assert torch.equal(gram.orthogonalize(x), gram_newton_schulz(x, 4, "quintic", aol=True))
    with pytest.raises(ValueError, match="syrk kernel does not run the AOL preconditioner"):
        NewtonSchulzSettings(4, "quintic", aol=True, use_syrk=True)
    with pytest.raises(ValueError, match="package does not run the AOL preconditioner"):
        NewtonSchulzSettings(4, "quintic", aol=True, gram=True, package=object())
    sigma = torch.linspace(0.5, 1.0, 501, dtype=torch.float64)
    for coefficient_type in coefficient_types():
        for steps in (4, 5):
            value = sigma.clone()
            for a, b, c in coefficient_schedule(coefficient_type, steps):
                value = a * value + b * value**3 + c * value**5
            if (value <= 0).any():  # 'aol' x 4 turns singular values above 0.88 around
                with pytest.raises(ValueError, match=f"{coefficient_type!r} x {steps} steps maps singular values"):
                    NewtonSchulzSettings(steps, coefficient_type, aol=True)
            else:
                NewtonSchulzSettings(steps, coefficient_type, aol=True)
    once._GIVEN.discard("aol_coefficients_without_aol")  # said once per process: maybe by an earlier test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        NewtonSchulzSettings(4, "aol")
    messages = [str(w.message) for w in caught]
    assert any("--muon-aol-preconditioner" in m and "meant for a preconditioned input" in m for m in messages), messages


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (24, 24)])
def test_no_iteration_on_the_preconditioned_matrix_gets_below_the_benchmarks_floor(shape) -> None:
    """benchmarks/polar_error.py's `aol_floor` (docs/newton-schulz.md): the least polar error
    against X's polar factor that any odd polynomial of D X reaches. Turbo-Muon with 1 to 12 steps
    of several coefficient types (float64) stays above it, D X's exact polar factor is within 1e-3
    of it, and a matrix whose rows AOL scales alike (orthogonal rows of equal norm: D = cI) has floor 0."""
    from benchmarks.polar_error import aol_floor, polar_error

    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample(shape).double()
    floor = aol_floor(x)
    assert floor > 1e-3  # D is not a multiple of the identity: another polar factor than X's
    for coefficient_type in ("quintic", "polar_express", "simple"):
        for steps in (1, 2, 4, 8, 12):
            assert polar_error(x, aol_newton_schulz(x, steps, coefficient_type)) >= floor - 1e-12
    wide = x.mT if shape[0] > shape[1] else x  # the side AOL scales first
    scaled, _ = aol_precondition(wide, wide @ wide.mT)
    u, _, vh = torch.linalg.svd(scaled.mT if shape[0] > shape[1] else scaled, full_matrices=False)
    exact = polar_error(x, u @ vh)  # what an iteration converging to D X's polar factor reaches
    assert floor <= exact <= floor + 1e-3
    rows, _ = torch.linalg.qr(torch.randn(max(shape), min(shape), dtype=torch.float64))
    assert aol_floor(3.0 * rows.mT) < 1e-12
