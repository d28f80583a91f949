"""What our Newton-Schulz iterations (ops/gram_newton_schulz.py, ops/aol.py) share with
emerging_optimizers' `newton_schulz`: its coefficient schedule, its input's orientation, norm and
precision, and the products of one step (2-D or batched, all-reduced over a TP group)."""

from typing import Optional

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers import muon_utils

Coefficients = tuple[float, float, float]

# emerging_optimizers' newton_schulz repeats the last set for these types, cycles the others.
REPEAT_LAST_TYPES = ("polar_express", "cans", "deepseekv4")


def coefficient_schedule(coefficient_type: str, steps: int) -> list[Coefficients]:
    """The (a, b, c) of each of `steps` steps, as emerging_optimizers' newton_schulz uses them."""
    sets = getattr(muon_utils, "_COEFFICIENT_SETS", None)
    if not isinstance(sets, dict) or coefficient_type not in sets:
        raise ValueError(
            f"megatron_eopt's Newton-Schulz cannot read coefficient set {coefficient_type!r} from the "
            f"installed emerging_optimizers (muon_utils._COEFFICIENT_SETS); it has "
            f"{sorted(sets) if isinstance(sets, dict) else 'none'}."
        )
    mode = "repeat_last" if coefficient_type in REPEAT_LAST_TYPES else "cycle"
    return [tuple(map(float, abc)) for abc in muon_utils.get_coefficient_iterator(steps, sets[coefficient_type], mode)]


def oriented_unit_input(x: torch.Tensor, transpose: Optional[bool], eps: float,
                        tp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, bool]:
    """(x with the smaller side first and unit Frobenius norm, whether it was transposed), in bf16
    at 'medium' matmul precision, as `newton_schulz` prepares it. x: 2-D or 3-D, float32 or float64;
    with `tp_group`, this rank's columns (after the transpose)."""
    if x.ndim not in (2, 3) or x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"x must be a 2-D or 3-D float32/float64 tensor; got {x.ndim}-D {x.dtype}.")
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if tp_group is not None:
        x = muon_utils.distributed_normalize_p2(x, eps, tp_group)
    else:
        x = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)  # type: ignore[arg-type]
    if x.dtype == torch.float32 and torch.get_float32_matmul_precision() == "medium":
        x = x.to(torch.bfloat16)  # as newton_schulz: bf16 in and out of every product
    return x, transpose


def restored_output(x: torch.Tensor, transpose: bool, input_dtype: torch.dtype) -> torch.Tensor:
    """The iterate back in the input's dtype and orientation."""
    x = x.to(input_dtype)
    return x.mT if transpose else x


def addmm(input: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """beta * input + alpha * a @ b, 2-D or batched."""
    if a.ndim == 2:
        return torch.addmm(input, a, b, beta=beta, alpha=alpha)
    return torch.baddbmm(input, a, b, beta=beta, alpha=alpha)


def gram_matrix(x: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """x x^T, summed over the TP ranks that hold column shards of x."""
    gram = x @ x.mT
    if tp_group is not None:
        dist.all_reduce(gram, op=dist.ReduceOp.SUM, group=tp_group)
    return gram
