"""Where a tensor-parallel shard sits in its global matrix, and how fused weights split.

A 2-D weight's local shard is `num_row_groups` repetitions of row blocks of sizes
`row_blocks`; block j, taken from every row group, is one matrix to orthogonalize.
- plain weight: 1 group, blocks (rows,)
- linear_qkv: query groups on this rank, blocks (q[, gate], k, v) per group; per head with
  `head_rows` = kv_channels (every head_rows rows one matrix, whole on this rank)
- parts each sharded over TP (fc1's gate/up with partition_stride=2, Mamba's and gated delta
  net's in_proj): 1 group, one block per part, of its rows on this rank
- `per_group`: every block of every row group is a matrix, whole on this rank (MLA's heads)
- `tp_contiguous`: `row_blocks` split the global rows, TP shards the matrix as one and a shard
  may cut a part (MLA's column-parallel linear_kv_down_proj): split only when whole
- `batch`: an N-D tensor of matrices (MoE experts), their rows stacked, one row group each; or
  one matrix stored transposed (a `Conv1D` [in, out]): its row blocks are stored columns
params/fused_layouts.py says which weight has which layout. Pure functions; no communication.
"""

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class MatrixBatch:
    """An N-D tensor that holds one matrix per index of its leading dimensions (MoE experts as
    `transformers` 5 and torchtitan store them), and how each matrix is read as [out, in] rows.

    `transposed`: each matrix is stored [in, out] (transformers' `is_transposed` experts), so its
    rows are the stored columns; Newton-Schulz of the transpose is the transpose of Newton-Schulz,
    and the transposed view keeps the [out, in] convention that the scale modes and the row
    blocks (gate/up) assume. `interleaved_parts` > 1: the parts' rows alternate (gate0, up0,
    gate1, ...), regrouped part by part so that each part is a contiguous row block.

    A 2-D `transposed` shape is one matrix without a leading index (`single`): a `Conv1D` weight
    stored [in, out], whose q, k and v are column blocks of the storage, row blocks of the view.
    """

    shape: tuple[int, ...]  # the tensor's shape on this rank
    transposed: bool = False
    interleaved_parts: int = 1

    def __post_init__(self) -> None:
        rows = self.matrix_rows
        dims = len(self.shape)
        if dims < 2 or (dims == 2 and not self.transposed) or self.interleaved_parts < 1 \
                or rows % self.interleaved_parts:
            raise ValueError(f"a batch of matrices needs >= 3 dimensions (2: one matrix stored transposed) and rows "
                             f"that divide into {self.interleaved_parts} interleaved parts; got shape {self.shape}, "
                             f"transposed={self.transposed}.")

    @property
    def single(self) -> bool:
        """One matrix stored transposed, no leading index: FSDP2's Shard(0) splits its stored rows
        (the view's columns), so it is transposed only where it is whole."""
        return len(self.shape) == 2

    @property
    def count(self) -> int:
        """How many matrices: the product of the leading dimensions."""
        return math.prod(self.shape[:-2])

    @property
    def matrix_rows(self) -> int:
        return self.shape[-1] if self.transposed else self.shape[-2]

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D view's shape: every matrix's rows stacked."""
        cols = self.shape[-2] if self.transposed else self.shape[-1]
        return self.count * self.matrix_rows, cols

    def with_leading(self, leading: int) -> "MatrixBatch":
        """The same batch with `leading` indices in dimension 0 (an FSDP2 shard's experts)."""
        if self.single:
            raise ValueError(f"one matrix stored transposed (shape {self.shape}) has no leading index to split; "
                             f"FSDP2 splits its stored rows, which go to one owner whole (ops/row_shards.py).")
        return replace(self, shape=(leading, *self.shape[1:]))

    def to_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The 2-D view of `tensor` (shaped as this batch): its matrices' rows, matrix by matrix."""
        matrices = tensor.transpose(-1, -2) if self.transposed else tensor
        rows, cols = matrices.shape[-2:]
        matrices = matrices.reshape(-1, rows, cols)
        if self.interleaved_parts > 1:
            parts = self.interleaved_parts
            matrices = matrices.reshape(-1, rows // parts, parts, cols).transpose(1, 2)
        return matrices.reshape(-1, cols)

    def from_rows(self, rows_2d: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_rows`: the tensor, shaped as this batch, whose 2-D view is `rows_2d`."""
        rows, cols = self.matrix_rows, rows_2d.shape[1]
        matrices = rows_2d.reshape(-1, rows, cols)
        if self.interleaved_parts > 1:
            parts = self.interleaved_parts
            matrices = matrices.reshape(-1, parts, rows // parts, cols).transpose(1, 2).reshape(-1, rows, cols)
        leading = self.shape[:-2]
        matrices = matrices.reshape(*leading, rows, cols)
        return (matrices.transpose(-1, -2) if self.transposed else matrices).contiguous()


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
    per_group: bool = False  # every block of every row group is one matrix, whole on this rank
    tp_contiguous: bool = False  # row_blocks split the global rows; TP shards the matrix as one
    batch: Optional[MatrixBatch] = None  # an N-D tensor of matrices; `local_shape` is its 2-D view

    def __post_init__(self) -> None:
        rows, _ = self.local_shape
        if self.batch is not None:
            self._check_batch()
        blocks = self.row_blocks or (rows,)
        if self.partition_dim not in (-1, 0, 1):
            raise ValueError(f"parameter {self.name!r}: partition_dim must be -1, 0 or 1; got {self.partition_dim}.")
        if self.tp_contiguous:
            self._check_tp_contiguous()
        elif self.num_row_groups * sum(blocks) != rows:
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
        if self.per_group and (self.partition_dim == 1 or self.head_rows or self.tp_contiguous):
            raise ValueError(
                f"parameter {self.name!r}: per_group splits whole row groups of a column-parallel or "
                f"replicated shard, without head_rows or tp_contiguous."
            )

    def _check_batch(self) -> None:
        if (self.local_shape != self.batch.matrix_shape or not self.per_group or self.partition_dim != -1
                or self.num_row_groups != self.batch.count):
            raise ValueError(
                f"parameter {self.name!r}: a batch of {self.batch.count} matrices (shape {self.batch.shape}) "
                f"takes a per_group layout of one row group per matrix over its 2-D view "
                f"{self.batch.matrix_shape}, without tensor parallelism; got local_shape {self.local_shape}, "
                f"{self.num_row_groups} row groups, per_group={self.per_group}, partition_dim={self.partition_dim}."
            )

    def _check_tp_contiguous(self) -> None:
        rows = self.local_shape[0] * (self.tp_size if self.partition_dim == 0 else 1)
        if self.num_row_groups != 1 or self.partition_dim == 1 or self.head_rows or sum(self.row_blocks) != rows:
            raise ValueError(
                f"parameter {self.name!r}: tp_contiguous needs 1 row group, no head_rows, no row-parallel "
                f"shard and row blocks that sum to the global rows ({rows}); got {self.num_row_groups} "
                f"group(s), partition_dim={self.partition_dim}, blocks {'+'.join(map(str, self.row_blocks))}."
            )

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
        """Whether every block matrix is one head (or row group), held whole by this rank."""
        return self.head_rows > 0 or self.per_group

    @property
    def cut_by_tp(self) -> bool:
        """Whether a TP shard may cut through a block: the matrix must be whole to be split."""
        return self.tp_contiguous and self.partition_dim == 0 and self.tp_size > 1

    def global_block_shapes(self) -> list[tuple[int, int]]:
        """(rows, cols) of each block matrix in the unsharded model."""
        if self.head_rows:  # column-parallel or replicated: the columns are whole
            return [(self.head_rows, self.local_shape[1])] * (self.local_shape[0] // self.head_rows)
        if self.per_group:
            return [(block, self.local_shape[1]) for block in self.blocks] * self.num_row_groups
        if self.tp_contiguous:
            return [(block, self.local_shape[1]) for block in self.blocks]
        rows_factor = self.tp_size if self.partition_dim == 0 else 1
        cols = self.local_shape[1] * (self.tp_size if self.partition_dim == 1 else 1)
        return [(self.num_row_groups * block * rows_factor, cols) for block in self.blocks]


def local_batch_layout(layout: MatrixLayout, local_shape: tuple[int, ...]) -> MatrixLayout:
    """The layout of this rank's part of a batch `layout` whose dimension 0 is split (FSDP2's
    Shard(0) of experts: each rank holds whole matrices, possibly none)."""
    batch = layout.batch.with_leading(local_shape[0])
    return replace(layout, local_shape=batch.matrix_shape, num_row_groups=batch.count, batch=batch)


def stored_shape(layout: MatrixLayout) -> tuple[int, int]:
    """The 2-D shape whose rows FSDP2's Shard(0) splits: a single transposed matrix's storage
    [in, out]; else the layout's matrix."""
    return layout.batch.shape if is_single_transposed(layout) else layout.local_shape


def is_single_transposed(layout: MatrixLayout) -> bool:
    """Whether `layout` is one matrix stored transposed (MatrixBatch.single)."""
    return layout.batch is not None and layout.batch.single


def as_matrix(x: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """The 2-D matrix that `layout` describes: `x` itself, or a batch's 2-D view."""
    return x if layout.batch is None else layout.batch.to_rows(x)


def as_tensor(matrix: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """Inverse of `as_matrix`."""
    return matrix if layout.batch is None else layout.batch.from_rows(matrix)


def split_blocks(x: torch.Tensor, layout: MatrixLayout) -> list[torch.Tensor]:
    """The local part of every block matrix (rows of one block from all row groups; per head:
    each head's rows, in row order)."""
    if layout.cut_by_tp:
        raise ValueError(f"parameter {layout.name!r}: its TP shard cuts through its blocks; split the whole "
                         f"matrix (ops/whole_matrix.py: gather_cut_matrices).")
    if layout.head_rows:
        return list(x.reshape(-1, layout.head_rows, x.shape[1]).unbind(0))
    if layout.per_group:
        groups = x.reshape(layout.num_row_groups, sum(layout.blocks), x.shape[1])
        return [part for group in groups for part in group.split(list(layout.blocks), dim=0)]
    if len(layout.blocks) == 1:
        return [x]
    grouped = x.reshape(layout.num_row_groups, sum(layout.blocks), x.shape[1])
    return [part.reshape(-1, x.shape[1]) for part in grouped.split(list(layout.blocks), dim=1)]


def merge_blocks(parts: list[torch.Tensor], layout: MatrixLayout) -> torch.Tensor:
    """Inverse of `split_blocks`."""
    if len(parts) == 1:
        return parts[0]
    if layout.per_head or layout.tp_contiguous:  # blocks in row order
        return torch.cat(parts, dim=0)
    cols = parts[0].shape[1]
    grouped = [p.reshape(layout.num_row_groups, -1, cols) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, cols)


def whole_layout(layout: MatrixLayout) -> MatrixLayout:
    """The layout of the whole (TP-gathered) matrix of a `tp_contiguous` layout: replicated."""
    rows = sum(layout.blocks)
    return MatrixLayout(layout.name, (rows, layout.local_shape[1]), row_blocks=layout.row_blocks)


def shard_layout(layout: MatrixLayout, tp_rank: int) -> MatrixLayout:
    """A `tp_contiguous` shard as a matrix of its own, split where the global blocks cut it
    (its parts of those blocks); replicated, so it is scaled by its own shape ('blockwise')."""
    rows = layout.local_shape[0]
    start, end, parts, offset = tp_rank * rows, (tp_rank + 1) * rows, [], 0
    for block in layout.blocks:
        overlap = min(end, offset + block) - max(start, offset)
        if overlap > 0:
            parts.append(overlap)
        offset += block
    return MatrixLayout(layout.name, layout.local_shape, row_blocks=tuple(parts))


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


def tensor_parallel_rank_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of this TP rank's part of `param`: the matrix its TP layout and Muon see.

    A DTensor on Megatron-FSDP's 2-D (data parallel, tensor parallel) mesh is shaped as the TP
    ranks' parts joined: `Shard(d)` on the mesh's second dimension divides dim d by its size
    (`Replicate()` there: every TP rank holds all of it). Plain tensors and DTensors on a 1-D mesh
    (torch FSDP2, where each TP rank shards its own part) have their own shape.
    """
    shape = list(param.shape)
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and mesh.ndim == 2:
        tp_placement = param.placements[1]
        if tp_placement.is_shard():
            shape[tp_placement.dim] //= mesh.size(1)
    return tuple(shape)
