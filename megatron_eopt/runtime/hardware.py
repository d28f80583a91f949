"""Whether a device multiplies bf16 matrices in hardware, and the Muon precision that follows.

bf16 matrix products are fast where the hardware has them (GPUs with bf16 tensor cores, CPUs
with AVX512-BF16, AMX or Arm BF16) and emulated, about 50x slower than fp32, elsewhere; the
Newton-Schulz precision 'medium' means bf16 products, so it pays only on the former.
"""

import functools
import pathlib
import platform
import re

import torch

# CPU feature flags (/proc/cpuinfo) of bf16 matrix instructions: x86 AVX512-BF16 and AMX, Arm BF16.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices in hardware; else bf16 is emulated there,
    far slower than fp32 (about 50x on an AVX2 CPU), while native bf16 is faster than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return _cpu_has_bf16_instructions()
    return False  # an unknown accelerator: assume nothing


@functools.lru_cache(maxsize=None)
def _cpu_has_bf16_instructions() -> bool:
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):  # torch's x86 checks
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return True
    try:
        return cpuinfo_has_bf16(pathlib.Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def cpu_model() -> str:
    """The CPU's model name ('AMD EPYC 7B13 64-Core Processor'), from /proc/cpuinfo where it has
    one, else what the platform module knows ('x86_64' at least)."""
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpuinfo_has_bf16(cpuinfo: str) -> bool:
    """Whether the flags (x86) or Features (Arm) lines of /proc/cpuinfo name bf16 instructions."""
    flags = {flag for line in re.findall(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.M) for flag in line.split()}
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def fp32_matmul_prec_for(device: torch.device) -> tuple[str, str]:
    """(muon_fp32_matmul_prec, why) for `device`: megatron-core's 'medium' (bf16 Newton-Schulz)
    where bf16 matrix products are native, else 'highest' (fp32)."""
    device = torch.device(device)
    if native_bf16_matmul(device):
        return "medium", f"{device.type} has native bf16 matrix products"
    if device.type == "cpu":
        return "highest", (
            f"this CPU has no bf16 matrix instructions ({'/'.join(CPU_BF16_FLAGS)}), so bf16 would be "
            f"emulated, far slower than fp32"
        )
    return "highest", f"{device.type} has no native bf16 matrix products"
