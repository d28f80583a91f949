"""`offload_to_cpu()` / `restore_from_cpu()` on a CUDA GPU (the GPU tier; `make gpu-check` runs it).

Measured with `torch.cuda.memory_allocated()`: after an offload the device holds less by at least
the optimizer's own state and main copies (their bytes summed before the offload; the model's
weights and gradients stay), and after a restore as much as before. The run continues bitwise:
two more steps after offload and restore equal the same two steps of an optimizer never offloaded,
on every weight and state tensor. Adam and Muon, bf16 with fp32 main copies (what an RL loop frees
while it generates). The CPU tier (test_offload_to_cpu.py) checks the same contract with the host
standing in for the device.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.offload.offload_to_cpu import tensors_in

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"),
]
CONFIGS = {
    "adam": OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True),
    "muon": OptimizerConfig(optimizer="muon", lr=1e-2, bf16=True, muon_fp32_matmul_prec="highest"),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)] + [torch.nn.LayerNorm(1024)]
    return torch.nn.Sequential(*layers).cuda().to(torch.bfloat16)


def _step(model: torch.nn.Module, optimizer, seed: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator, device="cuda").to(param.dtype)
    assert optimizer.step()[0]
    optimizer.zero_grad()


def _owned_bytes(optimizer, model: torch.nn.Module) -> int:
    """Bytes of the storages the optimizer owns on the device (not the model's)."""
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}
    for child in optimizer.chained_optimizers:
        for tensor in child._owned_tensors():
            storage = tensor.untyped_storage()
            if tensor.is_cuda and storage.data_ptr() not in model_storages:
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _everything(model: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    values = [p.detach().clone() for p in model.parameters()]
    for child in optimizer.chained_optimizers:
        values += [t.detach().clone() for t in child.fp32_main_params()]
        values += [t.detach().clone() for t in tensors_in(list(child.optimizer.state.values()))]
    return values


@pytest.mark.parametrize("name", CONFIGS)
def test_offload_frees_the_state_and_the_run_continues_bitwise(name: str) -> None:
    with torch.compiler.set_stance("force_eager"):  # the state is the question, not compiled kernels
        _compare(name)


def _compare(name: str) -> None:
    runs = {}
    for offloading in (False, True):
        model = _model()
        optimizer = get_megatron_optimizer(CONFIGS[name], [model])
        _step(model, optimizer, seed=1)
        if offloading:
            torch.cuda.synchronize()
            owned, before = _owned_bytes(optimizer, model), torch.cuda.memory_allocated()
            optimizer.offload_to_cpu()
            torch.cuda.synchronize()
            offloaded = torch.cuda.memory_allocated()
            optimizer.restore_from_cpu()
            torch.cuda.synchronize()
            restored = torch.cuda.memory_allocated()
            print(f"{name}: optimizer-owned {owned} bytes; allocated {before} -> {offloaded} (offloaded) -> "
                  f"{restored} (restored)")
            assert owned > 0 and before - offloaded >= owned, (owned, before, offloaded)
            assert restored == before
        for seed in (2, 3):
            _step(model, optimizer, seed)
        runs[offloading] = _everything(model, optimizer)
    assert len(runs[False]) == len(runs[True])
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True])), name
