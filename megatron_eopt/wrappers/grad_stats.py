"""Gradient statistics that decide a step: non-finite count, squared L2 norm, zero count, and
for each separate gradient-norm group its squared norm and how many parameters it has.

All are sums, so one all-reduce (SUM) per process group carries them together. They
stay on the device: nothing here waits for the device (no `.item()`, no branch on a tensor);
the step reads them back once (wrappers/base.py).

Separate gradient-norm groups are megatron-core's: a parameter tagged `grad_norm_group='mtp'`
(megatron-core's `mtp_detach_heads` tags the multi-token-prediction heads) is left out of the
main norm and clipped by its group's own norm; an unregistered group name is an error.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from megatron_eopt.runtime.process_groups import ProcessGroup, all_reduce_sum

# megatron-core's registered separate gradient-norm groups and the attribute that tags them.
MTP_GRAD_NORM_GROUP = "mtp"
GRAD_NORM_GROUP_ATTR = "grad_norm_group"
SEPARATE_GRAD_NORM_GROUPS: tuple[str, ...] = (MTP_GRAD_NORM_GROUP,)

# Index of each statistic in the tensor that travels; then, per separate group g (in
# SEPARATE_GRAD_NORM_GROUPS' order), its sum of squares at group_index(g) and its parameter count
# right after.
NONFINITE, SUM_OF_SQUARES, ZEROS = 0, 1, 2
STATS_SIZE = 3 + 2 * len(SEPARATE_GRAD_NORM_GROUPS)


def group_index(grad_norm_group: str) -> int:
    """Where `grad_norm_group`'s sum of squares travels in the statistics."""
    return 3 + 2 * SEPARATE_GRAD_NORM_GROUPS.index(check_grad_norm_group(grad_norm_group))


def check_grad_norm_group(grad_norm_group: str) -> str:
    if grad_norm_group not in SEPARATE_GRAD_NORM_GROUPS:
        raise ValueError(
            f"Unknown grad_norm_group {grad_norm_group!r}; the registered ones are "
            f"{', '.join(map(repr, SEPARATE_GRAD_NORM_GROUPS))} (megatron-core's SEPARATE_GRAD_NORM_GROUPS)."
        )
    return grad_norm_group


def grad_norm_group_of(param: torch.Tensor, name: str = "") -> Optional[str]:
    """The separate gradient-norm group `param` is tagged with (None: the main norm)."""
    group = getattr(param, GRAD_NORM_GROUP_ATTR, None)
    if group is None:
        return None
    try:
        return check_grad_norm_group(group)
    except ValueError as error:
        raise ValueError(f"parameter {name!r}: {error}" if name else str(error)) from None


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


@dataclass
class LocalStats:
    """One child's gradient statistics before any reduction.

    `stats` holds the STATS_SIZE statistics with the sums of squares left 0; `norms` the fp32 norm of
    each gradient a norm counts, in the child's parameter order (key None: the main norm; a separate
    group's by its name), or None for a child that only checks for inf/NaN; `groups` the process
    groups its statistics are summed over, one after the other; `params`, where the child gives
    them, the model parameters whose gradients' norms `norms` holds, key by key, in its order.
    `reduced_stats` sums children."""

    stats: torch.Tensor
    norms: Optional[dict[Optional[str], list[torch.Tensor]]]
    groups: tuple
    params: Optional[dict[Optional[str], list[torch.Tensor]]] = None


def local_grad_stats(
    norm_grads: list[torch.Tensor],
    other_grads: list[torch.Tensor],
    inv_scale: Optional[torch.Tensor],
    count_zeros_in_grad: bool,
    device: torch.device,
    groups: Sequence[Optional[ProcessGroup]],
    group_grads: Optional[Mapping[str, list[torch.Tensor]]] = None,
) -> LocalStats:
    """This rank's statistics of one child, before any reduction, on `device`.

    `norm_grads` count in the main norm (each tensor-parallel-duplicated parameter on one rank
    only); `group_grads` (group -> gradients, counted as `norm_grads` are) in their separate
    group's norm; `other_grads` are the remaining copies, which are still checked for inf/NaN.
    With a loss scale (`inv_scale`), every gradient is unscaled and checked in one fused pass.
    Without one, a norm is non-finite exactly when a gradient in it is inf or NaN (or so large
    that its square overflows, also treated as overflow; `reduced_stats` checks), so only
    `other_grads` need a pass of their own: one read of the gradients fewer.
    """
    group_grads = dict(group_grads or {})
    counted = norm_grads + [g for grads in group_grads.values() for g in grads]
    stats = torch.zeros(STATS_SIZE, dtype=torch.float32, device=device)
    if inv_scale is not None:
        stats[NONFINITE] = unscale_and_count_nonfinite(counted + other_grads, inv_scale, device)
    elif other_grads:
        stats[NONFINITE] = unscale_and_count_nonfinite(other_grads, torch.ones(1, device=device), device)
    for name, grads in group_grads.items():
        stats[group_index(name) + 1] = len(grads)
    if count_zeros_in_grad and counted:
        stats[ZEROS] = count_zeros(counted, device)
    norms = {None: _norms(norm_grads, device), **{name: _norms(grads, device) for name, grads in group_grads.items()}}
    return LocalStats(stats, norms, tuple(groups))


