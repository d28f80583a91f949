"""LayerWiseDistributedOptimizer: each data-parallel rank owns whole parameters.

Muon needs whole matrices, so instead of ZeRO's byte shards every parameter has one owner in
its data-parallel group (dp x cp for dense parameters, the expert data-parallel group for
experts). Only the owner keeps optimizer state and fp32 main copies and runs the update
(Newton-Schulz included); afterwards it broadcasts the new values to the other ranks. Owners
are assigned deterministically on every rank: matrices by Newton-Schulz cost of their global
shape, largest first onto the least-loaded rank, then the other parameters by size.

A step:
1. with `reduce_grads`, the gradients are this rank's own and are averaged onto each
   parameter's owner by `reduce` (no all-reduce); otherwise they were already all-reduced
   (torch or megatron-core DDP) and each owner reads its own copy;
2. megatron-core's step recipe (wrappers/base.py) over the owned parameters: the gradient norm
   sums the owners' squares over the data-parallel group, then the model-parallel group;
   inf/NaN in any gradient of any rank, owned or not, skips the step everywhere;
3. after a successful step, owners broadcast their parameters in buckets; every async
   handle and its buffer stay referenced until waited on.
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eopt.distributed.process_groups import ProcessGroup, group_rank, group_size
from megatron_eopt.ops.ownership import assign_owner_ranks
from megatron_eopt.ops.splits import newton_schulz_cost
from megatron_eopt.param_groups import ParamRecord
from megatron_eopt.wrappers.base import MegatronOptimizer, SteppableChild, StepResult, take_step
from megatron_eopt.wrappers.chained import ChainedOptimizer
from megatron_eopt.wrappers.fp32 import model_grad
from megatron_eopt.wrappers.grad_stats import NONFINITE, reduced_grad_stats, unscale_and_count_nonfinite

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass
class DataParallelShards:
    """The parameters of one data-parallel group, by owner (index = rank within the group)."""

    group: Optional[ProcessGroup]  # None: size 1, this rank owns everything
    params_by_owner: list[list[torch.nn.Parameter]] = field(default_factory=list)

    @property
    def owned(self) -> list[torch.nn.Parameter]:
        return self.params_by_owner[group_rank(self.group)]

    def global_rank(self, owner: int) -> int:
        return dist.get_global_rank(self.group, owner)


def newton_schulz_cost_of(record: ParamRecord, tp_size: int) -> int:
    """Cost of orthogonalizing the record's global matrix (TP shards joined)."""
    rows, cols = record.param.shape
    if record.partition_dim == 0:
        rows *= tp_size
    elif record.partition_dim == 1:
        cols *= tp_size
    return newton_schulz_cost(rows, cols)


def assign_owners(records: Sequence[ParamRecord], matrix_fqns: set[str], dp_size: int, tp_size: int) -> dict[str, int]:
    """Owner (rank in the data-parallel group) of every parameter, the same on every rank.

    Matrices stepped by a matrix optimizer are balanced by Newton-Schulz cost, the other
    parameters separately by element count (their cost is proportional to their size). The
    others' largest share then goes to the rank holding the fewest matrix elements, the next
    largest to the next rank, and so on; taken as they come, both shares 0 (each with its pass's
    largest item, e.g. a matrix and the embedding) would land on rank 0, which would then hold
    far more optimizer state (it grows with elements) than total / dp_size.
    """
    matrices = [r for r in records if r.fqn in matrix_fqns]
    others = [r for r in records if r.fqn not in matrix_fqns]
    owners = {}
    matrix_costs = [newton_schulz_cost_of(r, tp_size) for r in matrices]
    for record, owner in zip(matrices, assign_owner_ranks(matrix_costs, dp_size)):
        owners[record.fqn] = owner
    matrix_elements, other_elements = [0] * dp_size, [0] * dp_size
    for record in matrices:
        matrix_elements[owners[record.fqn]] += record.param.numel()
    other_shares = assign_owner_ranks([r.param.numel() for r in others], dp_size)
    for record, share in zip(others, other_shares):
        other_elements[share] += record.param.numel()
    shares = sorted(range(dp_size), key=lambda s: (-other_elements[s], s))
    ranks = sorted(range(dp_size), key=lambda r: (matrix_elements[r], r))
    rank_of_share = dict(zip(shares, ranks))
    for record, share in zip(others, other_shares):
        owners[record.fqn] = rank_of_share[share]
    return owners


