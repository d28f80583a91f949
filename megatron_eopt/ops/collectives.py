"""Collectives over lists of tensors, one call for all of them; the single-tensor gather and
reduce-scatter under the names of the installed torch."""

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def all_reduce_sum_coalesced(tensors: list[torch.Tensor], group: Optional[ProcessGroup]) -> None:
    """Sum `tensors` over `group` in place with one collective for all of them (flattened into
    one buffer); a no-op for an empty list or a size-1 (None) group. Every rank of the group
    must pass tensors of the same shapes in the same order."""
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(part.view_as(tensor))


# torch 2.13 renames all_gather_into_tensor and reduce_scatter_tensor to these (the old names,
# thin wrappers now, print a FutureWarning); older torch has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
