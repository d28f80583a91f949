"""Whole-matrix functions of DTensor parameters whose placements the row-shard exchange
(ops/row_shards.py) does not take: torchtitan's tensor parallelism, alone or with FSDP2, gives
`(_StridedShard(0), Shard(0))` (column-parallel), `(Shard(0), Shard(1))` (row-parallel) and
`(Shard(0), Replicate())` (norms) on its 2-D (fsdp, tp) mesh; any Shard, _StridedShard or
Replicate on any mesh is taken here.

Each rank holds the DTensor's local tensor (and its elementwise optimizer state, shaped alike).
For the update, the local parts are gathered to the whole matrix over the parameter's own mesh
(DTensor's `full_tensor`), every rank orthogonalizes it with the same per-block code as one
process, and keeps its own part (DTensor's split, no communication): the update of one process,
computed on every rank of the mesh.
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from megatron_eopt.ops.splits import MatrixLayout


@dataclass(frozen=True)
class PlacedMatrix:
    """Where one parameter's whole matrix lies: its DTensor mesh and placements."""

    layout: MatrixLayout  # of the whole matrix (its global shape and fused blocks)
    mesh: Any  # torch DeviceMesh
    placements: tuple  # one per mesh dimension: Shard, _StridedShard or Replicate
    shape: torch.Size  # global
    local_shape: torch.Size  # this rank's part

    @classmethod
    def of(cls, param: DTensor, layout: MatrixLayout) -> "PlacedMatrix":
        return cls(layout, param.device_mesh, tuple(param.placements), param.shape, param.to_local().shape)


def whole_tensor(local: torch.Tensor, placed: PlacedMatrix) -> torch.Tensor:
    """The whole tensor of which `local` is this rank's part (a collective over its mesh)."""
    stride = torch.empty(placed.shape, device="meta").stride()
    tensor = DTensor.from_local(local.detach().contiguous(), placed.mesh, placed.placements, run_check=False,
                                shape=placed.shape, stride=stride)
    return tensor.full_tensor()


def local_part(whole: torch.Tensor, placed: PlacedMatrix) -> torch.Tensor:
    """This rank's part of `whole` as the placements split it (no communication)."""
    return distribute_tensor(whole.detach(), placed.mesh, placed.placements, src_data_rank=None).to_local()


def map_placed(updates: list[torch.Tensor], placed: list[PlacedMatrix],
               compute: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """This rank's part of f(whole tensor i) for every i: `compute(wholes)` runs on every rank of
    each mesh with the same inputs. Every rank of the meshes must call this with the same tensors
    in the same order."""
    wholes = [whole_tensor(u, p) for u, p in zip(updates, placed)]
    results = compute(wholes) if wholes else []
    return [local_part(r.to(u.dtype), p) for r, u, p in zip(results, updates, placed)]


def replicated_mesh_dims(placements: tuple) -> list[int]:
    """The mesh dimensions over which a DTensor is replicated (each rank there holds a copy)."""
    return [dim for dim, placement in enumerate(placements) if isinstance(placement, Replicate)]
