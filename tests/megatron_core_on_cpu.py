"""megatron-core 0.19.2's optimizers, DDP and DistributedOptimizer on CPU, for tests that use them as
the reference: its CUDA-only calls patched at run time, here only (the installed package is not edited).

- `cuda_tensors_on_cpu`: its optimizer wrappers make their loss-scale tensor with device='cuda'.
- `megatron_core_ddp_on_cpu` (with `cuda_tensors_on_cpu`): its DDP buffers and gradient sync, and its
  DistributedOptimizer's gather of the state for a `fully_reshardable` save (`.cuda()` stays on CPU).
- `cuda_named_types`: while its DistributedOptimizer or Float16OptimizerWithFloat16Params is built,
  which check parameter types by name.
- `megatron_core_steps_on_cpu`: its `optimizer.step()` (gradient norm and clipping).
- `distributed_optimizer_loads_on_cpu`: its DistributedOptimizer's load with torch's Adam (the
  replacement megatron_eopt/runtime/megatron_lm_cpu.py makes for Megatron-LM's loop on CPU).
"""

import contextlib

import torch


@contextlib.contextmanager
def _cuda_device_on_cpu(factory_name: str):
    """`torch.<factory_name>(..., device='cuda')` makes its tensor on CPU."""
    original = getattr(torch, factory_name)

    def on_cpu(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return original(*args, **kwargs)

    setattr(torch, factory_name, on_cpu)
    try:
        yield
    finally:
        setattr(torch, factory_name, original)


def cuda_tensors_on_cpu():
    """megatron-core's optimizer wrappers make their loss-scale tensor with device='cuda'."""
    return _cuda_device_on_cpu("tensor")


@contextlib.contextmanager
def megatron_core_steps_on_cpu():
    """megatron-core's `optimizer.step()`: its gradient norm and clipping make their buffers with
    `torch.zeros(..., device='cuda')` (here on CPU) and check that each gradient's `type()` is
    `torch.cuda.FloatTensor` (here the CPU type with that name: `cuda_named_types`)."""
    with _cuda_device_on_cpu("zeros"), cuda_tensors_on_cpu(), cuda_named_types():
        yield


@contextlib.contextmanager
def megatron_core_ddp_on_cpu():
    """megatron-core 0.19.2's DDP and DistributedOptimizer on CPU: its buffers are made on
    `torch.cuda.current_device()` (here 'cpu'), its gradient sync asks for the current CUDA stream
    (here one that waits for nothing: CPU work is in order), and the optimizer checks that each
    parameter's `type()` is a `torch.cuda.*Tensor` (here the CPU type with that name, while it is
    built: `cuda_named_types`)."""
    saved = torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.stream, torch.Tensor.cuda

    class Stream:
        def wait_event(self, event) -> None: ...
        def wait_stream(self, stream) -> None: ...

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    try:
        with cuda_tensors_on_cpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.stream, torch.Tensor.cuda = saved


@contextlib.contextmanager
def cuda_named_types():
    """`tensor.type()` names a CPU tensor as its CUDA type (`torch.cuda.FloatTensor`)."""
    original = torch.Tensor.type

    def cuda_named(tensor, *args, **kwargs):
        name = original(tensor, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    torch.Tensor.type = cuda_named
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def distributed_optimizer_loads_on_cpu():
    """megatron-core 0.19.2's `DistributedOptimizer.load_state_dict` with torch's Adam (no TE or Apex,
    as on CPU) fails or drifts; the replacement that Megatron-LM's loop on CPU uses
    (megatron_eopt/runtime/megatron_core_torch_adam.py, `distributed_optimizer_loads_with_torch_adam`, which
    says why), inside the block."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_eopt.runtime.megatron_core_torch_adam import distributed_optimizer_loads_with_torch_adam
    from megatron_eopt.runtime.megatron_lm_cpu import replaced

    with replaced(distributed_optimizer_loads_with_torch_adam(DistributedOptimizer)):
        yield
