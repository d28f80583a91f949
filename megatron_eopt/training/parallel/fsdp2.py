"""Megatron-LM's --use-torch-fsdp2 layout: fully_shard per transformer layer over the data-parallel ranks."""

import itertools
from typing import Any

import torch


def fully_shard_gpt(model: torch.nn.Module, dp_group, device: torch.device, bf16_compute: bool = False,
                    expert_dp_group=None) -> None:
    """Megatron-LM's --use-torch-fsdp2 layout: each transformer layer, then the root, sharded with
    fully_shard over the data-parallel ranks (a 1-D mesh, FSDP2's default Shard(0) placement).
    With TP > 1 each TP rank shards its TP shards over its own data-parallel group; the optimizer
    takes the TP group from parallel_state. `bf16_compute` (--bf16): the fp32 shards are cast to
    bf16 for forward and backward, and gradients reduce-scattered in fp32 (torch's
    MixedPrecisionPolicy), so the optimizer steps fp32 shards: fp32 main weights without copies.
    `expert_dp_group` (EP > 1): each MoE layer's routed experts (this EP rank's) first, over the
    expert-data-parallel ranks, a mesh of their own; their gradients summed there and divided by the
    data-parallel size, as megatron-core's DDP scales expert gradients (the dispatcher already
    summed the other EP ranks' tokens into them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = data_parallel_mesh(dp_group, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    expert_mesh = None if expert_dp_group is None else data_parallel_mesh(expert_dp_group, device)
    # fully_shard replaces the parameters, dropping megatron's attributes; the trainer's sum of
    # the sequence-parallel gradients over TP reads this one, so it is put back.
    sequence_parallel = {name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if expert_mesh is not None and experts is not None:
            fully_shard(experts, mesh=expert_mesh, **kwargs)
            experts.set_gradient_divide_factor(float(torch.distributed.get_world_size(dp_group)))
            experts.set_force_sum_reduction_for_comms(True)  # a sum, then the division: gloo has no PREMUL_SUM
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    for name, param in model.named_parameters():
        if name in sequence_parallel:
            param.sequence_parallel = True


_MESH_NUMBERS = itertools.count()


def data_parallel_mesh(dp_group, device: torch.device) -> Any:
    """A 1-D DeviceMesh over `dp_group`, named anew on every call. torch caches meshes that compare
    equal (same ranks, device and names), and `main` may run several times in one process, each
    time with new process groups: an unnamed mesh of an earlier run, whose groups are destroyed,
    would come back."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dp_group, device.type, mesh_dim_names=(f"dp{next(_MESH_NUMBERS)}",))
