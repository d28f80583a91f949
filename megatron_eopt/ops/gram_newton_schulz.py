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

from megatron_eopt.ops.aol import aol_preconditioned
from megatron_eopt.ops.newton_schulz_steps import (  # noqa: F401 (coefficient_schedule: this module's API too)
    Coefficients,
    addmm,
    coefficient_schedule,
    gram_matrix,
    oriented_unit_input,
    restored_output,
)

# Restarts after step FIRST_RESTART, then every RESTART_EVERY steps (never after the last).
FIRST_RESTART, RESTART_EVERY = 3, 2
# In bf16 (and tf32) these types lose accuracy on the Gram path beyond this many steps.
BF16_MAX_STEPS = {"polar_express": 5, "cans": 0}


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


def gram_newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    eps: float = 1e-7,
    transpose: Optional[bool] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    restarts: Optional[Sequence[int]] = None,
    aol: bool = False,
) -> torch.Tensor:
    """Orthogonalize `x` (2-D or a batch) as `muon_utils.newton_schulz` does, by the Gram iteration.

    x: float32 (the matmul precision decides bf16 or fp32 products, as there) or float64.
    tp_group: x holds this rank's columns (after the transpose): the Gram matrices are
    all-reduced, which is exact; everything else is local. restarts: None for `restart_steps`.
    aol: iterate on the AOL-preconditioned X_0 and Gram matrix (ops/aol.py).
    """
    input_dtype = x.dtype
    x, transpose = oriented_unit_input(x, transpose, eps, tp_group)
    schedule = coefficient_schedule(coefficient_type, steps)
    if restarts is None:
        restarts = restart_steps(steps)
    polynomial, base = _polynomial(x, schedule, set(restarts), tp_group, aol, transpose)
    return restored_output(polynomial @ base, transpose, input_dtype)


def _polynomial(x: torch.Tensor, schedule: Sequence[Coefficients], restarts: set[int],
                tp_group: Optional[dist.ProcessGroup], aol: bool, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, X_r): the accumulated polynomial since the last restart and the iterate it applies to."""
    x, r = aol_preconditioned(x, transposed, tp_group) if aol else (x, gram_matrix(x, tp_group))
    q: Optional[torch.Tensor] = None
    for step, (a, b, c) in enumerate(schedule, start=1):
        z = addmm(r, r, r, beta=b, alpha=c)  # Z = b R + c R^2, so P = a I + Z
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = addmm(q, z, q, beta=a)  # P Q
        if step == len(schedule):
            break
        if step in restarts:
            x = q @ x
            r, q = gram_matrix(x, tp_group), None
        else:
            rp = addmm(r, r, z, beta=a)  # R P
            r = addmm(rp, z, rp, beta=a)  # P R P
    return q, x  # type: ignore[return-value]  (steps >= 1)
