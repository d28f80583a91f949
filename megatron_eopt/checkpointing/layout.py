"""Where a rank's tensor sits in the global (unsharded) tensor a checkpoint stores.

A checkpoint stores every parameter, fp32 main copy and parameter-shaped optimizer state in
the shape it has at TP=1, under the parameter's name, so any layout can read any part of it.
A tensor-parallel shard is saved as a DTensor shard of that global tensor: each rank writes
its own piece and torch.distributed.checkpoint records the offsets. A weight built with
`partition_stride=k` (megatron-core's gated `linear_fc1`: rank r holds [gate_r; up_r]) is
stored as k global tensors `<key>#part<i>` (all gates, all ups), which is what TP=1 holds too.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megatron_eopt.distributed.process_groups import ProcessGroup, group_rank, group_size

PART_MARK = "#part"
TP_MARK = "@tp"


@dataclass(frozen=True)
class Placement:
    """How this rank's copy of a parameter maps to the global tensor(s) in a checkpoint."""

    group: Optional[ProcessGroup] = None  # the tensor-parallel group when sharded over > 1 rank
    partition_dim: int = -1  # megatron-core's partition_dim; -1: the same on every TP rank
    parts: int = 1  # partition_stride: interleaved blocks along partition_dim

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
        if self.partition_dim >= 0:
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


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
