"""Newton-Schulz, or any whole-matrix function, of matrices split by rows over a data-parallel
group (Shard(0) of torch FSDP2 or Megatron-FSDP; shards may be uneven or empty).

Each matrix has one owner rank, chosen by the caller. A step:
1. one all_to_all_single sends every rank's rows of each matrix to its owner (no padding);
2. each owner stacks the rows, splits the matrix into its blocks (q/k/v, gate/up) and
   orthogonalizes them, equal shapes batched;
3. a second all_to_all_single sends each rank its rows of the result.
A batch of matrices split by the rows of each (FSDP2's Shard(1) of experts [E, out, in]) is its
matrices, each split the same way (`matrix_row_shards`), owners round robin. A matrix stored
transposed (`Conv1D` [in, out]) goes as its stored rows; its owner transposes it whole.
`map_row_shards` is steps 1 and 3 around any function of the owned matrices (MOP's, PolarGrad's
and Scion's `orthogonalize`). With tensor parallelism as well, the owners of one matrix form one
TP group and orthogonalize its TP shards together in the TP mode; 'duplicated' runs as
'sharded' there. docs/fsdp2.md describes what is sent.
"""

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, orthogonalize_updates
from megatron_eopt.ops.splits import MatrixLayout, as_matrix, as_tensor, is_single_transposed, stored_shape
from megatron_eopt.runtime.process_groups import group_rank, group_size


@dataclass(frozen=True)
class RowShards:
    """How one matrix is split by rows over the group, and which rank orthogonalizes it.

    `per_matrix_rows`: the layout is a batch of matrices (experts [E, out, in]) whose every matrix
    is split by its rows the same way (FSDP2's Shard(1)); `rows_by_rank` are then the rows of
    each matrix, and `owner` is the first matrix's owner (`matrix_row_shards`).
    """

    layout: MatrixLayout  # of the whole matrix (its global shape and fused blocks)
    rows_by_rank: tuple[int, ...]  # rows each rank of the group holds (stored rows: splits.stored_shape)
    owner: int  # rank in the group that runs its Newton-Schulz
    per_matrix_rows: bool = False

    def __post_init__(self) -> None:
        rows, _ = stored_shape(self.layout)
        if self.per_matrix_rows:
            batch = self.layout.batch
            if batch is None or len(batch.shape) != 3 or batch.transposed or batch.interleaved_parts > 1:
                raise ValueError(
                    f"parameter {self.layout.name!r}: rows split per matrix need a 3-D batch of matrices "
                    f"stored [E, out, in] with contiguous row blocks; got {self.layout.batch}."
                )
            rows = batch.matrix_rows
        if sum(self.rows_by_rank) != rows or not 0 <= self.owner < len(self.rows_by_rank):
            raise ValueError(
                f"parameter {self.layout.name!r}: row shards {self.rows_by_rank} (owner {self.owner}) "
                f"do not cover its {rows} rows over {len(self.rows_by_rank)} ranks."
            )


def matrix_row_shards(shards: RowShards) -> list[RowShards]:
    """The matrices of a batch split by the rows of each (`per_matrix_rows`): one RowShards per
    matrix, the same row split, owners round robin from `shards.owner` (matrix i on owner + i)."""
    layout, size = shards.layout, len(shards.rows_by_rank)
    batch = layout.batch.with_leading(1)
    matrix = replace(layout, local_shape=batch.matrix_shape, num_row_groups=1, batch=batch)
    return [RowShards(matrix, shards.rows_by_rank, (shards.owner + index) % size)
            for index in range(layout.batch.count)]


def sharded_dim(param: torch.Tensor) -> int:
    """The dimension a DTensor's data-parallel mesh dimension (its first) splits: 0, or 1 for
    experts FSDP2 places Shard(1) (placement/fully_sharded_layout.py accepts no other)."""
    placement = getattr(param, "placements", (None,))[0]
    return getattr(placement, "dim", 0) if placement is not None and placement.is_shard() else 0


