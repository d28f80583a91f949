"""Deterministic assignment of whole matrices to ranks, balancing Newton-Schulz cost.

Largest cost first onto the least-loaded rank (ties: lower index, lower rank), so every rank
computes the same assignment from the same list of costs without communicating.
"""


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
