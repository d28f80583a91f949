"""Gram Newton-Schulz: the standard iteration's polynomial, run on the m x m Gram matrix.

A standard step is X <- p_k(X X^T) X with p_k(t) = a + b t + c t^2 (X is m x n, m <= n after the
transpose). With R = X X^T, X_k = Q_k X_0 where Q_k = P_k Q_{k-1}, P_k = p_k(R_{k-1}) and
R_k = P_k R_{k-1} P_k: m x m products only, then one Q X_0 at the end. Same normalisation,
transpose rule and per-step coefficients as emerging_optimizers' `newton_schulz`.

Restarts: the accumulated Q amplifies round-off like R's smallest eigenvalues (by up to a_k per
step), so the iterate X = Q X_0 and its Gram matrix are recomputed (Q = I) after step 3 and then
every second step (never after the last). Chosen by a stress test against the float64
polynomial (tests/unit/library/ops/test_gram_newton_schulz.py); in bf16 the Gram path is offered
for up to 5 steps of polar_express, never for cans, and for any steps of the others (`gram_stable`).
`gram_pays(m, n, ...)` compares exact FLOP counts; square blocks stay on the standard path.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers import muon_utils

Coefficients = tuple[float, float, float]

# emerging_optimizers' newton_schulz repeats the last set for these types, cycles the others.
REPEAT_LAST_TYPES = ("polar_express", "cans", "deepseekv4")
# Restarts after step FIRST_RESTART, then every RESTART_EVERY steps (never after the last).
FIRST_RESTART, RESTART_EVERY = 3, 2
# In bf16 (and tf32) these types lose accuracy on the Gram path beyond this many steps.
BF16_MAX_STEPS = {"polar_express": 5, "cans": 0}


def coefficient_schedule(coefficient_type: str, steps: int) -> list[Coefficients]:
    """The (a, b, c) of each of `steps` steps, as emerging_optimizers' newton_schulz uses them."""
    sets = getattr(muon_utils, "_COEFFICIENT_SETS", None)
    if not isinstance(sets, dict) or coefficient_type not in sets:
        raise ValueError(
            f"Gram Newton-Schulz cannot read coefficient set {coefficient_type!r} from the installed "
            f"emerging_optimizers (muon_utils._COEFFICIENT_SETS); it has "
            f"{sorted(sets) if isinstance(sets, dict) else 'none'}."
        )
    mode = "repeat_last" if coefficient_type in REPEAT_LAST_TYPES else "cycle"
    return [tuple(map(float, abc)) for abc in muon_utils.get_coefficient_iterator(steps, sets[coefficient_type], mode)]


def restart_steps(steps: int) -> tuple[int, ...]:
    """Steps (1-based) after which the iteration restarts (module docstring)."""
    return tuple(range(FIRST_RESTART, steps, RESTART_EVERY))


def gram_stable(coefficient_type: str, steps: int, precision: str) -> bool:
    """Whether the Gram path keeps the standard iteration's accuracy at this matmul precision."""
    return precision == "highest" or steps <= BF16_MAX_STEPS.get(coefficient_type, steps)


def standard_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of `steps` standard steps on an m x n block (m <= n): XX^T, A^2, BX."""
    return steps * (4 * m * m * n + 2 * m**3)


def gram_flops(m: int, n: int, steps: int, restarts: Sequence[int] = ()) -> int:
    """Matmul FLOPs of Gram Newton-Schulz on an m x n block, counted as `gram_newton_schulz` runs."""
    flops, fresh = 2 * m * m * n, True  # R_0 = X_0 X_0^T; Q = I after a (re)start
    for step in range(1, steps + 1):
        flops += 2 * m**3 + (0 if fresh else 2 * m**3)  # Z = bR + cR^2; Q <- aQ + ZQ
        fresh = False
        if step < steps and step in restarts:
            flops += 4 * m * m * n  # X_0 <- Q X_0; R <- X_0 X_0^T
            fresh = True
        elif step < steps:
            flops += 4 * m**3  # R <- P R P
    return flops + 2 * m * m * n  # Q X_0


def gram_pays(m: int, n: int, steps: int, restarts: Sequence[int] = ()) -> bool:
    """Whether Gram Newton-Schulz takes fewer FLOPs than the standard iteration on an m x n block
    (oriented so that the iteration's Gram matrix is m x m)."""
    return gram_flops(m, n, steps, restarts) < standard_flops(m, n, steps)


def _addmm(input: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """beta * input + alpha * a @ b, 2-D or batched."""
    if a.ndim == 2:
        return torch.addmm(input, a, b, beta=beta, alpha=alpha)
    return torch.baddbmm(input, a, b, beta=beta, alpha=alpha)


def _gram(x: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """x x^T, summed over the TP ranks that hold column shards of x."""
    gram = x @ x.mT
    if tp_group is not None:
        dist.all_reduce(gram, op=dist.ReduceOp.SUM, group=tp_group)
    return gram


def gram_newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    eps: float = 1e-7,
    transpose: Optional[bool] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    restarts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Orthogonalize `x` (2-D or a batch) as `muon_utils.newton_schulz` does, by the Gram iteration.

    x: float32 (the matmul precision decides bf16 or fp32 products, as there) or float64.
    tp_group: x holds this rank's columns (after the transpose): the Gram matrices are
    all-reduced, which is exact; everything else is local. restarts: None for `restart_steps`.
    """
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
    schedule = coefficient_schedule(coefficient_type, steps)
    if restarts is None:
        restarts = restart_steps(steps)
    polynomial, base = _polynomial(x, schedule, set(restarts), tp_group)
    result = (polynomial @ base).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return result.mT if transpose else result


def _polynomial(x: torch.Tensor, schedule: Sequence[Coefficients], restarts: set[int],
                tp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, X_r): the accumulated polynomial since the last restart and the iterate it applies to."""
    r = _gram(x, tp_group)
    q: Optional[torch.Tensor] = None
    for step, (a, b, c) in enumerate(schedule, start=1):
        z = _addmm(r, r, r, beta=b, alpha=c)  # Z = b R + c R^2, so P = a I + Z
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = _addmm(q, z, q, beta=a)  # P Q
        if step == len(schedule):
            break
        if step in restarts:
            x = q @ x
            r, q = _gram(x, tp_group), None
        else:
            rp = _addmm(r, r, z, beta=a)  # R P
            r = _addmm(rp, z, rp, beta=a)  # P R P
    return q, x  # type: ignore[return-value]  (steps >= 1)
