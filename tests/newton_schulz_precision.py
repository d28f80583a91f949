"""Layout comparisons at fp32 round-off need fp32 Newton-Schulz.

Scion's class default is fp32_matmul_prec='medium', under which emerging_optimizers' newton_schulz
casts the iteration to bf16 on every device, and no OptimizerConfig field reaches it. In bf16 a
1-ulp difference in the momentum (the same matrix summed in another order by another layout) can
flip a rounding and move the update by a bf16 ulp (2^-8 relative): measured on the FSDP2 GPT test
under ATEN_CPU_CAPABILITY=default, where it moved a weight by 1.1e-4. Whether it
flips depends on the CPU's kernels, so a layout test at 1e-5 would assert one machine's rounding.
"""

import contextlib
from typing import Iterator

from megatron_eopt import registry


@contextlib.contextmanager
def fp32_newton_schulz(optimizer_name: str) -> Iterator[None]:
    """While it is open, the registered optimizer's class defaults to fp32_matmul_prec='highest'
    (unchanged for built-in entries, which take it from the config, and classes without it)."""
    optimizer_cls = getattr(registry.lookup_optimizer(optimizer_name).entry, "optimizer_cls", object)
    init = next((c.__init__ for c in optimizer_cls.__mro__
                 if "fp32_matmul_prec" in (getattr(c.__init__, "__kwdefaults__", None) or {})), None)
    if init is None:
        yield
        return
    saved = dict(init.__kwdefaults__)
    init.__kwdefaults__ = {**saved, "fp32_matmul_prec": "highest"}
    try:
        yield
    finally:
        init.__kwdefaults__ = saved
