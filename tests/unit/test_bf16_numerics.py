"""The test suite's bf16 emulation (tests/bf16_numerics.py) against float64 references.

Each test runs in two modes: `emulate` forces the emulation on any CPU, `cpu` leaves the choice
to this CPU (the emulation where bf16 is emulated, the CPU's own kernels where it is native). What
both promise is asserted in both; what only the emulation promises (the order of a sum) is
asserted only where the emulation runs, since a native CPU's kernels choose their own order."""

from collections.abc import Iterator

import pytest
import torch

from tests import bf16_numerics
from tests.bf16_numerics import bf16_numerics as bf16_context
from tests.bf16_numerics import runs_bf16_at_medium


@pytest.fixture(params=["emulate", "cpu"])
def mode(request, monkeypatch) -> Iterator[str]:
    if request.param == "emulate":
        monkeypatch.setenv("MEGATRON_EOPT_TEST_BF16", "emulate")
    else:
        monkeypatch.delenv("MEGATRON_EOPT_TEST_BF16", raising=False)
    previous = torch.get_float32_matmul_precision()
    yield request.param
    torch.set_float32_matmul_precision(previous)


def _operands(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_fp32_products_at_medium_take_bf16_inputs(mode) -> None:
    a, b, c = _operands(0, 3, 40, 50), _operands(1, 3, 50, 20), _operands(2, 3, 40, 20)
    exact = a.bfloat16().double() @ b.bfloat16().double()  # bf16 inputs, exact sums
    with bf16_context():
        torch.set_float32_matmul_precision("medium")
        products = {"bmm": a @ b, "mm": a[0] @ b[0], "baddbmm": torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
                    "addmm": torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2.0), "linear": torch.nn.functional.linear(
                        a[0], b[0].T, c[0, 0])}
        torch.set_float32_matmul_precision("highest")
        fp32 = a @ b
    expected = {"bmm": exact, "mm": exact[0], "baddbmm": 0.5 * c.double() + 2 * exact,
                "addmm": 0.5 * c[0].double() + 2 * exact[0], "linear": exact[0] + c[0, 0].double()}
    for name, product in products.items():
        assert product.dtype == torch.float32
        # fp32 sums of 50 products of about 1: round-off 50 * 2**-24 * |terms| ~ 1e-5.
        assert (product.double() - expected[name]).abs().max() < 1e-4, name
    assert (fp32.double() - exact).abs().max() > 1e-2  # highest keeps fp32 inputs: bf16's ~1e-1 apart


def test_bf16_products_sum_in_fp32_and_round_once(mode) -> None:
    a, b = _operands(3, 2, 64, 128).bfloat16(), _operands(4, 2, 128, 32).bfloat16()
    with bf16_context():
        product = a @ b
    exact = (a.double() @ b.double()).bfloat16()  # one rounding of the exact sum
    assert product.dtype == torch.bfloat16
    # An fp32 sum is within a few fp32 ulps of exact, so it rounds to the same bf16 nearly always.
    assert (product != exact).float().mean() < 1e-3


def test_unbatched_and_batched_products_sum_in_another_order(mode) -> None:
    a, b = _operands(5, 2, 16, 512), _operands(6, 2, 512, 16)
    with bf16_context():
        torch.set_float32_matmul_precision("medium")
        alone, together = torch.bmm(a[:1], b[:1])[0], torch.bmm(a, b)[0]
    assert (alone - together).abs().max() < 1e-4  # fp32 round-off of a 512-term sum
    if bf16_numerics.emulating():  # the emulation's promise; a native CPU's kernels pick their own order
        assert not torch.equal(alone, together)


def test_outside_the_context_nothing_changes(mode) -> None:
    with bf16_context():
        assert runs_bf16_at_medium()
    torch.set_float32_matmul_precision("medium")
    assert runs_bf16_at_medium() == bf16_numerics.native_bf16_matmul()


def test_the_environment_variable_is_checked(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_EOPT_TEST_BF16", "yes")
    with pytest.raises(ValueError, match="'emulate', 'native' or unset; got 'yes'"):
        bf16_numerics.emulating()
    if not bf16_numerics.native_bf16_matmul():  # a test about bf16 fails rather than runs fp32
        monkeypatch.setenv("MEGATRON_EOPT_TEST_BF16", "native")
        with pytest.raises(RuntimeError, match="does not round its inputs to bf16"):
            with bf16_context():
                pass
