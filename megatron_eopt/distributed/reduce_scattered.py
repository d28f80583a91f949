"""Model chunks whose megatron-core DDP reduce-scatters their gradients: megatron-core's own
DistributedOptimizer steps them.

megatron-core's DistributedDataParallel built with `ddp_config.use_distributed_optimizer=True`
(Megatron-LM's `--use-distributed-optimizer`) reduce-scatters each gradient bucket, so a rank
holds correct gradients only for its byte shard of each bucket. megatron-core's DistributedOptimizer
is the optimizer written for exactly that contract: it keeps the fp32 main copies and the state of
its shard, steps them, and all-gathers the parameters through the DDP's buffers. For an
elementwise optimizer the factory builds that object through megatron-core's own
`get_megatron_optimizer` (adam: it refuses SGD), so its steps, memory and checkpoints (`dp_reshardable`,
`fully_reshardable`, `--ckpt-format torch`) are megatron-core's. Here: which chunks reduce-scatter,
and the refusals (an optimizer that needs whole matrices cannot step byte shards), each saying
how to get whole gradients instead.
"""

from typing import Any

import torch

# What megatron-core 0.19.2's DistributedOptimizer steps through its own factory: it asserts that
# SGD (no state initializer for its checkpoints) is not given to it.
BYTE_SHARDED_OPTIMIZERS = ("adam",)
# Our fields megatron-core's optimizer has no counterpart for: refused there rather than ignored.
_FIELDS_WITHOUT_MEGATRON_CORE_SUPPORT = ("qk_clip", "log_max_attention_logit")


def reduce_scattering_chunks(chunks: list[torch.nn.Module]) -> list[int]:
    """Indices of the chunks whose megatron-core DDP reduce-scatters gradients. Megatron-FSDP, which
    also sets the flag, shards the parameters themselves (DTensors; distributed/fsdp2.py steps them)."""
    from torch.distributed.tensor import DTensor

    indices = []
    for index, chunk in enumerate(chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if (ddp_config is not None and getattr(ddp_config, "use_distributed_optimizer", False)
                and not getattr(ddp_config, "use_megatron_fsdp", False)
                and not any(isinstance(p, DTensor) for p in chunk.parameters())):
            indices.append(index)
    return indices


def check_byte_sharded_config(config: Any, chunks: list[torch.nn.Module], matrix_optimizer: bool) -> None:
    """Refuse what cannot step reduce-scattered gradients, saying what to do instead."""
    scattering = reduce_scattering_chunks(chunks)
    if len(scattering) != len(chunks):
        raise ValueError(f"model chunks {scattering} reduce-scatter their gradients (megatron-core DDP with "
                         f"ddp_config.use_distributed_optimizer=True) and the others do not; build every chunk's "
                         f"DDP with the same ddp_config.")
    if config.use_layer_wise_distributed_optimizer or config.optimizer not in BYTE_SHARDED_OPTIMIZERS:
        raise ValueError(_whole_gradients_message(config, matrix_optimizer))
    if not config.use_distributed_optimizer:
        raise ValueError(
            "the model chunks are wrapped in megatron-core's DistributedDataParallel with "
            "ddp_config.use_distributed_optimizer=True, which leaves each rank the gradients of its "
            "bucket shard only; a non-distributed optimizer would step the other elements with partial "
            "gradients. Set OptimizerConfig.use_distributed_optimizer=True, or build DDP with "
            "use_distributed_optimizer=False.")
    unsupported = [name for name in _FIELDS_WITHOUT_MEGATRON_CORE_SUPPORT if getattr(config, name, False)]
    if unsupported:
        raise ValueError(f"{', '.join(f'OptimizerConfig.{name}=True' for name in unsupported)} is not supported "
                         f"by megatron-core's DistributedOptimizer, which steps reduce-scattered gradients; turn "
                         f"it off, or build DDP with use_distributed_optimizer=False and use the layer-wise optimizer.")
    for index, chunk in enumerate(chunks):
        if not hasattr(chunk, "buffers") or not hasattr(chunk, "bucket_size"):
            raise ValueError(f"model chunk {index} carries ddp_config.use_distributed_optimizer=True but is not "
                             f"megatron-core's DistributedDataParallel (it has no gradient buckets), whose buckets "
                             f"megatron-core's DistributedOptimizer steps; wrap it in DistributedDataParallel, or "
                             f"set ddp_config.use_distributed_optimizer=False.")


def _whole_gradients_message(config: Any, matrix_optimizer: bool) -> str:
    """Megatron-LM builds DDP to all-reduce for an emerging optimizer with
    --no-use-layer-wise-param-layout; by default (megatron-core 0.19) it reduce-scatters."""
    needs = "whole matrices" if matrix_optimizer else "whole parameters"
    if config.optimizer == "sgd" and not config.use_layer_wise_distributed_optimizer:
        return ("optimizer 'sgd' over megatron-core's DistributedDataParallel with "
                "ddp_config.use_distributed_optimizer=True, which reduce-scatters gradients into byte shards: "
                "megatron-core's DistributedOptimizer, which steps such shards, refuses SGD (so does Megatron-LM's "
                "own --optimizer sgd --use-distributed-optimizer). Build DDP with use_distributed_optimizer=False "
                "(it then all-reduces) and keep OptimizerConfig.use_distributed_optimizer=True (the layer-wise "
                "distributed optimizer), or use optimizer='adam'.")
    if config.optimizer in BYTE_SHARDED_OPTIMIZERS + ("sgd",):  # asked for the layer-wise optimizer itself
        return (f"the layer-wise distributed optimizer steps whole parameters, but the model chunks are wrapped in "
                f"megatron-core's DistributedDataParallel with ddp_config.use_distributed_optimizer=True, which "
                f"reduce-scatters gradients into byte shards. Build DDP with use_distributed_optimizer=False (it "
                f"then all-reduces), or for 'adam' set OptimizerConfig.use_distributed_optimizer=True with "
                f"use_layer_wise_distributed_optimizer=False (megatron-core's DistributedOptimizer steps those shards).")
    return (f"optimizer {config.optimizer!r} steps {needs}, but the model chunks are wrapped in megatron-core's "
            f"DistributedDataParallel with ddp_config.use_distributed_optimizer=True, which reduce-scatters "
            f"gradients into byte shards (megatron-core's DistributedOptimizer steps such shards for "
            f"{', '.join(BYTE_SHARDED_OPTIMIZERS)} only). Build DDP with use_distributed_optimizer=False (it "
            f"then all-reduces) and keep OptimizerConfig.use_distributed_optimizer=True (the layer-wise "
            f"distributed optimizer); in Megatron-LM's loop add --no-use-layer-wise-param-layout to "
            f"--optimizer {config.optimizer} --use-distributed-optimizer, with which it builds DDP so.")
