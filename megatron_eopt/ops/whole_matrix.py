"""A tensor-parallel shard's whole matrix, and back: for optimizers whose update is a function
of the whole matrix (PolarGrad's nuclear norm, MOP's SVD, Scion's Newton-Schulz).

The whole matrix is the parameter's TP=1 value: each block of the shard (one block, or the
gate and up halves of a gated `linear_fc1`, built with partition_stride=2) is all-gathered along
`partition_dim` and the blocks are stacked. A fused `linear_qkv` is one block here (each rank
holds whole query groups, so its shards concatenate to the TP=1 row order); layouts that split
q/k/v (`num_row_groups` > 1) belong to Muon and are refused.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout, split_blocks
from megatron_eopt.runtime.process_groups import group_rank, group_size


def _is_sharded(layout: MatrixLayout, tp_group: Optional[dist.ProcessGroup]) -> bool:
    split = layout.num_row_groups != 1 or layout.per_head
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
    for block in split_blocks(local, layout):
        shards = [torch.empty_like(block) for _ in range(group_size(tp_group))]
        dist.all_gather(shards, block.contiguous(), group=tp_group)
        blocks.append(torch.cat(shards, dim=layout.partition_dim))
    return torch.cat(blocks, dim=0)


def local_part(whole: torch.Tensor, layout: MatrixLayout, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's shard of a TP=1 matrix (the inverse of `gather_whole_matrix`)."""
    if not _is_sharded(layout, tp_group):
        return whole
    size, rank = group_size(tp_group), group_rank(tp_group)
    rows = [block_rows for block_rows, _ in layout.global_block_shapes()]
    blocks = whole.split(rows, dim=0)
    return torch.cat([block.chunk(size, dim=layout.partition_dim)[rank] for block in blocks], dim=0)
