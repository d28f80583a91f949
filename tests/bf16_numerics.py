"""bf16 numerics on every CPU: what `medium` and bf16 products do on a CPU with native bf16.

On a CPU that multiplies bf16 natively (Intel AMX, as a GPU's tensor cores) torch runs fp32
matmuls at `torch.set_float32_matmul_precision("medium")` with bf16 inputs and fp32
accumulation. Where bf16 is emulated (most AMD and older Intel CPUs), `medium` runs plain fp32,
so a test about bf16 behaviour would pass there without testing it.

`bf16_numerics()` makes such a CPU compute as a native one does, for the ops the project runs
(mm, addmm, bmm, baddbmm, which nn.Linear, attention and Newton-Schulz become):
- an fp32 product at `medium`: inputs rounded to bf16 (nearest even), products and sums in fp32,
  fp32 out (oneDNN's bf16 fpmath mode; cuBLAS with bf16 reduced precision);
- the sum over the inner dimension in a kernel-chosen order: native kernels block and thread the
  inner dimension by shape and batch count (oneDNN and cuBLAS split it when a batch alone cannot
  fill the cores). Here an unbatched or batch-of-one product sums its inner dimension in two
  halves, a batch of several in one pass, for fp32 at `medium` and for bf16 tensors alike. A
  result that depends on which matrices share a batch then differs here as on those machines.
  Both orders are computed so that they give the same bits on every CPU (`_sum_over_inner`).
On a CPU with native bf16 it changes nothing: the hardware does it.

`MEGATRON_EOPT_TEST_BF16=emulate` forces the emulation, `=native` forbids it (to run a native CPU's
own kernels only); unset, the CPU decides (`native_bf16_matmul`).
"""

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
from emerging_optimizers.utils import fp32_matmul_precision
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# op -> (index of the first matrix operand, whether the op adds an input first: beta*input + alpha*a@b)
_PRODUCTS = {
    aten.mm.default: (0, False),
    aten.bmm.default: (0, False),
    aten.addmm.default: (1, True),
    aten.baddbmm.default: (1, True),
}


def runs_bf16_at_medium() -> bool:
    """Whether an fp32 product at `medium` rounds its inputs to bf16 here and now. A test about
    bf16 asserts it first, so that it cannot pass on fp32 numerics."""
    a = torch.full((64, 64), 1.0 + 2.0**-10)  # not a bf16 value: rounds to 1.0
    with fp32_matmul_precision("medium"):
        return (a @ a)[0, 0].item() == 64.0


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU runs fp32 matmuls at `medium` with bf16 inputs (probed, not guessed)."""
    return runs_bf16_at_medium()


def emulating() -> bool:
    """Whether `bf16_numerics()` emulates here."""
    choice = os.environ.get("MEGATRON_EOPT_TEST_BF16", "")
    if choice not in ("", "emulate", "native"):
        raise ValueError(f"MEGATRON_EOPT_TEST_BF16 must be 'emulate', 'native' or unset; got {choice!r}.")
    return choice == "emulate" or (choice == "" and not native_bf16_matmul())


def _sum_over_inner(a: torch.Tensor, b: torch.Tensor, halves: bool) -> torch.Tensor:
    """fp32 a @ b of bf16 values held in fp32, the inner dimension summed in one pass or in two halves.

    The products of bf16 values are exact, so one pass is their float64 sum rounded once to fp32,
    and halves rounds each half's sum to fp32 and adds the two in fp32. Neither depends on how this
    CPU's kernels block the sum (float64 round-off is far below an fp32 ulp), so the emulation gives
    the same bits on every CPU and the two orders differ wherever double rounding shows."""
    a, b = a.double(), b.double()
    if not halves or a.size(-1) < 2:
        return torch.matmul(a, b).float()
    k = a.size(-1) // 2
    return torch.matmul(a[..., :k], b[..., :k, :]).float() + torch.matmul(a[..., k:], b[..., k:, :]).float()


class NativeBf16Products(TorchDispatchMode):
    """The products of the module docstring, as a native bf16 CPU computes them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _PRODUCTS or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        first, adds = _PRODUCTS[func]
        a, b = args[first], args[first + 1]
        if a.device.type != "cpu" or a.dtype != b.dtype:
            return func(*args, **kwargs)
        if a.dtype == torch.float32 and torch.get_float32_matmul_precision() == "medium":
            a, b = a.bfloat16().float(), b.bfloat16().float()
            out_dtype = torch.float32
        elif a.dtype == torch.bfloat16:
            a, b = a.float(), b.float()
            out_dtype = torch.bfloat16
        else:
            return func(*args, **kwargs)
        product = _sum_over_inner(a, b, halves=a.ndim == 2 or a.size(0) == 1)
        if adds:
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            product = product * alpha if beta == 0 else args[0].float() * beta + product * alpha
        return product.to(out_dtype)


@contextlib.contextmanager
def bf16_numerics() -> Iterator[None]:
    """Within: bf16 products as a native bf16 CPU computes them (module docstring). Checked on
    entry, so that a test about bf16 cannot pass on fp32 numerics."""
    with NativeBf16Products() if emulating() else contextlib.nullcontext():
        if not runs_bf16_at_medium():
            raise RuntimeError("an fp32 product at 'medium' does not round its inputs to bf16 here "
                               "(MEGATRON_EOPT_TEST_BF16=native on a CPU without native bf16?)")
        yield
