"""The `gram-newton-schulz` package (Dao AI Lab) as an optional backend of the Gram path.

`GramPackage` gives the package's `GramNewtonSchulz` our coefficients (`coefficient_schedule`)
and restarts (`restart_steps`; its 0-based "restart before step i" is our 1-based "restart after
step k"), eps 1e-7 and no torch.compile (its default CUDA-graph mode reuses output buffers
across calls). One package object per device kind: on CUDA with its kernels (quack-kernels,
nvidia-cutlass-dsl), elsewhere its torch path. It computes in float16 whatever the input, so
it needs fp32_matmul_prec='medium' (bf16 products on our path). It holds no TP group: blocks
iterated on Gram matrices all-reduced over TP ranks stay on ours (ops/newton_schulz.py).
"""

import importlib
import importlib.util
from typing import Any, Callable, Optional

import torch

from megatron_eopt.runtime.once import warn_once
from megatron_eopt.ops.gram_newton_schulz import coefficient_schedule, restart_steps

PACKAGE = "gram_newton_schulz"
# What `block_paths` and `newton_schulz_paths` call a block that the package orthogonalizes.
PACKAGE_PATH = "gram (gram-newton-schulz)"
INSTALL_HINT = ("pip install gram-newton-schulz (its CUDA kernels also need quack-kernels and "
                "nvidia-cutlass-dsl; megatron-eopt's extra [gram-newton-schulz] brings all three)")


def check_package_arguments(gram: bool, package: bool, fp32_matmul_prec: str) -> None:
    """ValueError when the package backend is asked for without what it needs."""
    if not isinstance(package, bool):
        raise TypeError(f"gram_newton_schulz_package must be True or False; got {package!r}.")
    if package and not gram:
        raise ValueError("gram_newton_schulz_package=True needs gram_newton_schulz=True (the package runs "
                         "the blocks that take the Gram path).")
    if package and fp32_matmul_prec != "medium":
        raise ValueError(f"gram_newton_schulz_package=True needs fp32_matmul_prec='medium': the package "
                         f"computes in float16 only; got fp32_matmul_prec={fp32_matmul_prec!r}.")


class GramPackage:
    """The package's GramNewtonSchulz for one (coefficient type, steps), built per device kind."""

    def __init__(self, coefficient_type: str, steps: int) -> None:
        if importlib.util.find_spec(PACKAGE) is None:
            raise ValueError(f"gram_newton_schulz_package=True needs the gram-newton-schulz package, which is "
                             f"not importable here: {INSTALL_HINT}.")
        module = importlib.import_module(PACKAGE)
        if not hasattr(module, "GramNewtonSchulz"):  # e.g. a script of that name first on sys.path
            raise ValueError(f"gram_newton_schulz_package=True: the module {PACKAGE!r} imported from "
                             f"{getattr(module, '__file__', None)!r} is not the gram-newton-schulz package (it has no "
                             f"GramNewtonSchulz); rename what shadows it, or {INSTALL_HINT}.")
        self.coefficients = [list(abc) for abc in coefficient_schedule(coefficient_type, steps)]
        self.restarts = list(restart_steps(steps))
        self._by_kernels: dict[bool, Callable[[torch.Tensor], torch.Tensor]] = {}

    def prepare(self, device: torch.device) -> None:
        """Build the package object for `device` now (at construction, not in a step)."""
        self._for(device)

    def _for(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        kernels = device.type == "cuda"
        if kernels not in self._by_kernels:
            self._by_kernels[kernels] = _build(self.coefficients, self.restarts, kernels)
            if not kernels:
                warn_once("gram_package_torch_path", f"gram_newton_schulz_package=True on {device.type}: the "
                          f"package's torch path computes in float16, which CPUs run far slower than our bf16 "
                          f"Gram path (43x measured, docs/newton-schulz.md); it is meant for CUDA.", stacklevel=4)
        return self._by_kernels[kernels]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Unscaled orthogonalization of a 2-D or batched float32 `x`; tall inputs transposed
        by the package itself (as ours: rows > cols). Returns float32."""
        return self._for(x.device)(x)


def _build(coefficients: list, restarts: list, kernels: bool) -> Any:
    module = importlib.import_module(PACKAGE)
    try:
        return module.GramNewtonSchulz(ns_epsilon=1e-7, ns_use_kernels=kernels, ns_coefficients=coefficients,
                                       use_gram_newton_schulz=True, gram_newton_schulz_reset_iterations=restarts,
                                       compile_kwargs=None)
    except ImportError as error:  # ns_use_kernels=True imports quack here
        raise ValueError(f"gram_newton_schulz_package=True on CUDA uses the package's kernels, which cannot be "
                         f"imported ({error}): {INSTALL_HINT}.") from None


def package_for(gram: bool, package: bool, fp32_matmul_prec: str, coefficient_type: str,
                steps: int) -> Optional[GramPackage]:
    """The optimizers' constructor step: checked arguments, then the backend or None."""
    check_package_arguments(gram, package, fp32_matmul_prec)
    return GramPackage(coefficient_type, steps) if package else None
