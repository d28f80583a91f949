"""Collectives over lists of tensors, one call for all of them; the single-tensor gather and
reduce-scatter under the names of the installed torch; waits for asynchronous collectives that
end, within the process group's timeout, in one `CollectiveTimeout` naming what was stuck."""

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_eopt.runtime.process_groups import group_size


def all_reduce_sum_coalesced(tensors: list[torch.Tensor], group: Optional[ProcessGroup]) -> None:
    """Sum `tensors` over `group` in place with one collective for all of them (flattened into
    one buffer); a no-op for an empty list or a size-1 (None) group. Every rank of the group
    must pass tensors of the same shapes in the same order."""
    if not tensors or group_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(part.view_as(tensor))


# torch 2.13 renames all_gather_into_tensor and reduce_scatter_tensor to these (the old names,
# thin wrappers now, print a FutureWarning); older torch has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveTimeout(RuntimeError):
    """An asynchronous collective did not complete within its process group's timeout (a rank
    stopped or is far behind); the message names the operation, the group and what it carried."""


def group_timeout(group: Optional[ProcessGroup]) -> datetime.timedelta:
    """The timeout `group` (None: the default group) was made with (init_process_group's or
    new_group's `timeout`), read from its backend; torch's default for the backend when the
    backend does not expose it."""
    group = group or dist.group.WORLD
    for device in getattr(group, "_device_types", ()):
        options = getattr(group._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


def wait_bounded(work: Any, group: Optional[ProcessGroup], operation: str) -> None:
    """`work.wait()`, bounded by `group`'s timeout: `Work.wait()` without a timeout can wait
    forever on a stopped peer. On expiry (or a failure reported by the wait) raises
    CollectiveTimeout: "<operation> over ranks [...] did not complete within <timeout>"."""
    timeout = group_timeout(group)
    try:
        completed = work.wait(timeout=timeout)
    except RuntimeError as error:
        if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
            raise
        completed = False
    if completed is False:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        raise CollectiveTimeout(f"{operation} over ranks {ranks} did not complete within "
                                f"{timeout.total_seconds():g} s (the process group's timeout)")
