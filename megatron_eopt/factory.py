"""get_megatron_optimizer: model chunks + one config -> a ready optimizer.

The recipe: validate the config, find the optimizer, resolve process groups, build param
groups from the overrides, then one wrapped optimizer for dense and one for expert parameters
(they sum their gradient norms over different groups), chained under one norm.
"""

import functools
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from megatron_eopt.config import OptimizerConfig, as_optimizer_config
from megatron_eopt.distributed.process_groups import ParallelGroups, resolve_parallel_groups
from megatron_eopt.param_groups import ParamRecord, build_param_groups, dump_param_group_map
from megatron_eopt.param_key import check_config_overrides, get_standard_config_overrides
from megatron_eopt.registry import get_optimizer_entry
from megatron_eopt.wrappers.chained import ChainedOptimizer
from megatron_eopt.wrappers.fp32 import FP32Optimizer
from megatron_eopt.wrappers.grad_scaler import make_grad_scaler
from megatron_eopt.wrappers.mixed_precision import MixedPrecisionOptimizer


def get_megatron_optimizer(
    config: Any,
    model_chunks: Union[torch.nn.Module, Iterable[torch.nn.Module]],
    config_overrides: Optional[Mapping[Any, Mapping[str, Any]]] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: Optional[str] = None,
) -> ChainedOptimizer:
    """Build the optimizer for `model_chunks` (megatron-core's signature).

    Args:
        config: OptimizerConfig, or megatron-core's OptimizerConfig (fields read by name).
        model_chunks: a module or a list of modules (virtual pipeline chunks).
        config_overrides: ParamKey -> ParamGroupOverride; None means the standard overrides
            (`get_standard_config_overrides`), {} means none at all.
        use_gloo_process_groups: accepted for compatibility; no gloo side groups are needed.
        pg_collection: megatron-core ProcessGroupCollection or ParallelGroups; None uses
            megatron-core's parallel_state when torch.distributed runs several ranks.
        dump_param_to_param_group_map: a directory; each rank writes which optimizer and
            param group each of its parameters got (`rank_00000.json`, ...).
    Returns:
        A ChainedOptimizer (children: 'dense', and 'expert' when the model has experts).
    """
    config = as_optimizer_config(config)
    entry = get_optimizer_entry(config.optimizer)
    _check_implemented(config)
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty; pass the model (or its list of chunks).")
    groups = resolve_parallel_groups(pg_collection)
    overrides = get_standard_config_overrides(config) if config_overrides is None else config_overrides
    check_config_overrides(overrides)

    param_groups, records = build_param_groups(chunks, config, overrides, align_group=groups.world)
    if not param_groups:
        raise ValueError("model_chunks have no trainable parameters (requires_grad=True).")
    if dump_param_to_param_group_map is not None:
        optimizer_of = {group["group_key"]: entry.name for group in param_groups}
        dump_param_group_map(dump_param_to_param_group_map, param_groups, records, optimizer_of)

    make_optimizer = functools.partial(entry.build, config=config)
    grad_scaler = make_grad_scaler(config, _device_of(records))
    children = []
    for is_expert, name in ((False, "dense"), (True, "expert")):
        child_groups = [g for g in param_groups if g["is_expert_parallel"] == is_expert]
        if child_groups:
            tp_group, norm_group = _gradient_groups(groups, is_expert)
            wrapper = MixedPrecisionOptimizer if (config.bf16 or config.fp16) else FP32Optimizer
            children.append(
                wrapper(child_groups, make_optimizer, config, records, tp_group, norm_group, name, grad_scaler)
            )
    return ChainedOptimizer(children)


def _check_implemented(config: OptimizerConfig) -> None:
    if config.use_distributed_optimizer:
        raise ValueError(
            f"use_distributed_optimizer=True (megatron-core's ZeRO-1 DistributedOptimizer) is "
            f"not implemented by megatron_eopt for optimizer {config.optimizer!r}; set it to "
            f"False."
        )
    if config.use_layer_wise_distributed_optimizer:
        raise ValueError(
            "use_layer_wise_distributed_optimizer=True is not implemented yet in this version "
            "of megatron_eopt; set it to False."
        )


def _gradient_groups(groups: ParallelGroups, is_expert: bool) -> tuple[Any, Any]:
    """(tensor-parallel group, gradient-norm group) for dense or expert parameters."""
    if is_expert:
        why = "the gradient norm of expert parameters (param.allreduce=False)"
        return groups.require("expt_tp", why), groups.require("expt_mp", why)
    why = "the gradient norm"
    return groups.require("tp", why), groups.require("mp", why)


def _device_of(records: list[ParamRecord]) -> Optional[torch.device]:
    return records[0].param.device if records else None
