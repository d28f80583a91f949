"""Collectives over lists of tensors, one call for all of them."""

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
