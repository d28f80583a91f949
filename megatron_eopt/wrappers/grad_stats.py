"""Gradient statistics that decide a step: non-finite count, squared L2 norm, zero count.

All three are sums, so one all-reduce (SUM) per process group carries them together. They
stay on the device: nothing here waits for the device (no `.item()`, no branch on a tensor);
the step reads them back once (wrappers/base.py).
"""

from collections import defaultdict
from typing import Optional, Sequence

import torch

from megatron_eopt.runtime.process_groups import ProcessGroup, all_reduce_sum

# Index of each statistic in the tensor that travels.
NONFINITE, SUM_OF_SQUARES, ZEROS = 0, 1, 2


def unscale_and_count_nonfinite(grads: list[torch.Tensor], inv_scale: torch.Tensor,
                                device: Optional[torch.device] = None) -> torch.Tensor:
    """Multiply every gradient by `inv_scale` in place; a 0-dim fp32 tensor on `device`
    (default: `inv_scale`'s), > 0 if any had inf/NaN.

    One fused pass per device (the same kernel torch's AMP GradScaler uses).
    """
    device = inv_scale.device if device is None else device
    count = torch.zeros((), dtype=torch.float32, device=device)
    for grad_device, device_grads in _by_device(grads).items():
        found = torch.zeros(1, dtype=torch.float32, device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            device_grads, found, inv_scale.to(device=grad_device, dtype=torch.float32)
        )
        count = count + found.to(device).squeeze(0)
    return count


def count_zeros(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Number of zero entries over `grads`, as a 0-dim fp32 tensor on `device` (no host sync).

    Counted in int64, then carried in fp32 with the other statistics, as megatron-core counts
    them (exact up to 2^24 zeros).
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad_device, device_grads in _by_device(grads).items():
        per_grad = torch.stack([(g == 0).sum() for g in device_grads])
        total = total + per_grad.sum().to(device=device, dtype=torch.float32)
    return total


def local_grad_stats(
    norm_grads: list[torch.Tensor],
    other_grads: list[torch.Tensor],
    inv_scale: Optional[torch.Tensor],
    count_zeros_in_grad: bool,
    device: torch.device,
) -> torch.Tensor:
    """[non-finite, sum of squares, zeros] of this rank, before any reduction, on `device`.

    `norm_grads` count in the norm (each tensor-parallel-duplicated parameter on one rank
    only); `other_grads` are the remaining copies, which are still checked for inf/NaN.
    With a loss scale (`inv_scale`), every gradient is unscaled and checked in one fused pass.
    Without one, the norm's sum of squares is non-finite exactly when a gradient in it is inf or
    NaN (or so large that its square overflows, also treated as overflow), so only
    `other_grads` need a pass of their own: one read of the gradients fewer.
    """
    nonfinite = torch.zeros((), dtype=torch.float32, device=device)
    sum_of_squares = torch.zeros((), dtype=torch.float32, device=device)
    zeros = torch.zeros((), dtype=torch.float32, device=device)
    if inv_scale is not None:
        nonfinite = unscale_and_count_nonfinite(norm_grads + other_grads, inv_scale, device)
    elif other_grads:
        nonfinite = unscale_and_count_nonfinite(other_grads, torch.ones(1, device=device), device)
    if norm_grads:
        norms = torch._foreach_norm([g.float() for g in norm_grads], 2.0)
        sum_of_squares = torch.stack([n.to(device) for n in norms]).square().sum()
        if count_zeros_in_grad:
            zeros = count_zeros(norm_grads, device)
    # A non-finite norm counts as overflow; 0 keeps the reduced sum meaningful for the other
    # ranks' view. Masked on the device instead of branched on, so the device is not waited for.
    finite = torch.isfinite(sum_of_squares)
    nonfinite = nonfinite + (~finite).float()
    sum_of_squares = torch.where(finite, sum_of_squares, torch.zeros_like(sum_of_squares))
    return torch.stack([nonfinite, sum_of_squares, zeros])


def reduced_grad_stats(stats: torch.Tensor, groups: Sequence[Optional[ProcessGroup]]) -> torch.Tensor:
    """Sum the statistics over the ranks that hold disjoint parts of the model.

    Several groups are summed one after the other (e.g. data-parallel owners, then the
    model-parallel group), which sums over their product.
    """
    for group in groups:
        all_reduce_sum(stats, group)
    return stats


def scale_grads(grads: list[torch.Tensor], factor: float) -> None:
    for device_grads in _by_device(grads).values():
        torch._foreach_mul_(device_grads, factor)


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    grouped: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        grouped[tensor.device].append(tensor)
    return grouped
