"""Where a rank's tensor sits in the global (unsharded) tensor a checkpoint stores.

Every parameter, fp32 main copy and parameter-shaped optimizer state is stored in its TP=1
shape under the parameter's name, so any layout can read any part of it.
- A tensor-parallel shard is saved as a DTensor shard of that global tensor.
- A weight built with `partition_stride=k` (a gated `linear_fc1`: rank r holds [gate_r; up_r])
  is stored as k global tensors `<key>#part<i>`, which is what TP=1 holds too.
- A torch FSDP2 parameter (rows `torch.chunk(rows, N)[r]`, possibly none) and its state are
  written as pieces of the same global tensors with explicit offsets, cut where the
  `#part<i>` tensors meet: a ShardedTensor. Nothing is gathered.
- With TP x FSDP2 the offsets add this TP shard's place along megatron-core's partition_dim.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megatron_eopt.placement.fully_sharded_layout import check_row_placement
from megatron_eopt.runtime.process_groups import ProcessGroup, group_rank, group_size

PART_MARK = "#part"
TP_MARK = "@tp"


@dataclass(frozen=True)
class TensorParallelRows:
    """TP x FSDP2: which TP shard of the global tensor a row-sharded Placement's rows split."""

    partition_dim: int  # megatron-core's: where the TP shards meet in the global tensor
    tp_rank: int
    ranks: tuple[tuple[int, ...], ...]  # global rank of (TP rank t, DP rank d): ranks[t][d]
    group: ProcessGroup  # holds all of `ranks` (the checkpoint's); ShardedTensor checks against it

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Placement:
    """How this rank's copy of a parameter maps to the global tensor(s) in a checkpoint."""

    group: Optional[ProcessGroup] = None  # the tensor-parallel group when sharded over > 1 rank
    partition_dim: int = -1  # megatron-core's partition_dim; -1: the same on every TP rank
    parts: int = 1  # partition_stride: interleaved blocks along partition_dim
    rows_by_rank: Optional[tuple[int, ...]] = None  # FSDP2's Shard(0): rows each rank of `group` holds
    tp_rows: Optional[TensorParallelRows] = None  # TP x FSDP2: the TP shard those rows split

    @property
    def is_row_sharded(self) -> bool:
        return self.rows_by_rank is not None

    @property
    def is_sharded(self) -> bool:
        return self.group is not None

    @property
    def tp_size(self) -> int:
        return group_size(self.group)

    def keys(self, key: str) -> list[str]:
        """The checkpoint keys of a tensor with this placement."""
        return [f"{key}{PART_MARK}{i}" for i in range(self.parts)] if self.parts > 1 else [key]

    def global_part_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        """Shape of each stored global tensor of a local tensor of `local_shape`."""
        shape = list(local_shape)
        if self.is_row_sharded:  # uneven FSDP2 shards: the global rows, not local x size
            shape[0] = sum(self.rows_by_rank) // self.parts
            if self.tp_rows is not None:
                shape[self.tp_rows.partition_dim] *= self.tp_rows.tp_size
        elif self.partition_dim >= 0:
            shape[self.partition_dim] = shape[self.partition_dim] // self.parts * self.tp_size
        return tuple(shape)

    def tp_specific_key(self, key: str) -> str:
        """Key of state that cannot be resharded (not parameter-shaped) of a TP-partitioned param."""
        return f"{key}{TP_MARK}{group_rank(self.group)}of{self.tp_size}"


def placement_of(param: torch.nn.Parameter, tp_group: Optional[ProcessGroup]) -> Placement:
    """The Placement megatron-core's tensor-parallel attributes describe."""
    if not getattr(param, "tensor_model_parallel", False):
        return Placement()
    partition_dim = int(getattr(param, "partition_dim", -1))
    parts = int(getattr(param, "partition_stride", 1)) if partition_dim >= 0 else 1
    group = tp_group if group_size(tp_group) > 1 and partition_dim >= 0 else None
    return Placement(group, partition_dim, max(parts, 1))


def row_placement(fqn: str, param: DTensor, parts: int, rows_by_rank: tuple[int, ...],
                  tp_rows: Optional[TensorParallelRows] = None) -> Placement:
    """The Placement of a torch FSDP2 or Megatron-FSDP parameter: Shard(0) on a 1-D mesh, the only
    layout handled.

    `parts`: the partition_stride megatron-core gives the unsharded parameter (fully_shard drops it).
    `rows_by_rank`: the rows each rank of the mesh holds, as gathered (ops/row_shards.gathered_rows).
    `tp_rows`: for a tensor-parallel shard (TP x FSDP2), where it sits in the global tensor.
    """
    if not check_row_placement(fqn, param):
        raise ValueError(
            f"parameter {fqn!r}: checkpoints of DTensor placement {tuple(param.placements)} are not supported by "
            f"save_checkpoint, which stores Shard(0) on a 1-D mesh; save the optimizer's state_dict() with torch "
            f"DCP instead (its state is placed like the parameters; torchtitan's checkpointer does this).")
    group = param.device_mesh.get_group()
    if group_size(group) == 1:
        return Placement(None, 0, parts, rows_by_rank=(param.shape[0],), tp_rows=tp_rows)
    return Placement(group, 0, parts, rows_by_rank=rows_by_rank, tp_rows=tp_rows)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: a DTensor's local shard, else the tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


