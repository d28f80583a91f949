"""Deterministic assignment of whole matrices to ranks, balancing Newton-Schulz cost.

Largest cost first onto the least-loaded rank (ties: lower index, lower rank), so every rank
computes the same assignment from the same list of costs without communicating. `assign_owners`
gives each parameter of the layer-wise and FSDP2 optimizers its owner this way.
"""

import math
from typing import Protocol, Sequence

import torch

from megatron_eopt.ops.splits import newton_schulz_cost, tensor_parallel_rank_shape


class OwnedParam(Protocol):
    """What ownership reads of a parameter's record (params.groups.ParamRecord has it)."""

    fqn: str
    param: torch.Tensor
    partition_dim: int  # 0/1: split over tensor-parallel ranks by rows/columns; -1: whole


def assign_owner_ranks(costs: list[int], num_ranks: int) -> list[int]:
    """The owner rank of each item; `costs[i]` is item i's cost."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1; got {num_ranks}.")
    loads = [0] * num_ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def newton_schulz_cost_of(record: OwnedParam, tp_size: int) -> int:
    """Cost of orthogonalizing the record's global matrix (TP shards joined); an N-D tensor of
    matrices (experts) costs its matrices together."""
    *leading, rows, cols = tensor_parallel_rank_shape(record.param)
    count = math.prod(leading)
    if record.partition_dim == 0:
        rows *= tp_size
    elif record.partition_dim == 1:
        cols *= tp_size
    return count * newton_schulz_cost(rows, cols)


def assign_owners(records: Sequence[OwnedParam], matrix_fqns: set[str], dp_size: int, tp_size: int) -> dict[str, int]:
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
