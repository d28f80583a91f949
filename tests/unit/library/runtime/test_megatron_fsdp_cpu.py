"""megatron_eopt.runtime.megatron_fsdp_cpu: Megatron-FSDP's CUDA-only calls replaced in its own modules
only, and only without CUDA. Training with it at 2 and 3 ranks is checked in
tests/unit/library/distributed/test_megatron_fsdp.py (its gathers use the padded all_gather).
"""

import importlib

import torch

from megatron_eopt.runtime import megatron_fsdp_cpu


def _modules():
    return [importlib.import_module(f"megatron_fsdp.{name}") for name in megatron_fsdp_cpu.PATCHED_MODULES]


def test_inactive_when_cuda_is_available(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_fsdp_cpu, "_installed", set())
    before = [module.torch for module in _modules()]
    assert megatron_fsdp_cpu.install() is False
    assert [module.torch for module in _modules()] == before


def test_replaces_cuda_calls_in_megatron_fsdp_only() -> None:
    assert megatron_fsdp_cpu.install() is True and megatron_fsdp_cpu.install() is True  # idempotent
    buffers = importlib.import_module("megatron_fsdp.param_and_grad_buffer")
    for module in _modules():
        assert module.torch is not torch and module.torch.cuda.current_device() == torch.device("cpu")
        assert module.torch.device(f"cuda:{module.torch.cuda.current_device()}") == torch.device("cpu")
        assert module.torch.float32 is torch.float32 and module.torch.nn is torch.nn  # the rest passes through
    with buffers.torch.cuda.stream(buffers.torch.cuda.Stream()):
        buffers.torch.cuda.current_stream().record_event().wait()
    assert buffers.torch.tensor([1, 0]).cuda().device == torch.device("cpu")
    assert torch.cuda.Stream is not buffers.torch.cuda.Stream  # torch itself is untouched
    # gradient_reduce_div_fusion (NCCL's PREMUL_SUM) becomes scale-then-SUM, without changing the config.
    config = importlib.import_module("megatron_fsdp.distributed_data_parallel_config").DistributedDataParallelConfig(
        gradient_reduce_div_fusion=True)
    grad = torch.full((4,), 2.0)
    assert buffers.gradient_reduce_preprocessing(grad, 0.25, config) == torch.distributed.ReduceOp.SUM
    assert torch.equal(grad, torch.full((4,), 0.5)) and config.gradient_reduce_div_fusion
