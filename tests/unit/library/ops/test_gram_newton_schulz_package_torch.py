"""The gram-newton-schulz package's torch path (CPU) as our Gram path's backend.

- On GPT-like fc1 shapes (64 x 256, 256 x 64, a batch of 3) against the standard iteration in
  float64 (written out, test_gram_newton_schulz.py): the package (float16 products) within
  5e-3 relative Frobenius (measured <= 1.0e-3), ours at 'medium' (bf16) within 2e-2 (measured
  <= 5.8e-3), and the two within 2e-2 of each other (measured <= 5.9e-3). float16 keeps 3 more
  mantissa bits than bf16, hence the package's smaller error.
- `NewtonSchulzSettings` with a package sends exactly the Gram blocks without a TP group to it.
- Errors: the package not importable or shadowed, and its arguments (optimizer and config level, the latter
  torch-free as config/rules.py).
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from megatron_eopt import OptimizerConfig
from megatron_eopt.config.rules import check_values
from megatron_eopt.ops import gram_newton_schulz_package as package_module
from megatron_eopt.ops.gram_newton_schulz import gram_newton_schulz
from megatron_eopt.ops.gram_newton_schulz_package import GramPackage, check_package_arguments
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.optimizers.muon.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
from tests.unit.library.ops.test_gram_newton_schulz import standard_float64

SHAPES = [(64, 256), (256, 64), (3, 64, 256), (3, 256, 64)]


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture
def medium(bf16_products):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("coefficient_type", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", SHAPES)
def test_package_and_ours_against_float64(medium, shape: tuple, coefficient_type: str) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + shape[-1]))
    reference = standard_float64(x.double(), 5, coefficient_type)
    got = GramPackage(coefficient_type, 5)(x)
    ours = gram_newton_schulz(x, 5, coefficient_type)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert relative(got, reference) <= 5e-3
    assert relative(ours, reference) <= 2e-2
    assert relative(got, ours) <= 2e-2


def test_settings_send_gram_blocks_without_tp_group_to_the_package(medium) -> None:
    calls = []

    class Recording(GramPackage):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(tuple(x.shape))
            return super().__call__(x)

    settings = NewtonSchulzSettings(gram=True, package=Recording("quintic", 5))
    wide, square = torch.randn(3, 64, 256), torch.randn(64, 64)
    assert relative(settings.orthogonalize(wide), GramPackage("quintic", 5)(wide)) == 0.0
    settings.orthogonalize(square)  # square: the standard path, never the package
    settings.orthogonalize(wide[0], transpose=True)  # an orientation the package would not take
    assert calls == [(3, 64, 256)]
    with pytest.raises(ValueError, match="needs gram=True"):
        NewtonSchulzSettings(gram=False, package=GramPackage("quintic", 5))


def test_not_importable_says_how_to_install(monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == package_module.PACKAGE else find_spec(name, *args))
    p = torch.nn.Parameter(torch.zeros(8, 32))
    for cls in (TensorParallelMuon, TensorParallelAdaptiveMuon):
        with pytest.raises(ValueError, match=r"not importable.*pip install gram-newton-schulz.*quack-kernels"):
            cls([p], gram_newton_schulz=True, gram_newton_schulz_package=True, fp32_matmul_prec="medium")


def test_a_shadowing_module_is_named(monkeypatch) -> None:
    import_module = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *args: SimpleNamespace(__file__="/x/gram_newton_schulz.py")
                        if name == package_module.PACKAGE else import_module(name, *args))
    with pytest.raises(ValueError, match=r"'/x/gram_newton_schulz.py' is not the gram-newton-schulz package"):
        GramPackage("quintic", 5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gram_newton_schulz=False), "needs gram_newton_schulz=True"),
    (dict(gram_newton_schulz=True, fp32_matmul_prec="highest"), "needs fp32_matmul_prec='medium'.*float16"),
])
def test_optimizer_arguments(kwargs: dict, message: str) -> None:
    p = torch.nn.Parameter(torch.zeros(8, 32))
    for cls in (TensorParallelMuon, TensorParallelAdaptiveMuon):
        with pytest.raises(ValueError, match=message):
            cls([p], gram_newton_schulz_package=True, **kwargs)
    with pytest.raises(TypeError, match="True or False"):
        check_package_arguments(True, "yes", "medium")


@pytest.mark.parametrize("fields, message", [
    (dict(muon_gram_newton_schulz_package=True), "needs muon_gram_newton_schulz=True"),
    (dict(muon_gram_newton_schulz=True, muon_gram_newton_schulz_package=True, muon_fp32_matmul_prec="highest"),
     "needs muon_fp32_matmul_prec='medium'.*float16"),
])
def test_config_rules(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as from_config:
        OptimizerConfig(optimizer="muon", **fields)
    with pytest.raises(ValueError) as from_flags:  # as a parsed command line gives them
        check_values(SimpleNamespace(**{"optimizer": "muon", "muon_gram_newton_schulz": False, **fields}))
    assert str(from_flags.value) == str(from_config.value)
    assert OptimizerConfig(optimizer="muon", muon_gram_newton_schulz=True,
                           muon_gram_newton_schulz_package=True).muon_gram_newton_schulz_package
    with pytest.raises(TypeError, match="muon_gram_newton_schulz_package must be a bool"):
        OptimizerConfig(optimizer="muon", muon_gram_newton_schulz=True, muon_gram_newton_schulz_package=1)
    with pytest.raises(ValueError, match="muon_gram_newton_schulz_package must be True or False"):
        check_values(SimpleNamespace(muon_gram_newton_schulz_package=1))
