"""Megatron-LM's --use-megatron-fsdp layout: the GPT wrapped by Megatron-FSDP (`fully_shard_model`,
ZeRO-3: 'optim_grads_params'), each transformer layer one FSDP unit, over all ranks (TP = PP = 1).

Megatron-FSDP's step protocol, which the trainer follows: backward, `finish_grad_sync()` (attaches
each rank's gradient shards), the optimizer's step (which ends with
`install_optimized_model_weights()`, as megatron-core's does) and `zero_grad_buffer()`. On CPU its
CUDA-only calls are replaced first (runtime/megatron_fsdp_cpu.py).
"""

import itertools
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_eopt.placement.megatron_fsdp_model import hold_gradient_hooks_weakly, megatron_fsdp_wrappers
from megatron_eopt.runtime import megatron_fsdp_cpu

_MESH_NUMBERS = itertools.count()


def megatron_fsdp_gpt(model: torch.nn.Module, device: torch.device, fp32_grads: bool = True,
                      expert_parallel_size: int = 1, dp_tp_groups: Optional[tuple[Any, Any]] = None) -> torch.nn.Module:
    """`model` wrapped by Megatron-FSDP over every rank (ZeRO-3), each TransformerLayer a unit;
    with `expert_parallel_size` > 1 the routed experts over an expert mesh (expert data parallel x
    EP, EP varying fastest as megatron-core's parallel_state orders the ranks at TP = PP = 1).
    `dp_tp_groups` (a model built with tensor parallelism, no experts): the mesh is (data
    parallel, TP) over these groups, TP varying fastest as in parallel_state, as Megatron-LM's
    adapter builds it; its groups are the caller's, who destroys them.

    Megatron-FSDP computes with the model's own dtype (bf16 with --bf16) and keeps fp32 main weights
    beside them, which are the DTensor parameters the optimizer steps (as in Megatron-LM's loop).
    `fp32_grads`: gradients accumulated and reduce-scattered in fp32 (the trainer's
    --accumulate-allreduce-grads-in-fp32), else in the model's dtype."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cpu":
        megatron_fsdp_cpu.install()
    from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model

    # Named anew on every call: torch caches equal meshes, and `main` may run several times in one
    # process with new process groups (training/parallel/fsdp2.py's data_parallel_mesh says more).
    number = next(_MESH_NUMBERS)
    names = (f"megatron_fsdp_dp{number}", f"megatron_fsdp_tp{number}")
    world = dist.get_world_size()
    if dp_tp_groups is None:
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=names)
    else:
        mesh = _dp_tp_mesh(*dp_tp_groups, device, names)
    experts = {}
    if expert_parallel_size > 1 and dp_tp_groups is not None:
        raise ValueError("megatron_fsdp_gpt: experts with tensor parallelism are not built here; use TP=1 with EP.")
    if expert_parallel_size > 1:
        expert_names = (names[0], f"megatron_fsdp_ep{number}", names[1])
        experts = {"expt_device_mesh": init_device_mesh(device.type, (world // expert_parallel_size,
                                                                     expert_parallel_size, 1),
                                                        mesh_dim_names=expert_names)}
    wrapped = fully_shard_model(model, device_mesh=mesh, dp_shard_dim=names[0], tp_dim=names[1], **experts,
                                fsdp_unit_modules=[TransformerLayer], zero_dp_strategy="optim_grads_params",
                                mixed_precision_policy=MixedPrecisionPolicy(
                                    main_params_dtype=torch.float32,
                                    main_grads_dtype=torch.float32 if fp32_grads else None),
                                device=device)
    hold_gradient_hooks_weakly(wrapped)
    return wrapped


def _dp_tp_mesh(dp_group: Any, tp_group: Any, device: torch.device, names: tuple[str, str]) -> Any:
    """The (dp, tp) DeviceMesh of the caller's groups, TP ranks consecutive (parallel_state's order)."""
    from torch.distributed.device_mesh import DeviceMesh

    tp_size, world = dist.get_world_size(tp_group), dist.get_world_size()
    ranks = torch.arange(world).view(world // tp_size, tp_size)
    mine = (ranks == dist.get_rank()).nonzero()[0].tolist()
    if ranks[mine[0]].tolist() != dist.get_process_group_ranks(tp_group) or \
            ranks[:, mine[1]].tolist() != dist.get_process_group_ranks(dp_group):
        raise ValueError(f"the tensor-parallel group {dist.get_process_group_ranks(tp_group)} is not consecutive "
                         f"ranks with the data-parallel group {dist.get_process_group_ranks(dp_group)} across them.")
    return DeviceMesh.from_group([dp_group, tp_group], device.type, mesh=ranks.tolist(), mesh_dim_names=names)


def finish_grad_sync(chunks: list[torch.nn.Module]) -> None:
    """After the step's last backward: Megatron-FSDP's reduce-scatter done, gradient shards attached."""
    for wrapper in megatron_fsdp_wrappers(chunks):
        wrapper.finish_grad_sync()


def zero_grad_buffers(chunks: list[torch.nn.Module]) -> None:
    """After the optimizer's step (which put the stepped shards into Megatron-FSDP's compute
    weights): its gradient buffers zeroed for the next step."""
    for wrapper in megatron_fsdp_wrappers(chunks):
        wrapper.zero_grad_buffer()
