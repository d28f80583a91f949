"""Settings that emerging_optimizers decides or applies: `use_syrk` and the matmul precision.

- use_syrk: emerging_optimizers' `Muon.__init__` turns a requested SYRK kernel off where it is
  not supported (it needs Triton >= 3.4 and a GPU of SM 8.0/9.0/10.x; so always off on CPU). Our
  tensor-parallel Muons must end with exactly that decision, and the config field
  `muon_use_syrk` must reach both of them.
- muon_fp32_matmul_prec: honoured on every device. The reference for what 'medium' and
  'highest' compute is emerging_optimizers' own `newton_schulz` run on an explicitly bf16
  (resp. fp32) path, written out here.
"""

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils
from emerging_optimizers.orthogonalized_optimizers.muon import Muon

from megatron_eopt import registry
from megatron_eopt.runtime import once
from megatron_eopt.config.optimizer_config import OptimizerConfig
from megatron_eopt.optimizers.muon.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
from megatron_eopt.registry import BuildContext

OPTIMIZERS = {"muon": TensorParallelMuon, "adaptive_muon": TensorParallelAdaptiveMuon}


def _param(seed: int = 0, shape=(6, 10)) -> torch.nn.Parameter:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=generator))


def _emerging_muon_keeps_syrk() -> bool:
    """emerging_optimizers' rule (muon.py): Triton >= 3.4 and a validated GPU, else off."""
    from emerging_optimizers import triton_kernels

    if not torch.cuda.is_available() or not triton_kernels.HAS_TRITON_340:
        return False
    return torch.cuda.get_device_capability() in ((8, 0), (9, 0), (10, 0), (10, 3))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_use_syrk_ends_as_emerging_optimizers_muon_decides(name: str) -> None:
    expected = _emerging_muon_keeps_syrk()
    if not torch.cuda.is_available():
        assert expected is False
    param = _param()
    optimizer = OPTIMIZERS[name]([param], lr=0.1, use_syrk=True, fp32_matmul_prec="medium")
    assert optimizer.settings.use_syrk is expected  # what the step uses
    assert optimizer.use_syrk is expected
    # And the step runs: with syrk left on, 'medium' would call the Triton kernel on CPU.
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert torch.isfinite(param).all()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_muon_use_syrk_reaches_both_optimizers(name: str) -> None:
    spec = registry.lookup_optimizer(name)
    config = OptimizerConfig(optimizer=name, lr=0.1, muon_use_syrk=True)
    kwargs, sources = registry.optimizer_kwargs(name, spec.entry, config, BuildContext())
    assert kwargs["use_syrk"] is True and sources["use_syrk"] == "OptimizerConfig.muon_use_syrk"


# ------------------------------------------------------------------------------------------------
# muon_fp32_matmul_prec is honoured on CPU
# ------------------------------------------------------------------------------------------------

MOMENTUM, LR = 0.9, 0.1


def _newton_schulz_reference(matrix: torch.Tensor, bf16: bool) -> torch.Tensor:
    """emerging_optimizers' quintic Newton-Schulz, 5 steps, on an fp32 or a bf16 path."""
    from emerging_optimizers import utils as eo_utils

    with eo_utils.fp32_matmul_precision("medium" if bf16 else "highest"):
        return muon_utils.newton_schulz(matrix.clone(), steps=5, coefficient_type="quintic")


def _muon_update_through_the_factory(precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the orthogonalized update a one-step Muon run applied, the momentum it orthogonalized)."""
    from megatron_eopt import get_megatron_optimizer

    model = torch.nn.Linear(8, 16, bias=False)  # weight (16, 8): a hidden matrix, to Muon
    weight = model.weight
    before = weight.detach().clone()
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.0, clip_grad=0.0, muon_momentum=MOMENTUM,
                             muon_fp32_matmul_prec=precision)
    optimizer = get_megatron_optimizer(config, model, config_overrides={})
    weight.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    momentum = (1 - MOMENTUM) * weight.grad  # EMA momentum from zero, no Nesterov
    assert optimizer.step()[0]
    scale = max(16, 8) ** 0.5  # spectral
    return (before - weight.detach()) / (LR * scale), momentum


@pytest.mark.parametrize("precision,bf16", [("medium", True), ("highest", False)])
def test_explicit_precision_is_honoured_on_cpu(bf16_products, precision: str, bf16: bool) -> None:
    update, momentum = _muon_update_through_the_factory(precision)
    same_path = _newton_schulz_reference(momentum, bf16=bf16)
    other_path = _newton_schulz_reference(momentum, bf16=not bf16)
    # The two paths differ by bf16 round-off (~1e-2); the run must sit on its own path, up to the
    # fp32 round-off of undoing the step (p - lr*s*O, then divided again).
    assert (other_path - same_path).abs().max() > 1e-3
    assert (update - same_path).abs().max() < 1e-5, (update - same_path).abs().max()


def test_medium_on_a_cpu_that_emulates_bf16_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry.kwargs, "native_bf16_matmul", lambda device: False)
    monkeypatch.setattr(once, "_GIVEN", set())
    spec = registry.lookup_optimizer("muon")
    config = OptimizerConfig(optimizer="muon", lr=0.1, muon_fp32_matmul_prec="medium")
    with pytest.warns(UserWarning, match=r"muon_fp32_matmul_prec='medium'.*emulates.*'highest'"):
        kwargs, _ = registry.optimizer_kwargs("muon", spec.entry, config, BuildContext(on_cpu=True))
    assert kwargs["fp32_matmul_prec"] == "medium"  # honoured all the same
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.optimizer_kwargs("muon", spec.entry, config, BuildContext(on_cpu=True))  # once only
    monkeypatch.setattr(registry.kwargs, "native_bf16_matmul", lambda device: True)
    monkeypatch.setattr(once, "_GIVEN", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.optimizer_kwargs("muon", spec.entry, config, BuildContext(on_cpu=True))  # native: silent


@pytest.mark.parametrize("native,expected", [(True, "medium"), (False, "highest")])
def test_the_command_line_default_is_chosen_from_the_hardware(monkeypatch, native: bool, expected: str) -> None:
    import argparse

    from megatron_eopt.runtime import hardware
    from arguments import add_optimizer_args, matmul_precision_line, optimizer_config_from_args

    monkeypatch.setattr(hardware, "_cpu_has_bf16_instructions", lambda: native)
    args = add_optimizer_args(argparse.ArgumentParser()).parse_args(["--optimizer", "muon"])
    assert args.muon_fp32_matmul_prec is None
    cpu = torch.device("cpu")
    assert optimizer_config_from_args(args, cpu).muon_fp32_matmul_prec == expected
    line = matmul_precision_line(args, cpu)
    assert line.count("\n") == 0 and f"'{expected}'" in line and "--muon-fp32-matmul-prec" in line
    given = add_optimizer_args(argparse.ArgumentParser()).parse_args(["--muon-fp32-matmul-prec", "high"])
    assert optimizer_config_from_args(given, cpu).muon_fp32_matmul_prec == "high"
    assert matmul_precision_line(given, cpu) is None


def test_native_bf16_detection_reads_the_cpu_flags() -> None:
    from megatron_eopt.runtime.hardware import cpuinfo_has_bf16

    assert not cpuinfo_has_bf16("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n")
    assert cpuinfo_has_bf16("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpuinfo_has_bf16("processor\t: 0\nflags\t\t: fpu amx_bf16 amx_tile\n")
    assert cpuinfo_has_bf16("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")  # Arm
    assert not cpuinfo_has_bf16("processor\t: 0\nFeatures\t: fp asimd\n")
