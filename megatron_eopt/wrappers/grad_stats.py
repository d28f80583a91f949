"""Gradient statistics that decide a step: non-finite count, squared L2 norm, zero count.

All three are sums, so one all-reduce (SUM) per process group carries them together.
"""

from collections import defaultdict
from typing import Optional, Sequence

import torch

from megatron_eopt.distributed.process_groups import ProcessGroup, all_reduce_sum

# Index of each statistic in the tensor that travels.
NONFINITE, SUM_OF_SQUARES, ZEROS = 0, 1, 2


def unscale_and_count_nonfinite(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> float:
    """Multiply every gradient by `inv_scale` in place; > 0 if any had inf/NaN (per device).

    One fused pass per device (the same kernel torch's AMP GradScaler uses).
    """
    count = 0.0
    for device, device_grads in _by_device(grads).items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            device_grads, found, inv_scale.to(device=device, dtype=torch.float32)
        )
        count += found.item()
    return count


def local_grad_stats(
    norm_grads: list[torch.Tensor],
    other_grads: list[torch.Tensor],
    inv_scale: Optional[torch.Tensor],
    count_zeros: bool,
    device: torch.device,
) -> torch.Tensor:
    """[non-finite, sum of squares, zeros] of this rank, before any reduction.

    `norm_grads` count in the norm (each tensor-parallel-duplicated parameter on one rank
    only); `other_grads` are the remaining copies, which are still checked for inf/NaN.
    With a loss scale (`inv_scale`), every gradient is unscaled and checked in one fused pass.
    Without one, the norm's sum of squares is non-finite exactly when a gradient in it is inf or
    NaN (or so large that its square overflows, also treated as overflow), so only
    `other_grads` need a pass of their own: one read of the gradients fewer.
    """
    stats = torch.zeros(3, dtype=torch.float32, device=device)
    if inv_scale is not None:
        stats[NONFINITE] = unscale_and_count_nonfinite(norm_grads + other_grads, inv_scale)
    elif other_grads:
        stats[NONFINITE] = unscale_and_count_nonfinite(other_grads, torch.ones(1, device=device))
    if norm_grads:
        norms = torch._foreach_norm([g.float() for g in norm_grads], 2.0)
        stats[SUM_OF_SQUARES] = torch.stack([n.to(device) for n in norms]).square().sum()
        if count_zeros:
            stats[ZEROS] = sum(float((g == 0).sum().item()) for g in norm_grads)
    if not torch.isfinite(stats[SUM_OF_SQUARES]):
        stats[NONFINITE] += 1
        stats[SUM_OF_SQUARES] = 0.0  # keep the reduced sum meaningful for the other ranks' view
    return stats


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
