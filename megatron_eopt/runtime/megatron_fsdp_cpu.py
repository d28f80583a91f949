"""Megatron-FSDP (the `megatron_fsdp` package, 0.6.x) on CPU and gloo: its CUDA-only calls replaced
at run time, never by editing the installed package, and only where CUDA is absent.

`install()` swaps the module-level names `torch` and `dist` of Megatron-FSDP's own modules for
stand-ins that pass everything through to torch except the calls listed in REPLACED_CALLS; torch
itself and every other module are untouched. With CUDA available `install()` does nothing.
"""

import copy
import importlib
import types
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from megatron_eopt.runtime.cpu_stand_ins import NoStream, Passthrough, all_gather_padded, replace_names

# Megatron-FSDP's modules that name `torch` (or `dist`) and call CUDA through it.
PATCHED_MODULES = ("megatron_fsdp", "fully_shard", "param_and_grad_buffer", "utils", "uneven_dtensor")

REPLACED_CALLS = {
    "torch.device('cuda...')": "torch.device('cpu'): the default device (megatron_fsdp.py) and the "
                               "device mesh (fully_shard.py: init_device_mesh(device_type='cuda'))",
    "torch.cuda.current_device()": "the CPU device: buffers (utils.py) and the default device",
    "torch.cuda.Stream(), torch.cuda.current_stream(), stream.record_event()": "a stream and events that "
        "wait for nothing (CPU work runs in program order)",
    "torch.cuda.stream(s)": "a context that does nothing",
    "torch.cuda.synchronize(), torch.cuda.empty_cache()": "nothing to wait for or free",
    "torch.tensor(...).cuda()": "stays on the CPU (uneven_dtensor.py's boundary check)",
    "dist.all_gather(uneven shards)": "gloo gathers equal sizes only: padded to the largest shard, cut back",
    "gradient_reduce_preprocessing(...)": "gradient_reduce_div_fusion off: NCCL's PREMUL_SUM is not in "
                                          "gloo; the gradient is scaled, then summed",
}

# The package on PyPI, and the copy megatron-core 0.19 ships and Megatron-LM's loop uses.
STANDALONE = "megatron_fsdp"
IN_MEGATRON_CORE = "megatron.core.distributed.fsdp.src.megatron_fsdp"
_installed: set[str] = set()  # the packages patched for the process's life


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_cuda() -> types.SimpleNamespace:
    """The `torch.cuda` Megatron-FSDP sees: the calls it makes, none needing a GPU."""
    return types.SimpleNamespace(
        Stream=NoStream, current_stream=NoStream, stream=lambda stream=None: nullcontext(),
        current_device=lambda: torch.device("cpu"), synchronize=_nothing, empty_cache=_nothing,
        is_available=lambda: False,
    )


def cpu_device(spec: Any = "cpu", index: Any = None) -> torch.device:
    """torch.device, with every CUDA device ('cuda', 'cuda:0', f'cuda:{current_device()}') the CPU."""
    if str(spec).startswith("cuda"):
        return torch.device("cpu")
    return torch.device(spec) if index is None else torch.device(spec, index)


class _CpuTensor(torch.Tensor):
    """`torch.tensor(...)` of the stand-in: a tensor whose `.cuda()` keeps it on the CPU."""

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def _without_premul_sum(original):
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if getattr(ddp_config, "gradient_reduce_div_fusion", False):
            ddp_config = copy.copy(ddp_config)
            ddp_config.gradient_reduce_div_fusion = False
        return original(grad_data, scaling_factor, ddp_config)
    return gradient_reduce_preprocessing


def replacements(package: str) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for REPLACED_CALLS in `package`: STANDALONE or IN_MEGATRON_CORE."""
    cpu_torch = Passthrough(torch, cuda=_cpu_cuda(), device=cpu_device,
                             tensor=lambda *a, **k: torch.tensor(*a, **k).as_subclass(_CpuTensor))
    cpu_dist = Passthrough(dist, all_gather=all_gather_padded)
    replaced = []
    for name in PATCHED_MODULES:
        module = importlib.import_module(f"{package}.{name}")
        replaced.append((module, "torch", cpu_torch))
        if getattr(module, "dist", None) is dist:
            replaced.append((module, "dist", cpu_dist))
    buffers = importlib.import_module(f"{package}.param_and_grad_buffer")
    fully_shard = importlib.import_module(f"{package}.fully_shard")
    return replaced + [
        (buffers, "gradient_reduce_preprocessing", _without_premul_sum(buffers.gradient_reduce_preprocessing)),
        (fully_shard, "init_device_mesh",
         lambda device_type, *a, **k: torch.distributed.device_mesh.init_device_mesh("cpu", *a, **k)),
    ]


def install(package: str = STANDALONE) -> bool:
    """Patch Megatron-FSDP's CUDA-only calls (REPLACED_CALLS) when CUDA is absent; idempotent.

    Returns whether the patch is active. Call it before building a Megatron-FSDP model on CPU.
    (megatron_lm_cpu patches megatron-core's copy, IN_MEGATRON_CORE, while it is installed.)
    """
    if torch.cuda.is_available():
        return False
    if package not in _installed:
        replace_names(replacements(package))
        _installed.add(package)
    return True
