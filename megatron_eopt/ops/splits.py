"""Where a tensor-parallel shard sits in its global matrix, and how fused weights split.

A 2-D weight's local shard is `num_row_groups` repetitions of row blocks of sizes
`row_blocks`; block j, taken from every row group, is one matrix to orthogonalize.
- plain weight:                  1 group,  blocks (rows,)
- linear_qkv (grouped-query):    query groups on this rank, blocks (q[, gate], k, v) per group,
  q = heads_per_group * kv_channels; each TP rank holds whole query groups
- linear_fc1 with a gated linear unit: 1 group, blocks (gate_r, up_r): megatron-core builds it
  with partition_stride=2, so rank r holds [gate_r; up_r] and the global matrix is
  [gate_all; up_all]
- linear_qkv split per head (`head_rows` = kv_channels): every head_rows consecutive rows (one
  q, gate, k or v head) are a matrix of their own, whole on this rank
Pure functions; no communication, no megatron-core import.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MatrixLayout:
    """How one 2-D parameter's local shard maps to the matrices Muon orthogonalizes."""

    name: str  # the parameter's fqn, for error messages
    local_shape: tuple[int, int]
    partition_dim: int = -1  # 0: rows sharded (column-parallel), 1: columns (row-parallel), -1: none
    tp_size: int = 1
    num_row_groups: int = 1
    row_blocks: tuple[int, ...] = ()  # empty: one block of all rows
    head_rows: int = 0  # > 0: each head_rows consecutive rows are one matrix (per-head split)

    def __post_init__(self) -> None:
        rows, _ = self.local_shape
        blocks = self.row_blocks or (rows,)
        if self.partition_dim not in (-1, 0, 1):
            raise ValueError(f"parameter {self.name!r}: partition_dim must be -1, 0 or 1; got {self.partition_dim}.")
        if self.num_row_groups * sum(blocks) != rows:
            raise ValueError(
                f"parameter {self.name!r}: {rows} rows on this TP rank is not "
                f"{self.num_row_groups} group(s) of the split total {sum(blocks)} "
                f"({'+'.join(map(str, blocks))})."
            )
        if self.row_blocks and self.partition_dim == 1:
            raise ValueError(
                f"parameter {self.name!r}: fused row blocks on a row-parallel (partition_dim=1) "
                f"shard are not a megatron-core layout."
            )
        if self.head_rows:
            self._check_head_rows()

    def _check_head_rows(self) -> None:
        if self.head_rows < 0 or any(block % self.head_rows for block in self.blocks):
            raise ValueError(
                f"parameter {self.name!r}: head_rows={self.head_rows} must be > 0 and divide every "
                f"row block ({'+'.join(map(str, self.blocks))}) for a per-head split."
            )
        if self.partition_dim == 1:
            raise ValueError(
                f"parameter {self.name!r}: a per-head split of a row-parallel (partition_dim=1) "
                f"shard is not a megatron-core layout."
            )

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.row_blocks or (self.local_shape[0],)

    @property
    def per_head(self) -> bool:
        """Whether every block matrix is one head, held whole by this rank (never sharded)."""
        return self.head_rows > 0

    def global_block_shapes(self) -> list[tuple[int, int]]:
        """(rows, cols) of each block matrix in the unsharded model."""
        if self.per_head:  # column-parallel or replicated: the columns are whole
            return [(self.head_rows, self.local_shape[1])] * (self.local_shape[0] // self.head_rows)
        rows_factor = self.tp_size if self.partition_dim == 0 else 1
        cols = self.local_shape[1] * (self.tp_size if self.partition_dim == 1 else 1)
        return [(self.num_row_groups * block * rows_factor, cols) for block in self.blocks]


def split_blocks(x: torch.Tensor, layout: MatrixLayout) -> list[torch.Tensor]:
    """The local part of every block matrix (rows of one block from all row groups; per head:
    each head's rows, in row order)."""
    if layout.per_head:
        return list(x.reshape(-1, layout.head_rows, x.shape[1]).unbind(0))
    if len(layout.blocks) == 1:
        return [x]
    grouped = x.reshape(layout.num_row_groups, sum(layout.blocks), x.shape[1])
    return [part.reshape(-1, x.shape[1]) for part in grouped.split(list(layout.blocks), dim=1)]


def merge_blocks(parts: list[torch.Tensor], layout: MatrixLayout) -> torch.Tensor:
    """Inverse of `split_blocks`."""
    if len(parts) == 1:
        return parts[0]
    if layout.per_head:
        return torch.cat(parts, dim=0)
    cols = parts[0].shape[1]
    grouped = [p.reshape(layout.num_row_groups, -1, cols) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, cols)


def qkv_row_blocks(model_config: Any, tp_size: int, name: str) -> tuple[int, tuple[int, ...]]:
    """(query groups on this rank, (q[, gate], k, v) rows per group) from a TransformerConfig.

    The order is megatron-core's `get_query_key_value_tensors`: with an output gate each group
    holds its query rows, then the gate rows (as many as the query's), then key and value.
    """
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups or heads
    kv_channels = model_config.kv_channels or model_config.hidden_size // heads
    if heads % groups or groups % tp_size:
        raise ValueError(
            f"parameter {name!r}: {heads} heads in {groups} query groups over TP={tp_size} is not "
            f"a layout this library splits (heads must divide into groups, groups over TP ranks)."
        )
    q_rows = heads // groups * kv_channels
    gate = (q_rows,) if getattr(model_config, "attention_output_gate", False) else ()
    blocks = (q_rows, *gate, kv_channels, kv_channels)
    return groups // tp_size, blocks


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Relative cost of orthogonalizing a rows x cols matrix: max(m, n) * min(m, n)^2."""
    return max(rows, cols) * min(rows, cols) ** 2
