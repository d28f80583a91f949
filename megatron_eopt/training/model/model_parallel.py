"""megatron's model-parallel groups, and the seeds the model's weights are drawn from.

:func:`initialize_model_parallel` sets up megatron-core's ``parallel_state`` (tensor, pipeline,
virtual pipeline and expert parallelism; the rest of the world is data parallelism) and seeds the
RNGs: the default generator, which CPU initialisation draws from, and the per-TP-rank streams of
dropout (megatron's CUDA tracker, or ``parallel/cpu_rng.py``'s on CPU). Its seed also seeds every
model chunk and transformer layer (:class:`LayerSeededTransformerLayer`), so the weights are the
same in every pipeline layout.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)

from megatron_eopt.ops.collectives import group_timeout
from megatron_eopt.training.parallel.cpu_rng import use_cpu_rng_tracker

__all__ = [
    "LayerSeededTransformerLayer",
    "destroy_model_parallel",
    "forget_model_parallel_groups",
    "init_seed",
    "initialize_model_parallel",
    "seed_model_chunk",
]


def initialize_model_parallel(
    tensor_model_parallel_size: int,
    seed: int,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    distributed_timeout_minutes: float | None = None,
    expert_tensor_parallel_size: int | None = None,
) -> None:
    """Set up megatron's model-parallel groups and seed the RNGs.

    torch.distributed must already be initialised; its world size must be a multiple of
    ``tensor_model_parallel_size * pipeline_model_parallel_size`` (the rest becomes data
    parallelism). ``virtual_pipeline_model_parallel_size``: model chunks per rank (interleaved
    pipeline; build them with :func:`build_gpt_model_chunks`). Experts are split over
    ``expert_model_parallel_size`` ranks of the data-parallel ranks (megatron's layout), and each
    expert's layers over ``expert_tensor_parallel_size`` ranks (None: the TP size). The
    groups time out after ``distributed_timeout_minutes`` (None: the default group's timeout, not
    megatron's 30 minutes, which would outlast --distributed-timeout-minutes).
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(gloo works on CPU) before initialize_model_parallel"
        )
    world_size = torch.distributed.get_world_size()
    _check_parallel_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                          virtual_pipeline_model_parallel_size, expert_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("model parallel state is already initialised; destroy it first")
    # Models dropped since the last teardown may sit in reference cycles with the groups they were
    # built on; freed now, their gloo threads go before about 23 new groups start theirs.
    gc.collect()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=(group_timeout(None).total_seconds() / 60 if distributed_timeout_minutes is None
                                     else distributed_timeout_minutes),
    )
    # CPU initialisation draws from torch's default generator, on every device.
    global _init_seed
    _init_seed = seed
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        # Megatron's seeding also sets up the per-TP-rank CUDA RNG streams used by dropout;
        # it calls CUDA, hence only when CUDA is there.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:  # the same per-TP-rank stream on the CPU generator (megatron_eopt/training/parallel/cpu_rng.py)
        use_cpu_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank())


# The seed of the last initialize_model_parallel: build_gpt_model seeds each model chunk and each
# transformer layer from it (see LayerSeededTransformerLayer).
_init_seed: int | None = None


def init_seed() -> int | None:
    """The seed of the last :func:`initialize_model_parallel` (None before the first)."""
    return _init_seed


def seed_model_chunk(config: TransformerConfig, vp_stage: int | None) -> None:
    """Seed the default generator as the PP=1 model's stands before this chunk's first layer
    (see LayerSeededTransformerLayer); nothing before :func:`initialize_model_parallel`."""
    if _init_seed is not None:
        torch.manual_seed(_init_seed + get_transformer_layer_offset(config, vp_stage))


class LayerSeededTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer that reseeds the default generator after its initialisation,
    with the seed and its global layer number.

    With CPU initialisation the weights are drawn from one generator in construction order, so
    without this a pipeline stage's layers would start where that stage's generator is, not
    where the PP=1 model's is. With it, build_gpt_model seeds a chunk as the PP=1 model's
    generator stands after the layers before it (seed + their count), and every layer, the
    embedding and the output layer get the same weights in every pipeline layout.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _init_seed is not None:
            torch.manual_seed(_init_seed + self.layer_number)


def _check_parallel_sizes(world_size: int, tp: int, pp: int, vpp: int | None, ep: int) -> None:
    if tp <= 0 or pp <= 0 or world_size % (tp * pp):
        raise ValueError(
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) must be "
            f"positive and divide the world size ({world_size})"
        )
    if ep <= 0 or (world_size // (tp * pp)) % ep:
        raise ValueError(
            f"expert_model_parallel_size ({ep}) must be positive and divide the data-parallel "
            f"size ({world_size // (tp * pp)})"
        )
    if vpp is not None and (vpp < 1 or pp == 1):
        raise ValueError(
            f"virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1 "
            f"(got {pp}) and must be >= 1; pass None for one model chunk per rank"
        )


def destroy_model_parallel() -> None:
    """Tear down megatron's model-parallel state and destroy the groups megatron-core made for it
    (torch.distributed stays initialised).

    A gloo group keeps its threads and sockets until it is destroyed and its last reference goes,
    and megatron-core's own teardown only forgets its groups: a process that initialises more than
    once (a test, a job that re-initialises) would keep every set. Destroy what was built on the
    groups first, or stop using it: a collective on a destroyed group fails."""
    made = [group for group in parallel_state._global_process_group_list or () if group is not None]
    parallel_state.destroy_model_parallel()
    forget_model_parallel_groups()
    registered = torch.distributed.distributed_c10d._world.pg_map
    for group in made:
        if group in registered:
            torch.distributed.destroy_process_group(group)


# The parallel_state globals that megatron-core 0.19's destroy_model_parallel leaves set, each with
# the value it starts with. All hold groups; _global_process_group_list holds every group that
# create_group has ever made in the process.
_GROUP_GLOBALS_LEFT_SET: dict[str, Callable[[], Any]] = {
    "_global_process_group_list": lambda: None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": lambda: None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": lambda: None,
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": lambda: None,
    "_HYBRID_DP_CP_GROUPS": dict,
}


def forget_model_parallel_groups() -> None:
    """Reset what megatron-core keeps across its destroy_model_parallel that holds groups (call
    after it); destroys nothing. Beyond the parallel_state globals: the rotary embeddings' forward
    caches, whose keys are the embedding modules (and so their context-parallel group), and the
    MoE metrics tracker, whose entries keep the groups they reduce over."""
    for name, initial in _GROUP_GLOBALS_LEFT_SET.items():
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, initial())
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    for embedding in (RotaryEmbedding, YarnRotaryEmbedding):
        embedding.forward.cache_clear()
    destroy_moe_metrics_tracker()
