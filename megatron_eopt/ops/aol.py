"""AOL-preconditioned Newton-Schulz: Turbo-Muon (Boissin, Massena, Mamalet, Serrurier, arXiv 2512.04632).

Newton-Schulz needs its input's spectral norm at most 1. The standard iteration divides X by its
Frobenius norm, which bounds it but shrinks every singular value by up to sqrt(rank). AOL (Prach &
Lampert, 2022) scales row i of X (m x n, m <= n after the transpose) by
    d_i = (sum_j |(X X^T)_ij|)^(-1/2)
instead: ||D X||_2 <= 1, with the singular values closer to 1 (the paper reports 4 steps of its
'aol' coefficients at 5 quintic steps' polar error; docs/newton-schulz.md measures ours). X X^T is
the first step's product anyway: D (X X^T) D is the preconditioned Gram matrix, so the
preconditioner costs the row sums and two scalings. With a `tp_group` (x holds columns of the
matrix) the Gram matrix is all-reduced before the row sums, so every rank scales by the same D.

D X has another polar factor than X, so the side scaled must not depend on how the iteration is
oriented: it is always the side emerging_optimizers' transpose rule puts first (the smaller one).
Where a caller fixes the orientation the other way ('distributed' TP mode: its shards must be
columns, and a matrix may be sharded along its smaller side), the columns are scaled instead, by
X^T X's absolute row sums, over the gathered columns (`aol_preconditioned`).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_eopt.config.choices import TURBO_MUON_COEFFICIENT_TYPE, TURBO_MUON_NUM_NS_STEPS
from megatron_eopt.ops.newton_schulz_steps import (
    addmm,
    coefficient_schedule,
    gram_matrix,
    oriented_unit_input,
    restored_output,
)
from megatron_eopt.runtime.process_groups import group_size


def aol_precondition(x: torch.Tensor, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(D x, D gram D) for gram = x x^T (2-D or batched): D from gram's absolute row sums.

    The row sums are taken in at least fp32 (gram may be bf16). A zero row stays zero (its sum is
    clamped to the smallest normal number instead of dividing by zero).
    """
    scales = _inverse_sqrt_row_sums(gram).unsqueeze(-1)
    return x * scales.to(x.dtype), gram * (scales * scales.mT).to(gram.dtype)


def aol_preconditioned(x: torch.Tensor, transposed: bool,
                       tp_group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the preconditioned x, its Gram matrix x x^T) for x as `oriented_unit_input` returns it
    (`transposed`: whether it was; with `tp_group`, this rank's columns).

    The rows are scaled where they are the side the transpose rule puts first (the Gram matrix
    then gives the scales: `aol_precondition`); else the columns, from X^T X (module docstring)."""
    if not _scales_columns(x, transposed, tp_group):
        return aol_precondition(x, gram_matrix(x, tp_group))
    x = x * _column_scales(x, tp_group)
    return x, gram_matrix(x, tp_group)


def _scales_columns(x: torch.Tensor, transposed: bool, tp_group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the transpose rule (transpose a matrix with more rows than columns) would orient the
    whole matrix the other way: then its first side is x's columns."""
    rows, columns = x.size(-2), x.size(-1) * (group_size(tp_group) if tp_group is not None else 1)
    original_rows, original_columns = (columns, rows) if transposed else (rows, columns)
    return (original_rows > original_columns) != transposed


def _column_scales(x: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """1/sqrt of X^T X's absolute row sums for x's columns (a row vector to multiply x by); with a
    `tp_group`, over every rank's columns: one all-gather of the matrix."""
    every_column = x
    if tp_group is not None and group_size(tp_group) > 1:
        shards = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(group_size(tp_group))]
        dist.all_gather(shards, x.contiguous(), group=tp_group)
        every_column = torch.cat(shards, dim=-1)
    return _inverse_sqrt_row_sums(x.mT @ every_column).unsqueeze(-2).to(x.dtype)


def _inverse_sqrt_row_sums(products: torch.Tensor) -> torch.Tensor:
    """1/sqrt of the absolute row sums, in at least fp32 (the products may be bf16); a zero row's
    sum is clamped to the smallest normal number instead of dividing by zero."""
    sums = products.abs().sum(dim=-1, dtype=torch.promote_types(products.dtype, torch.float32))
    return torch.rsqrt(sums.clamp_min(torch.finfo(sums.dtype).tiny))


def aol_newton_schulz(
    x: torch.Tensor,
    steps: int = TURBO_MUON_NUM_NS_STEPS,
    coefficient_type: str = TURBO_MUON_COEFFICIENT_TYPE,
    eps: float = 1e-7,
    transpose: Optional[bool] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Orthogonalize `x` (2-D or a batch) as `muon_utils.newton_schulz` does (transpose rule,
    coefficient schedule, step, bf16 at 'medium' precision), starting from the AOL-preconditioned x.

    x: float32 (or float64). tp_group: x holds this rank's columns (after the transpose); the Gram
    matrices and the Frobenius norm are all-reduced, everything else is local. The Frobenius
    normalization stays, although D x does not depend on x's scale: x x^T of a unit x cannot overflow.
    """
    input_dtype = x.dtype
    x, transpose = oriented_unit_input(x, transpose, eps, tp_group)
    x, gram = aol_preconditioned(x, transpose, tp_group)
    for step, (a, b, c) in enumerate(coefficient_schedule(coefficient_type, steps)):
        if step:
            gram = gram_matrix(x, tp_group)
        z = addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = addmm(x, z, x, beta=a)  # a X + (b A + c A^2) X
    return restored_output(x, transpose, input_dtype)


def check_sign_preserving(coefficient_type: str, steps: int) -> None:
    """ValueError unless the schedule's polynomial is positive on (0, 1]: the preconditioner puts the
    largest singular value near 1, where a negative value would turn that direction of the update
    around (emerging_optimizers 0.3's 'aol' set x 4 does so above 0.87)."""
    sigma = torch.linspace(1e-3, 1.0, 1000, dtype=torch.float64)
    value = sigma.clone()
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        value = a * value + b * value**3 + c * value**5
    if (value <= 0).any():
        first = sigma[value <= 0][0].item()
        raise ValueError(
            f"Newton-Schulz coefficient type {coefficient_type!r} x {steps} steps maps singular values from "
            f"{first:.3f} up to negative ones, and the AOL preconditioner puts the largest near 1: those "
            f"directions of the update would turn around. With muon_aol_preconditioner, choose another "
            f"(Turbo-Muon's default: {TURBO_MUON_COEFFICIENT_TYPE!r} x {TURBO_MUON_NUM_NS_STEPS})."
        )