class MeshCache:
    """One 1-D DeviceMesh per tensor-parallel group (DTensor needs a mesh, building one is local)."""

    def __init__(self) -> None:
        self._meshes: dict[tuple[int, str], DeviceMesh] = {}

    def mesh(self, group: ProcessGroup, device_type: str) -> DeviceMesh:
        key = (id(group), device_type)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(group, device_type)
        return self._meshes[key]


def global_pieces(key: str, local: torch.Tensor, placement: Placement, meshes: MeshCache) -> dict[str, torch.Tensor]:
    """Checkpoint entries for `local`: views of it, as DTensor shards when it is sharded.

    Used for saving and, over freshly allocated buffers, for loading: torch.distributed.checkpoint
    then reads exactly this rank's piece of each global tensor into the buffer.
    """
    if placement.is_row_sharded and (placement.is_sharded or placement.tp_rows is not None):
        return _row_pieces(key, local, placement)
    chunks = local.chunk(placement.parts, dim=placement.partition_dim) if placement.parts > 1 else [local]
    entries = {}
    for part_key, chunk in zip(placement.keys(key), chunks):
        if not placement.is_sharded:
            entries[part_key] = chunk
            continue
        shape = placement.global_part_shape(local.shape)
        mesh = meshes.mesh(placement.group, local.device.type)
        entries[part_key] = DTensor.from_local(
            chunk, mesh, [Shard(placement.partition_dim)], run_check=False,
            shape=torch.Size(shape), stride=_contiguous_stride(shape),
        )
    return entries


def _row_pieces(key: str, local: torch.Tensor, placement: Placement) -> dict[str, ShardedTensor]:
    """This rank's rows of each `#part<i>` global tensor, with every rank's offsets (no collective)."""
    part_rows = sum(placement.rows_by_rank) // placement.parts
    rest = list(local.shape[1:])
    tp = placement.tp_rows
    ranks = tp.ranks if tp is not None else (tuple(_global_ranks(placement.group, len(placement.rows_by_rank))),)
    me = (tp.tp_rank if tp is not None else 0, group_rank(placement.group))
    global_shape = placement.global_part_shape(local.shape)
    entries = {}
    for index, part_key in enumerate(placement.keys(key)):
        shards, local_shards = [], []
        for t, dp_ranks in enumerate(ranks):
            for d, (first, stop, offsets) in enumerate(_part_rows(placement, index, part_rows, t, rest)):
                if stop <= first:  # this rank holds none of this part's rows
                    continue
                metadata = ShardMetadata(offsets, [stop - first, *rest], f"rank:{dp_ranks[d]}/{local.device}")
                shards.append(metadata)
                if (t, d) == me:
                    start = sum(placement.rows_by_rank[:d])
                    local_shards.append(LocalShard(local[first - start:stop - start], metadata))
        global_metadata = ShardedTensorMetadata(shards, torch.Size(global_shape), TensorProperties(dtype=local.dtype))
        entries[part_key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, global_metadata, process_group=tp.group if tp is not None else placement.group)
    return entries


def _part_rows(placement: Placement, index: int, part_rows: int, tp_rank: int,
               rest: list[int]) -> list[tuple[int, int, list[int]]]:
    """Per DP rank: (first, stop) of its rows of part `index` in the rows FSDP2 splits, and the
    global offsets of that piece (TP rank `tp_rank`'s shard placed along its partition_dim)."""
    low, high = index * part_rows, (index + 1) * part_rows
    pieces, start = [], 0
    for rows in placement.rows_by_rank:
        first, stop = max(start, low), min(start + rows, high)
        offsets = [first - low] + [0] * len(rest)
        if placement.tp_rows is not None:
            dim = placement.tp_rows.partition_dim
            offsets[dim] += tp_rank * (part_rows if dim == 0 else rest[dim - 1])
        pieces.append((first, stop, offsets))
        start += rows
    return pieces


def _global_ranks(group: Optional[ProcessGroup], size: int) -> list[int]:
    return [dist.get_rank()] if group is None else [dist.get_global_rank(group, r) for r in range(size)]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
