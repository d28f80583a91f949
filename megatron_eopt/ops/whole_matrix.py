"""A tensor-parallel shard's whole matrix, and back: for optimizers whose update is a function
of the whole matrix (PolarGrad's nuclear norm, MOP's SVD, Scion's Newton-Schulz).

The whole matrix is the parameter's TP=1 value: each block of the shard (one block, or the
gate and up halves of a gated `linear_fc1`, built with partition_stride=2, or Mamba's and gated
delta net's in_proj parts) is all-gathered along `partition_dim` and the blocks are stacked. A fused `linear_qkv` is one block here (each rank
holds whole query groups, so its shards concatenate to the TP=1 row order); layouts that split
q/k/v (`num_row_groups` > 1) belong to Muon and are refused. A `tp_contiguous` matrix (MLA's
column-parallel `linear_kv_down_proj`) is one block too: TP shards it as one matrix; so is a
per-head (`per_group`) MLA up-projection, whose ranks hold whole heads in TP=1 order.

`gather_cut_matrices` and `keep_local_rows` do the same for Muon's `tp_contiguous` layouts,
whose shards may cut through a block: the blocks are split from the whole matrix.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout, shard_layout, split_blocks, whole_layout
from megatron_eopt.runtime.process_groups import group_rank, group_size


def _in_tp1_order(layout: MatrixLayout) -> bool:
    """Whether the TP shards, concatenated, are the TP=1 matrix: whole heads per rank (MLA's
    per-head layouts) or one matrix sharded as a whole (`tp_contiguous`)."""
    return layout.per_group or layout.tp_contiguous


def _is_sharded(layout: MatrixLayout, tp_group: Optional[dist.ProcessGroup]) -> bool:
    split = (layout.num_row_groups != 1 and not layout.per_group) or layout.head_rows > 0
    if layout.partition_dim >= 0 and group_size(tp_group) > 1 and split:
        raise ValueError(
            f"parameter {layout.name!r}: a whole-matrix layout has one row group and no per-head "
            f"split; got {layout.num_row_groups} group(s), head_rows={layout.head_rows} (a q/k/v "
            f"split, which only Muon uses)."
        )
    return layout.partition_dim >= 0 and group_size(tp_group) > 1


def gather_whole_matrix(local: torch.Tensor, layout: MatrixLayout, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The TP=1 matrix of which `local` is this rank's shard (every TP rank must call this)."""
    if not _is_sharded(layout, tp_group):
        return local
    blocks = []
    for block in ([local] if _in_tp1_order(layout) else split_blocks(local, layout)):
        shards = [torch.empty_like(block) for _ in range(group_size(tp_group))]
        dist.all_gather(shards, block.contiguous(), group=tp_group)
        blocks.append(torch.cat(shards, dim=layout.partition_dim))
    return torch.cat(blocks, dim=0)


def local_part(whole: torch.Tensor, layout: MatrixLayout, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's shard of a TP=1 matrix (the inverse of `gather_whole_matrix`)."""
    if not _is_sharded(layout, tp_group):
        return whole
    size, rank = group_size(tp_group), group_rank(tp_group)
    if _in_tp1_order(layout):
        return whole.chunk(size, dim=layout.partition_dim)[rank]
    rows = [block_rows for block_rows, _ in layout.global_block_shapes()]
    blocks = whole.split(rows, dim=0)
    return torch.cat([block.chunk(size, dim=layout.partition_dim)[rank] for block in blocks], dim=0)


def gather_cut_matrices(updates: list[torch.Tensor], layouts: list[MatrixLayout], tp_modes: Sequence[str],
                        tp_group: Optional[dist.ProcessGroup]) -> tuple[list[torch.Tensor], list[MatrixLayout], list[bool]]:
    """Every layout whose TP shard cuts through its blocks (`cut_by_tp`), made splittable.

    In 'blockwise' the shard becomes a matrix of its own, split where the blocks cut it (no
    communication, as 'blockwise' promises). In the exact modes the whole matrix replaces it, all
    of them all-gathered in one collective; replicated, every mode then orthogonalizes its blocks
    at their global shape. Returns the updates, their layouts, and which results to cut back to
    this rank's rows (`keep_local_rows`). Every rank of `tp_group` must call this alike.
    """
    cut = [layout.cut_by_tp and mode != "blockwise" for layout, mode in zip(layouts, tp_modes)]
    gather = [k for k, is_cut in enumerate(cut) if is_cut]
    updates, layouts = list(updates), list(layouts)
    if gather:
        flat = torch.cat([updates[k].float().reshape(-1) for k in gather])
        buffers = [torch.empty_like(flat) for _ in range(group_size(tp_group))]
        dist.all_gather(buffers, flat, group=tp_group)
        offset = 0
        for k in gather:
            shard = updates[k]
            pieces = [buffer[offset:offset + shard.numel()].view(shard.shape) for buffer in buffers]
            updates[k] = torch.cat(pieces, dim=0).to(shard.dtype)
            layouts[k] = whole_layout(layouts[k])
            offset += shard.numel()
    for k, layout in enumerate(layouts):
        if layout.cut_by_tp:  # 'blockwise'
            layouts[k] = shard_layout(layout, group_rank(tp_group))
    return updates, layouts, cut


def keep_local_rows(results: list[torch.Tensor], cut: list[bool],
                    tp_group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """This rank's rows of each whole result that `gather_cut_matrices` gathered."""
    size, rank = group_size(tp_group), group_rank(tp_group)
    return [result.chunk(size, dim=0)[rank] if is_cut else result for result, is_cut in zip(results, cut)]
