"""Models wrapped by Megatron-FSDP (`MegatronFSDP`, `fully_shard_model`; the `megatron_fsdp` package or
megatron-core's copy of it): what sets them apart from torch FSDP2 for the optimizer.

Both give DTensor parameters with Shard(0) on a 1-D data-parallel mesh, and distributed/fsdp2.py
handles both. Megatron-FSDP differs in these ways, checked or handled here or in
placement/fully_sharded_layout.py:
- its shards follow its flat buckets, not torch.chunk (row splits are gathered, ops/row_shards.py);
- a rank whose shard of a parameter is empty gets no `.grad` from `finish_grad_sync()`;
- it computes with copies of the shards, refreshed after a checkpoint is loaded;
- only its ZeRO-3 strategy ('optim_grads_params') gives sharded DTensor parameters;
- with (expert) TP, the parameters TP splits sit on a 2-D (dp, tp) mesh, shaped as the TP parts
  joined, each TP rank's part split by rows over dp.
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

MEGATRON_FSDP = "Megatron-FSDP"
TORCH_FSDP2 = "torch FSDP2"
# MegatronFSDP's module in the megatron_fsdp package and in megatron-core's copy of it.
MEGATRON_FSDP_CLASSES = ("megatron_fsdp.megatron_fsdp.MegatronFSDP",
                         "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP")
SUPPORTED_STRATEGY = "optim_grads_params"


def _qualified_name(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def megatron_fsdp_wrappers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The MegatronFSDP modules in `chunks` (a chunk itself, or inside megatron-core's adapter)."""
    return [m for chunk in chunks for m in chunk.modules() if _qualified_name(m) in MEGATRON_FSDP_CLASSES]


def sharding_engine(chunks: list[torch.nn.Module]) -> str:
    """Which engine sharded the DTensor parameters of `chunks`, refusing what is not handled."""
    wrappers = megatron_fsdp_wrappers(chunks)
    if not wrappers:
        return TORCH_FSDP2
    for wrapper in wrappers:
        check_sharding_strategy(wrapper.data_parallel_sharding_strategy)
    return MEGATRON_FSDP


def check_sharding_strategy(strategy: str) -> None:
    """Megatron-FSDP's strategies other than ZeRO-3 keep plain parameters and shard the optimizer
    state inside Megatron-FSDP's own buffers, which this optimizer does not read."""
    if strategy != SUPPORTED_STRATEGY:
        raise ValueError(
            f"Megatron-FSDP data_parallel_sharding_strategy={strategy!r} is not supported by megatron_eopt's "
            f"optimizers; use {SUPPORTED_STRATEGY!r} (zero_dp_strategy=3), which shards parameters, gradients "
            f"and optimizer state."
        )


def missing_grad(fqn: str, shard: torch.Tensor) -> torch.Tensor:
    """The gradient of this rank's `shard` of a Megatron-FSDP parameter that has no `.grad`.

    `finish_grad_sync()` attaches a gradient to every non-empty shard and none to an empty one. The
    empty one gets an empty gradient, so that every rank steps, and exchanges, the same matrices.
    A non-empty shard without one means the gradients were not synchronized: stepping it as zero
    would decay it (as Megatron-FSDP's own first optimizer step does), so it is refused.
    """
    if shard.numel() == 0:
        return torch.zeros_like(shard)
    raise ValueError(
        f"parameter {fqn!r} has no gradient on this rank, which holds {tuple(shard.shape)} of it: call "
        f"model.finish_grad_sync() after backward and before optimizer.step() (Megatron-FSDP's step protocol)."
    )


def refresh_compute_weights(chunks: list[torch.nn.Module]) -> None:
    """After parameters were written in place (a checkpoint loaded): Megatron-FSDP computes with its
    model-weight buffers and keeps the parameters of modules outside its units gathered, so copy the
    shards there (`install_optimized_model_weights`) and gather them again (`start_param_sync`)."""
    for wrapper in megatron_fsdp_wrappers(chunks):
        wrapper.install_optimized_model_weights()
        wrapper.start_param_sync(force_sync=True)


def hold_gradient_hooks_weakly(model: torch.nn.Module) -> None:
    """Let a dropped Megatron-FSDP model (the MegatronFSDP modules in `model`) be freed, and with it
    its process groups.

    MegatronFSDP's post-accumulate-grad hooks sit on its own parameters, where autograd keeps them
    in C++ out of the garbage collector's sight, and each reaches the wrapper: a cycle no collection
    breaks, so every model built in a process stays alive with its 20 or more groups. Here each
    parameter keeps a forwarder that holds its hook weakly, and the wrapper keeps the hooks: the
    same calls, in a cycle of Python objects that `gc` frees."""
    for wrapper in megatron_fsdp_wrappers([model]):
        if not hasattr(wrapper, "megatron_eopt_gradient_hooks"):
            _hold_weakly(wrapper)


def _hold_weakly(wrapper: torch.nn.Module) -> None:
    hooks_kept = []
    for handle in wrapper.grad_acc_hooks.values():
        hooks = handle.hooks_dict_ref()
        if hooks is None or handle.id not in hooks:
            continue
        hook = hooks[handle.id]
        hooks_kept.append(hook)
        hooks[handle.id] = functools.partial(_call_while_alive, weakref.ref(hook))
    wrapper.megatron_eopt_gradient_hooks = hooks_kept


def _call_while_alive(hook: "weakref.ref[Callable[..., Any]]", *args: Any) -> Optional[Any]:
    target = hook()
    return None if target is None else target(*args)
