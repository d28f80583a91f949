"""What the flag checks need to know about the machine (`Device`), before and after torch is imported.

Before the import only the torch-free answers are known: a caller's process group (when
torch.distributed is already imported), --distributed-backend, whether Transformer Engine is
installed at all (`importlib.util.find_spec`), and that CUDA is absent where that is certain
(`cuda_surely_absent`); the rest is None (unknown), and the checks that need it wait for
`device_after_import`, which reads torch and Transformer Engine. Those stay after the import:
whether torch sees a GPU (`torch.cuda.is_available()` depends on the build, the driver and the
devices), and Transformer Engine's version (read by importing it).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Device:
    cuda_available: Optional[bool]  # torch.cuda.is_available()
    on_cuda: Optional[bool]  # the job runs on CUDA (training/parallel/layout.py's runs_on_cuda)
    transformer_engine: Optional[bool]  # Transformer Engine imports
    backend: Optional[str]  # a caller's process group's backend; None: none exists

    @property
    def te_on_cuda(self) -> Optional[bool]:
        """CUDA and Transformer Engine both (None: not known yet)."""
        if self.on_cuda is False or self.transformer_engine is False:
            return False
        return None if self.on_cuda is None or self.transformer_engine is None else True

    def local_spec(self, args: argparse.Namespace) -> Optional[bool]:
        """Whether megatron-core's local layers are built (layer_specs.py's gpt_layer_spec)."""
        if args.transformer_impl == "local":
            return True
        return None if self.te_on_cuda is None else not self.te_on_cuda


def process_group():
    """torch.distributed when a process group exists (a caller's, see pretrain.main), else None;
    never imports torch."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def world() -> tuple[int, int]:
    """(world size, rank): the caller's process group's, else WORLD_SIZE and RANK."""
    dist = process_group()
    if dist is not None:
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def device_before_import(args: argparse.Namespace) -> Device:
    dist = process_group()
    backend = None if dist is None else dist.get_backend()
    cuda_available = False if cuda_surely_absent() else None
    if backend is not None:
        on_cuda: Optional[bool] = backend == "nccl"
    elif args.distributed_backend is not None:
        on_cuda = args.distributed_backend == "nccl"
    else:
        on_cuda = cuda_available  # runs_on_cuda: CUDA when available
    transformer_engine = False if importlib.util.find_spec("transformer_engine") is None else None
    return Device(cuda_available, on_cuda, transformer_engine, backend)


def cuda_surely_absent() -> bool:
    """True where torch certainly cannot use CUDA, found without importing it: a CPU-only torch
    build ('+cpu'), or a CUDA build on Linux without the NVIDIA driver's library. False: unknown."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    if "+cpu" in version:
        return True
    if "+rocm" in version or not sys.platform.startswith("linux"):
        return False  # ROCm builds answer for AMD GPUs through torch.cuda; other systems: unknown
    try:
        ctypes.CDLL("libcuda.so.1")  # loads the driver's library (as torch would); initialises nothing
    except OSError:
        return True
    return False


def device_after_import(args: argparse.Namespace) -> Device:
    import torch

    from megatron_eopt.training.model.layer_specs import transformer_engine_at_least

    dist = process_group()
    on_cuda = runs_on_cuda(args)
    # Transformer Engine matters only on CUDA (Device.te_on_cuda): not imported on CPU.
    return Device(torch.cuda.is_available(), on_cuda, transformer_engine_at_least(None) if on_cuda else None,
                  None if dist is None else dist.get_backend())


def runs_on_cuda(args: argparse.Namespace) -> bool:
    """NCCL on GPUs or gloo on CPU: a caller's process group, else --distributed-backend, else
    CUDA when available."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_backend() == "nccl"
    if args.distributed_backend is not None:
        return args.distributed_backend == "nccl"
    return torch.cuda.is_available()