def gathered_rows(local_rows: Sequence[int], group: Optional[dist.ProcessGroup],
                  device: torch.device) -> list[tuple[int, ...]]:
    """Rows each rank of `group` holds of each matrix: `local_rows[i]` is this rank's count of
    matrix i. One all_gather; every rank must list the same matrices in the same order.

    The split is read, never computed: Megatron-FSDP cuts its flat buckets wherever the ranks'
    equal byte shares end, so its Shard(0) is not torch.chunk's.
    """
    if group_size(group) == 1:
        return [(rows,) for rows in local_rows]
    mine = torch.tensor(list(local_rows), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(everyone, mine, group=group)
    by_rank = torch.stack(everyone).cpu().tolist()
    return [tuple(ranks) for ranks in zip(*by_rank)] if local_rows else []


def held_rows(rows_by_rank: Sequence[int], rank: int) -> tuple[int, int]:
    """(first, end): the rows first..end-1 of the whole matrix that `rank` holds. Shards lie in
    rank order (a Shard(0) DTensor's), so its first row follows the rows of the ranks before it."""
    if not 0 <= rank < len(rows_by_rank):
        raise ValueError(f"rank {rank} is not in a group of {len(rows_by_rank)} ranks (rows {tuple(rows_by_rank)}).")
    first = sum(rows_by_rank[:rank])
    return first, first + rows_by_rank[rank]


def chunk_rows(rows: int, num_ranks: int) -> tuple[int, ...]:
    """Rows per rank as `torch.chunk` splits them: torch FSDP2's split, for plans and checkpoint
    layouts made without the model; a live model's split is `gathered_rows`."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1; got {num_ranks}.")
    per_rank = -(-rows // num_ranks)  # ceil: chunk's piece size; later ranks get less or nothing
    return tuple(max(0, min(per_rank, rows - rank * per_rank)) for rank in range(num_ranks))


def orthogonalize_row_shards(
    updates: list[torch.Tensor],
    shards: list[RowShards],
    group: Optional[dist.ProcessGroup],
    settings: NewtonSchulzSettings,
    tp_mode: Union[str, Sequence[str]] = "duplicated",
    tp_group: Optional[dist.ProcessGroup] = None,
) -> list[torch.Tensor]:
    """This rank's rows of the scaled orthogonalized update of every matrix (module docstring).

    `updates[i]` is this rank's row shard of matrix i (of this TP rank's shard of it, with a
    `tp_group` of size > 1); `tp_mode` is one mode or one per matrix. Every rank of `group` and
    of `tp_group` must call this with the same matrices in the same order.
    """
    modes = [tp_mode] * len(shards) if isinstance(tp_mode, str) else list(tp_mode)

    def orthogonalize_owned(owned: list[int], wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        return _orthogonalize_owned(wholes, [shards[i].layout for i in owned], settings,
                                    [modes[i] for i in owned], tp_group)

    return map_row_shards(updates, shards, group, orthogonalize_owned)


def map_row_shards(
    updates: list[torch.Tensor],
    shards: list[RowShards],
    group: Optional[dist.ProcessGroup],
    compute_owned: Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """This rank's rows of f(whole matrix i) for every i, f computed once, on the owner.

    `compute_owned(owned, wholes)` runs on every rank with the indices of the matrices it owns
    (an empty list on ranks that own none) and their whole matrices (stacked row shards, fp32),
    and returns the results, each of its matrix's whole shape. Every rank of `group` must call
    this with the same matrices in the same order.
    """
    size, rank = group_size(group), group_rank(group)
    device = updates[0].device if updates else torch.device("cpu")
    mine = [i for i, s in enumerate(shards) if s.owner == rank]
    cols = [stored_shape(s.layout)[1] for s in shards]

    # 1. Row shards to their owners.
    gathered = _exchange(
        [[updates[i] for i, s in enumerate(shards) if s.owner == dest] for dest in range(size)],
        [[(shards[i].rows_by_rank[src], cols[i]) for i in mine] for src in range(size)],
        group, device,
    )
    # 2. Owners compute on the whole matrices (with TP: their TP shards, over the TP group).
    wholes = [torch.cat([gathered[src][k] for src in range(size)]) for k in range(len(mine))]
    computed = compute_owned(mine, wholes)
    # 3. Every rank gets its rows back.
    back = _exchange(
        [[c.split(shards[i].rows_by_rank)[dest] for i, c in zip(mine, computed)] for dest in range(size)],
        [[tuple(updates[i].shape) for i, s in enumerate(shards) if s.owner == src] for src in range(size)],
        group, device,
    )
    results: list[torch.Tensor] = [torch.empty(0)] * len(updates)
    for src in range(size):
        for i, rows in zip([i for i, s in enumerate(shards) if s.owner == src], back[src]):
            results[i] = rows.to(updates[i].dtype)
    return results


def _orthogonalize_owned(wholes: list[torch.Tensor], layouts: list[MatrixLayout], settings: NewtonSchulzSettings,
                         tp_modes: list[str], tp_group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """Scaled orthogonalization of each owned matrix's blocks, in the TP mode over `tp_group`.

    Every rank of `tp_group` owns the same matrices (owners are chosen from shapes alone), so an
    empty list is empty on all of them and no TP collective is needed.
    """
    if not wholes:
        return []
    modes = ["sharded" if mode == "duplicated" else mode for mode in tp_modes]  # same update, Newton-Schulz once
    # A matrix stored transposed arrives as its stored rows: transposed now that it is whole.
    transposed = [is_single_transposed(layout) for layout in layouts]
    matrices = [as_matrix(w, layout) if t else w for w, layout, t in zip(wholes, layouts, transposed)]
    results = orthogonalize_updates(matrices, layouts, modes, tp_group, settings)
    return [as_tensor(r, layout) if t else r for r, layout, t in zip(results, layouts, transposed)]


def _exchange(send: list[list[torch.Tensor]], receive_shapes: list[list[tuple[int, int]]],
              group: Optional[dist.ProcessGroup], device: torch.device) -> list[list[torch.Tensor]]:
    """Send the tensors `send[r]` to rank r; receive fp32 tensors of `receive_shapes[r]` from it.

    One all_to_all_single over flat fp32 buffers with explicit split sizes (shards may be uneven
    or empty). The returned views keep the received buffer alive until the caller drops them.
    """
    send_splits = [sum(t.numel() for t in row) for row in send]
    receive_splits = [sum(r * c for r, c in row) for row in receive_shapes]
    flat = [t.reshape(-1).float() for row in send for t in row]
    send_buffer = torch.cat(flat) if flat else torch.empty(0, device=device)
    receive_buffer = torch.empty(sum(receive_splits), dtype=torch.float32, device=device)
    if group is None:
        receive_buffer.copy_(send_buffer)
    else:
        dist.all_to_all_single(receive_buffer, send_buffer, receive_splits, send_splits, group=group)
    received, offset = [], 0
    for row in receive_shapes:
        tensors = []
        for rows, cols in row:
            tensors.append(receive_buffer[offset:offset + rows * cols].view(rows, cols))
            offset += rows * cols
        received.append(tensors)
    return received