def _norms(grads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The fp32 L2 norm of each gradient that has elements, on `device` (megatron-core's list has no
    empty shard of a sharded parameter; an entry 0 would still change how the vector's norm rounds)."""
    grads = [g.float() for g in grads if g.numel() > 0]
    return [n.to(device) for n in torch._foreach_norm(grads, 2.0)] if grads else []


def reduced_stats(children: Sequence[LocalStats]) -> torch.Tensor:
    """The children's statistics summed over their ranks, as float64 on the first child's device.

    A norm is summed as megatron-core's ChainedOptimizer sums it (its `get_grad_norm` and
    clip_grads.py's `get_grad_norm_fp32` without Transformer Engine or Apex, as on CPU), so that
    clipping by it changes the same bits: where every child sums over the same groups, the norm of
    the vector of all their gradients' norms (in the children's order), in fp32, squared, then
    summed over the groups; where they differ, each child's so, and those added in float64 (it adds
    Python floats). Children that only check for inf/NaN (`norms` None) are summed on their own."""
    counted = [child for child in children if child.norms is not None]
    shared = len({child.groups for child in counted}) <= 1
    parts = [_merged(counted)] if shared and counted else counted
    totals = [_reduced_with_squares(part).double() for part in parts]
    totals += [reduced_grad_stats(child.stats.clone(), child.groups).double()
               for child in children if child.norms is None]
    total = totals[0]
    for more in totals[1:]:
        total = total + more.to(total.device)
    return total


class NormsInParamOrder:
    """Arranges children's statistics (wrappers/base.py's ArrangeStats) where one megatron-core
    optimizer holds them all: children that share the norm's groups as one, each norm group's
    gradient norms in `params`' order (megatron-core's Megatron-FSDP optimizer is one
    DistributedOptimizer over every param group, experts within the dense ones: factory.py's
    `_megatron_core_param_order`)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.position = {id(p): index for index, p in enumerate(params)}

    def __call__(self, children: list[LocalStats]) -> list[LocalStats]:
        counted = [child for child in children if child.norms is not None]
        if len({child.groups for child in counted}) != 1 or any(child.params is None for child in counted):
            return children
        merged = _merged(counted)
        keys = dict.fromkeys(key for child in counted for key in child.norms)
        for key in keys:
            pairs = [(self.position[id(p)], norm) for child in counted
                     for p, norm in zip(child.params.get(key, []), child.norms.get(key, []))]
            merged.norms[key] = [norm for _, norm in sorted(pairs, key=lambda pair: pair[0])]
        return [merged] + [child for child in children if child.norms is None]


def _merged(children: list[LocalStats]) -> LocalStats:
    """Children that sum over the same groups as one: statistics added, norms concatenated in order."""
    stats = children[0].stats.clone()
    for child in children[1:]:
        stats += child.stats.to(stats.device)
    keys = dict.fromkeys(key for child in children for key in child.norms)
    norms = {key: [n for child in children for n in child.norms.get(key, [])] for key in keys}
    return LocalStats(stats, norms, children[0].groups)


def _reduced_with_squares(part: LocalStats) -> torch.Tensor:
    """`part`'s statistics with each norm's square, megatron-core's way: the fp32 norm of the vector
    of per-gradient norms, squared; a non-finite one counted as overflow and summed as 0 (the
    device is not waited for). Then summed over `part.groups`."""
    stats = part.stats.clone()
    for key, norms in part.norms.items():
        if norms:
            at = SUM_OF_SQUARES if key is None else group_index(key)
            stats[at] = torch.linalg.vector_norm(torch.stack([n.to(stats.device) for n in norms])).square()
    squares = stats[SUM_OF_SQUARES::2][: 1 + len(SEPARATE_GRAD_NORM_GROUPS)]
    finite = torch.isfinite(squares)
    stats[NONFINITE] += (~finite).sum().float()
    stats[SUM_OF_SQUARES::2] = torch.where(finite, squares, torch.zeros_like(squares))
    return reduced_grad_stats(stats, part.groups)


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
