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
from megatron_eopt.config import OptimizerConfig
from megatron_eopt.optimizers.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon
from megatron_eopt.optimizers.tensor_parallel_muon import TensorParallelMuon
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
