"""What arguments/device.py knows about CUDA before torch is imported: `cuda_surely_absent` says
True only where torch cannot see a GPU."""

import ctypes
import importlib.metadata

import pytest

from megatron_eopt.training.arguments import device


def test_it_agrees_with_torch_here() -> None:
    import torch

    if device.cuda_surely_absent():
        assert not torch.cuda.is_available()


@pytest.mark.parametrize("version,driver,absent", [
    ("2.5.1+cpu", True, True),  # a CPU-only build, whatever the machine
    ("2.5.1+rocm6.2", False, False),  # ROCm: torch.cuda answers for AMD GPUs; unknown
    ("2.5.1", False, True),  # a CUDA build without the NVIDIA driver's library
    ("2.5.1+cu124", True, False),  # with it: only torch can tell (devices, visibility)
])
def test_builds_and_drivers(version: str, driver: bool, absent: bool, monkeypatch) -> None:
    def cdll(name):
        if not driver:
            raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(device.sys, "platform", "linux")
    assert device.cuda_surely_absent() is absent