class _NonOwnedGradCheck(SteppableChild):
    """Counts inf/NaN in the gradients this rank does not own (its local copies)."""

    grad_scaler = None
    name = "non_owned"

    def __init__(self, params: list[torch.nn.Parameter], groups: Sequence[Optional[ProcessGroup]], device: torch.device) -> None:
        self.params, self.groups, self.device = params, tuple(groups), device

    def grad_stats(self, count_zeros: bool) -> torch.Tensor:
        stats = torch.zeros(3, dtype=torch.float32, device=self.device)
        grads = [g for g in map(model_grad, self.params) if g is not None]
        if grads:  # "unscaling" by 1 leaves every value as it is
            stats[NONFINITE] = unscale_and_count_nonfinite(grads, torch.ones(1, device=self.device))
        return reduced_grad_stats(stats, self.groups)

    def main_grads(self) -> list[torch.Tensor]:
        return []

    def step_with_ready_grads(self) -> None:
        pass

    def check_state_dict(self, state_dict: dict) -> None:
        pass


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Steps owned parameters with `chained_optimizers`, then broadcasts them (module docstring).

    Args:
        chained_optimizers: FP32Optimizer/MixedPrecisionOptimizer children over the parameters
            this rank owns (every rank has the same children, some possibly empty); their
            norm groups must include the data-parallel group.
        shards: one DataParallelShards per data-parallel group (dense, expert).
        all_params: every trainable parameter of the model on this rank.
        check_groups: groups over which the inf/NaN check of non-owned gradients is summed
            (together they must span every rank).
        reduce_grads: average this rank's own gradients onto the owners (True) or take them
            as already all-reduced (False).
        bucket_bytes: upper size of one broadcast/reduce buffer.
    """

    owner_is_main_replica = True  # only the owner holds a parameter's state

    def __init__(
        self,
        chained_optimizers: list[MegatronOptimizer],
        shards: list[DataParallelShards],
        all_params: list[torch.nn.Parameter],
        check_groups: Sequence[Optional[ProcessGroup]],
        reduce_grads: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(chained_optimizers)
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}.")
        self.shards = shards
        self.all_params = all_params
        self.reduce_grads = reduce_grads
        self.bucket_bytes = bucket_bytes
        owned = {id(p) for shard in shards for p in shard.owned}
        device = all_params[0].device if all_params else torch.device("cpu")
        self._non_owned_check = _NonOwnedGradCheck([p for p in all_params if id(p) not in owned], check_groups, device)

    def step(self) -> StepResult:
        if self.reduce_grads:
            self._reduce_grads_to_owners()
        result = take_step(self.chained_optimizers + [self._non_owned_check], self.config)
        if result[0]:
            self._broadcast_from_owners()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.all_params:  # the children only know the owned parameters
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (and fp32 main copies) held on this rank."""
        total = 0
        for child in self.chained_optimizers:
            for state in child.state.values():
                total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
            model_ids = {id(p) for p in child.model_params}
            total += sum(m.numel() * m.element_size() for m in child.main_params if id(m) not in model_ids)
        return total

    # Communication.
    def _reduce_grads_to_owners(self) -> None:
        """Average gradients over each data-parallel group onto the owners (async reduces)."""
        pending = []
        for shard in self.shards:
            size = group_size(shard.group)
            if size == 1:
                continue
            for owner, params in enumerate(shard.params_by_owner):
                for bucket in _buckets(params, self.bucket_bytes):
                    # One flag per parameter: whether any rank had a gradient for it.
                    flat = torch.cat([_grad_or_zeros(p).reshape(-1).float() for p in bucket]
                                     + [torch.tensor([float(model_grad(p) is not None) for p in bucket], device=bucket[0].device)])
                    work = dist.reduce(flat, dst=shard.global_rank(owner), op=dist.ReduceOp.SUM, group=shard.group, async_op=True)
                    pending.append((work, flat, bucket, owner == group_rank(shard.group), size))
        for work, flat, bucket, is_owner, size in pending:
            work.wait()
            if is_owner:
                _write_averaged_grads(flat, bucket, size)

    def _broadcast_from_owners(self) -> None:
        """Owners send their updated parameters to the rest of their data-parallel group."""
        pending = []
        for shard in self.shards:
            if group_size(shard.group) == 1:
                continue
            for owner, params in enumerate(shard.params_by_owner):
                for bucket in _buckets(params, self.bucket_bytes):
                    flat = torch.cat([p.detach().reshape(-1) for p in bucket])
                    work = dist.broadcast(flat, src=shard.global_rank(owner), group=shard.group, async_op=True)
                    pending.append((work, flat, bucket, owner == group_rank(shard.group)))
        for work, flat, bucket, is_owner in pending:  # keeps every handle and buffer alive
            work.wait()
            if not is_owner:
                _unflatten_into(flat, bucket)


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most `bucket_bytes` (or one) each."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        last = buckets[-1] if buckets else None
        if last and last[0].dtype == param.dtype and last[0].device == param.device and size + nbytes <= bucket_bytes:
            last.append(param)
            size += nbytes
        else:
            buckets.append([param])
            size = nbytes
    return buckets


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    grad = model_grad(param)
    return torch.zeros_like(param, dtype=torch.float32) if grad is None else grad


def _write_averaged_grads(flat: torch.Tensor, bucket: list[torch.nn.Parameter], size: int) -> None:
    flags = flat[-len(bucket):]
    offset = 0
    for index, param in enumerate(bucket):
        averaged = flat[offset:offset + param.numel()].view(param.shape) / size
        offset += param.numel()
        if flags[index] == 0:
            continue  # no rank had a gradient: the parameter is not stepped
        if hasattr(param, "main_grad"):
            param.main_grad.copy_(averaged)
        elif param.grad is None:
            param.grad = averaged.to(param.dtype)
        else:
            param.grad.copy_(averaged)


def _unflatten_into(flat: torch.Tensor, bucket: list[torch.nn.Parameter]) -> None:
    offset = 0
    with torch.no_grad():
        for param in bucket:
            param.copy_(flat[offset:offset + param.numel()].view(param.shape))
            offset += param.numel()
