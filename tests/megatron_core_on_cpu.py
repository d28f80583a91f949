"""megatron-core 0.19.2's optimizers, DDP and DistributedOptimizer on CPU, for tests that use them as
the reference: its CUDA-only calls patched at run time, here only (the installed package is not edited).

- `cuda_tensors_on_cpu`: its optimizer wrappers make their loss-scale tensor with device='cuda'.
- `megatron_core_ddp_on_cpu` (with `cuda_tensors_on_cpu`): its DDP buffers and gradient sync, and its
  DistributedOptimizer's gather of the state for a `fully_reshardable` save (`.cuda()` stays on CPU).
- `cuda_named_types`: while its DistributedOptimizer or Float16OptimizerWithFloat16Params is built,
  which check parameter types by name.
- `megatron_core_steps_on_cpu`: its `optimizer.step()` (gradient norm and clipping).
- `distributed_optimizer_loads_on_cpu`: its DistributedOptimizer's load with torch's Adam.
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
    as on CPU), which keeps a `step` tensor per parameter in its state, fails or drifts:
    - it copies a loaded fp32 `param` into a view of the parameter itself: torch allows that under
      no_grad only (here the load runs under no_grad);
    - its fully_reshardable load passes no `step` among a parameter's loaded tensors but copies
      every tensor the live state has, `step` included (KeyError): here the live step is left as
      the load set it from the param groups, as megatron-core means to ("handled separately");
    - it gives every parameter one shared `step` tensor, which torch's Adam then advances once per
      parameter per step: here each parameter gets its own copy of the loaded step afterwards.
    TE's FusedAdam on GPU keeps the step in the param groups and meets none of these."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_load, original_set = DistributedOptimizer.load_state_dict, DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors) -> None:
        original_set(self, model_param, {"step": None, **tensors})  # a non-tensor is skipped

    def load_state_dict(self, state_dict) -> None:
        with torch.no_grad():
            original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer.load_state_dict = original_load
        DistributedOptimizer._set_main_param_and_optimizer_states = original_set
