"""get_megatron_optimizer: model chunks + one config -> a ready optimizer.

The recipe: validate the config, look the optimizer up in the registry, resolve process
groups, route every parameter to the configured optimizer or (for matrix optimizers such as
Muon) to the scalar optimizer, build param groups from the overrides, then one wrapped
optimizer per (optimizer, dense|expert) (dense and expert parameters sum their gradient norms
over different groups and use different tensor-parallel groups), chained under one norm.
"""

import dataclasses
import difflib
import fnmatch
import logging
import sys
import warnings
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_eopt.megatron_core_formats.distributed_optimizer import DistributedOptimizerBuckets
from megatron_eopt.config.optimizer_config import OptimizerConfig, as_optimizer_config, warn_about_inert_fields
from megatron_eopt.distributed.fsdp2 import OUTPUT_LAYER_NAMES, check_fully_sharded_config, fully_sharded_optimizer_class
from megatron_eopt.distributed.layer_wise import DataParallelShards, LayerWiseDistributedOptimizer
from megatron_eopt.distributed.layer_wise_norm_order import ChildNormParams, MegatronCoreNormOrder
from megatron_eopt.placement.fully_sharded_layout import FullyShardedLayout, fully_sharded_layout
from megatron_eopt.placement.megatron_fsdp_model import MEGATRON_FSDP, megatron_fsdp_wrappers
from megatron_eopt.distributed.reduce_scattered import check_byte_sharded_config, reduce_scattering_chunks
from megatron_eopt.runtime.process_groups import ParallelGroups, group_rank, group_ranks, group_size, resolve_parallel_groups
from megatron_eopt.runtime.once import first_time, warn_once
from megatron_eopt.ops.ownership import assign_owners
from megatron_eopt.ops.row_shards import held_rows
from megatron_eopt.params.groups import (
    ParamRecord,
    ParamRouting,
    build_param_groups,
    dump_param_group_map,
    matrix_layouts,
    routing_fallbacks,
    splits_any_per_head,
)
from megatron_eopt.params.names import EXPERT_NAME_PART, is_expert_name
from megatron_eopt.params.overrides import check_config_overrides, get_standard_config_overrides, matching_keys, merge_overrides
from megatron_eopt.registry import BuildContext, OptimizerSpec, lookup_optimizer, optimizers_supporting
from megatron_eopt.registry.kwargs import takes_matrix_batches
from megatron_eopt.wrappers.chained import ChainedOptimizer
from megatron_eopt.wrappers.fp32 import FP32Optimizer
from megatron_eopt.wrappers.grad_scaler import make_grad_scaler
from megatron_eopt.wrappers.grad_stats import NormsInParamOrder, grad_norm_group_of
from megatron_eopt.wrappers.mixed_precision import MixedPrecisionOptimizer
from megatron_eopt.wrappers.state_precision import state_precision_for
from megatron_eopt.wrappers.qk_clip import QKClip, build_qk_clip, qk_clip_settings


LEGACY_DISTRIBUTED_PREFIX = "dist_"
logger = logging.getLogger(__name__)


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
            (`get_standard_config_overrides`, plus the optimizer entry's default overrides),
            {} means none at all. Give the scalar part of a Muon run its own lr/wd here (e.g. a
            key matching 1-D parameters).
        use_gloo_process_groups: megatron-core uses gloo groups only for its byte-sharded
            DistributedOptimizer's CPU-side state gathering on save/load: passed to it when the
            chunks reduce-scatter (below), inert otherwise (our optimizers and checkpoints
            communicate over the given groups alone).
        pg_collection: megatron-core ProcessGroupCollection or ParallelGroups; None uses
            megatron-core's parallel_state when torch.distributed runs several ranks.
        dump_param_to_param_group_map: a directory; each rank writes which optimizer and
            param group each of its parameters got (`rank_00000.json`, ...).
    Returns:
        For chunks in megatron-core's DDP that reduce-scatters gradients, what megatron-core's own
        factory builds (its DistributedOptimizers; adam only). Otherwise a ChainedOptimizer; a stub (`is_stub_optimizer`, no children, its step a no-op) when the
        chunks have no trainable parameter. Children: 'dense' (and 'expert' when the model has experts) for an
        optimizer that takes every parameter; '<optimizer>/dense', '<scalar>/dense' (and
        '.../expert') for one that routes some parameters to the scalar optimizer.
    """
    config = _without_legacy_name(as_optimizer_config(config))
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty; pass the model (or its list of chunks).")
    if reduce_scattering_chunks(chunks):  # megatron-core's DDP built for its DistributedOptimizer
        return _megatron_core_distributed(config, chunks, config_overrides, use_gloo_process_groups,
                                          pg_collection, dump_param_to_param_group_map)
    config = _distributed_as_layer_wise(config)
    warn_about_inert_fields(config)
    spec = lookup_optimizer(config.optimizer)
    routing = _routing(spec, config)
    _check_supported(config, {name: lookup_optimizer(name) for name in routing.optimizers})
    fsdp = fully_sharded_layout(chunks, pg_collection)  # torch FSDP2 or Megatron-FSDP (DTensor parameters), or None
    if fsdp is not None:
        check_fully_sharded_config(config, fsdp.engine)
        _check_supported(config, {name: lookup_optimizer(name) for name in routing.optimizers}, fsdp2=True)
        routing = _fully_sharded_routing(routing, fsdp)
    groups = resolve_parallel_groups(pg_collection) if fsdp is None else fsdp.parallel_groups()
    overrides = _overrides(config, config_overrides, spec)
    check_config_overrides(overrides)

    param_groups, records = build_param_groups(chunks, config, overrides, groups.spanning_groups(), routing)
    if fsdp is not None:
        records = fsdp.with_layout_facts(records)
    _report_routing(config, routing, records, chunks)
    if dump_param_to_param_group_map is not None:
        dump_param_group_map(dump_param_to_param_group_map, param_groups, records)
    if not param_groups:  # no trainable parameter on any rank of the groups (a frozen model or stage)
        return ChainedOptimizer([], config=config)  # a stub, as megatron-core builds
    for name in routing.optimizers:  # on every rank, before any rank builds (and owns) anything
        lookup_optimizer(name).check_params([g for g in param_groups if g["optimizer"] == name], config)

    qk_clip = _qk_clip(config, chunks, groups, records, fsdp)
    build = _Build(config, chunks, groups, routing, param_groups, records, fsdp, qk_clip, overrides)
    layer_wise = config.use_layer_wise_distributed_optimizer
    optimizer = _layer_wise(build) if layer_wise else ChainedOptimizer(_children(build), qk_clip=qk_clip)
    if fsdp is None:
        optimizer.core_buckets = DistributedOptimizerBuckets(chunks, group_size(groups.dp_cp), group_rank(groups.dp_cp),
                                                             group_rank(groups.mp))
    else:
        _as_megatron_core_on_fsdp(optimizer, build, overrides)
    _register_with_megatron_core()
    tp_modes = muon_tp_modes(optimizer)
    _warn_if_tp_settings_unused(config, records, tp_modes)
    if dump_param_to_param_group_map is not None and tp_modes:  # again, with each matrix's TP mode
        dump_param_group_map(dump_param_to_param_group_map, param_groups, records, tp_modes)
    return optimizer


def _as_megatron_core_on_fsdp(optimizer: ChainedOptimizer, build: "_Build", overrides: Mapping[Any, Any]) -> None:
    """As megatron-core's DistributedOptimizer: a step ends with Megatron-FSDP's compute weights, and
    on Megatron-FSDP the norm is summed in its one optimizer's order."""
    optimizer.megatron_fsdp_wrappers = megatron_fsdp_wrappers(build.chunks)
    if build.fsdp.engine == MEGATRON_FSDP:
        order = _megatron_core_param_order(build.param_groups, build.records, overrides)
        optimizer.arrange_stats = NormsInParamOrder(order)


def _megatron_core_param_order(param_groups: list[dict], records: list[ParamRecord],
                               overrides: Mapping[Any, Mapping[str, Any]]) -> list[torch.Tensor]:
    """The parameters in the order of megatron-core's one optimizer over a Megatron-FSDP model (its
    `_get_param_groups`): by merged override (none first, then sorted), each in the model's order.
    Megatron-FSDP drops `allreduce=False`, so megatron-core puts experts in the dense groups, by layer;
    ours keeps expert groups apart (dense before expert)."""
    position = {id(r.param): index for index, r in enumerate(records)}
    record_of = {id(r.param): r for r in records}

    def override(param: torch.Tensor) -> tuple:
        record = record_of[id(param)]
        keys = matching_keys(overrides, record.param, record.name)
        merged = tuple(sorted(merge_overrides(keys, overrides, record.name).items())) if keys else None
        return (merged is not None, merged or ())

    params = [p for group in param_groups for p in group["params"]]
    try:
        return sorted(params, key=lambda p: (override(p), position[id(p)]))
    except TypeError:  # override values of unlike types (megatron-core's own sort of them raises too)
        return params


def _register_with_megatron_core() -> None:
    """Code written for megatron-core's optimizer asks `isinstance(optimizer, megatron.core.optimizer.
    ChainedOptimizer)` (verl's Megatron-side offload helpers): ours is a virtual subclass of it, once
    megatron-core is imported (a run without megatron-core does not import it for this)."""
    if "megatron.core" not in sys.modules:
        return
    from megatron.core.optimizer import ChainedOptimizer as MegatronCoreChainedOptimizer

    MegatronCoreChainedOptimizer.register(ChainedOptimizer)


def _fully_sharded_routing(routing: ParamRouting, fsdp: FullyShardedLayout) -> ParamRouting:
    """The engines drop megatron-core's parameter attributes: the LM head is named instead, and
    the experts on a mesh of their own are listed."""
    return dataclasses.replace(routing, embedding_or_output_names=OUTPUT_LAYER_NAMES,
                               expert_parallel_fqns=fsdp.expert_parallel_fqns)


def _warn_if_tp_settings_unused(config: OptimizerConfig, records: list[ParamRecord], tp_modes: Mapping[str, str]) -> None:
    """Say so (once per process) when muon_expert_tp_mode or muon_tp_hardware_profile is set but
    nothing reads it: no expert matrix takes a TP mode, or no mode is 'auto'."""
    expert_matrices = [fqn for fqn in tp_modes if is_expert_name(fqn)]
    if config.muon_expert_tp_mode is not None and not expert_matrices:
        warn_once("unused muon_expert_tp_mode",
                  f"OptimizerConfig.muon_expert_tp_mode={config.muon_expert_tp_mode!r} has no effect: no expert "
                  f"matrix ('{EXPERT_NAME_PART}' in its name) is stepped by a Muon-family optimizer here.", stacklevel=3)
    expert_mode = config.muon_expert_tp_mode or config.muon_tp_mode
    uses_auto = "auto" in (config.muon_tp_mode, expert_mode if expert_matrices else None)
    if config.muon_tp_hardware_profile is not None and not (uses_auto and tp_modes):
        warn_once("unused muon_tp_hardware_profile",
                  f"OptimizerConfig.muon_tp_hardware_profile={config.muon_tp_hardware_profile!r} has no effect: "
                  f"only muon_tp_mode='auto' (or muon_expert_tp_mode='auto') reads it.", stacklevel=3)


def muon_tp_modes(optimizer: Any) -> dict[str, str]:
    """fqn -> the TP mode each Muon-family matrix runs in ('auto' resolved per matrix; the
    expert ones per `muon_expert_tp_mode`), from an optimizer `get_megatron_optimizer` built."""
    modes: dict[str, str] = {}
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        tp_modes = getattr(child, "tp_modes", None)  # megatron-core children (a chain of theirs) have none
        modes.update(tp_modes() if tp_modes is not None else {})
    return modes


@dataclasses.dataclass(frozen=True)
class _Build:
    """What the factory has resolved once it builds the children: every later step reads it."""

    config: OptimizerConfig
    chunks: list[torch.nn.Module]
    groups: ParallelGroups
    routing: ParamRouting
    param_groups: list[dict]
    records: list[ParamRecord]
    fsdp: Optional[FullyShardedLayout] = None  # torch FSDP2's layout, or None
    # QK-clip: the chain measures the maxima in step(); each child clips the main copies it steps.
    qk_clip: Optional[QKClip] = None
    overrides: Mapping[Any, Any] = dataclasses.field(default_factory=dict)  # config_overrides, ours merged in


def _qk_clip(config: OptimizerConfig, chunks: list[torch.nn.Module], groups: ParallelGroups,
             records: list[ParamRecord], fsdp: Optional[FullyShardedLayout] = None) -> Optional[QKClip]:
    """QK-clip / max-logit logging (wrappers/qk_clip.py), or None when neither is on."""
    settings = qk_clip_settings(config, chunks)
    if not settings.records_logits:
        return None
    why = "QK-clip (maximum attention logits)"
    return build_qk_clip(settings, chunks, {id(r.param): r.fqn for r in records}, groups.require("tp", why),
                         groups.require("dp_cp", why), groups.require("mp", why), _device_of(records),
                         None if fsdp is None else _held_rows(fsdp))


def _held_rows(fsdp: FullyShardedLayout) -> dict[str, tuple[int, int]]:
    """fqn -> the rows of each weight this rank holds, for QK-clip on row shards (an expert's rows
    on its own mesh, the dense parameters' on theirs). TP x FSDP is refused: `fully_shard` drops the
    attributes that say which weights TP splits by heads, and Megatron-FSDP's rows are of each TP
    rank's part (untested)."""
    if group_size(fsdp.tp_group) > 1 or fsdp.placed:
        placed = f" (parameter {sorted(fsdp.placed)[0]!r} is placed other than Shard(0))" if fsdp.placed else ""
        raise ValueError(f"QK-clip and max-logit logging on TP x {fsdp.engine}{placed} are not supported; use them "
                         f"with torch FSDP2 or Megatron-FSDP at TP=1, or with TP and megatron-core DDP.")
    experts = fsdp.expert_parallel_fqns  # their rows are split over their own mesh's group
    ranks = {is_expert: group_rank(fsdp.group_of(is_expert)) for is_expert in (False, True)}
    return {fqn: held_rows(split, ranks[fqn in experts]) for fqn, split in fsdp.rows_by_rank.items()}


def _report_routing(config: OptimizerConfig, routing: ParamRouting, records: list[ParamRecord],
                    chunks: list[torch.nn.Module]) -> None:
    """What the routing did not do as asked or known: said once each (an error with muon_strict_layouts)."""
    _warn_if_per_head_finds_no_qkv(config, records, chunks)
    _warn_if_use_muon_globs_match_nothing(routing, records)
    _report_routing_fallbacks(config, routing, records, chunks)


def _report_routing_fallbacks(config: OptimizerConfig, routing: ParamRouting, records: list[ParamRecord],
                              chunks: list[torch.nn.Module]) -> None:
    """One line on rank 0 naming the parameters routed by a fallback; with muon_strict_layouts, an error."""
    if routing.routing == "all":
        return
    fallbacks = routing_fallbacks(records, chunks, routing.optimizer)
    if not fallbacks:
        return
    named = _named_by_reason(fallbacks)
    advice = ("declare their layouts with megatron_eopt.params.fused_layouts.register_fused_layout / "
              "register_experts_container (docs/fsdp2.md)")
    if config.muon_strict_layouts:
        raise ValueError(f"OptimizerConfig.muon_strict_layouts=True: {len(fallbacks)} parameter(s) would be routed by "
                         f"a fallback: {named}. Either {advice}, or set muon_strict_layouts=False to accept this.")
    if not dist.is_initialized() or dist.get_rank() == 0:
        warn_once(f"routing_fallbacks:{named}", f"{routing.optimizer} routes {len(fallbacks)} parameter(s) by a "
                  f"fallback: {named}. To split them, {advice}.", stacklevel=5)


def _named_by_reason(reasons: Mapping[str, str], shown: int = 2) -> str:
    """'fqn: why; ...', parameters with the same reason (a layer's weight in every layer) together."""
    by_reason: dict[str, list[str]] = {}
    for fqn, why in sorted(reasons.items()):
        by_reason.setdefault(why, []).append(fqn)
    parts = []
    for why, fqns in by_reason.items():
        more = f" and {len(fqns) - shown} more" if len(fqns) > shown else ""
        parts.append(f"{', '.join(fqns[:shown])}{more}: {why}")
    return "; ".join(parts)


def _warn_if_per_head_finds_no_qkv(config: OptimizerConfig, records: list[ParamRecord],
                                   chunks: list[torch.nn.Module]) -> None:
    """`muon_split_qkv_per_head` splits fused q/k/v weights only: say so when there is none."""
    if config.muon_split_qkv_per_head and not splits_any_per_head(records, chunks, config.optimizer):
        warn_once("per_head_without_qkv", f"OptimizerConfig.muon_split_qkv_per_head=True has no effect on this "
                  f"rank: it splits fused q/k/v weights only (linear_qkv, and those of docs/fsdp2.md's table), and "
                  f"none of the matrices {config.optimizer!r} steps here is one (multi-latent attention's "
                  f"projections are orthogonalized per head and component without it; docs/tp-muon.md).",
                  stacklevel=5)


def _warn_if_use_muon_globs_match_nothing(routing: ParamRouting, records: list[ParamRecord]) -> None:
    """A `muon_include_params` / `muon_exclude_params` glob that no trainable parameter of this rank's
    chunks matches does nothing here: most often a misspelt name, said once per glob with the closest names."""
    names = [record.name for record in records]
    for glob, use_muon in routing.use_muon_names:
        if not names or any(fnmatch.fnmatchcase(name, glob) for name in names):
            continue
        field = "muon_include_params" if use_muon else "muon_exclude_params"
        close = difflib.get_close_matches(glob, names, n=3, cutoff=0.5)
        warn_once(f"use_muon glob {field} {glob}", f"OptimizerConfig.{field} glob {glob!r} matches no trainable "
                  f"parameter on this rank, so it moves nothing {'into' if use_muon else 'out of'} "
                  f"{routing.optimizer!r}. Globs match the names named_parameters() gives"
                  f"{' (closest: ' + ', '.join(map(repr, close)) + ')' if close else ''}; with pipeline "
                  f"parallelism the parameter may be on another stage.", stacklevel=5)


def _without_legacy_name(config: OptimizerConfig) -> OptimizerConfig:
    """'dist_<name>' (e.g. 'dist_muon') is the deprecated spelling of <name> + layer-wise."""
    if not config.optimizer.startswith(LEGACY_DISTRIBUTED_PREFIX):
        return config
    name = config.optimizer[len(LEGACY_DISTRIBUTED_PREFIX):]
    warnings.warn(
        f"optimizer={config.optimizer!r} is deprecated; write optimizer={name!r} with "
        f"use_layer_wise_distributed_optimizer=True (command line: --optimizer {name} "
        f"--use-distributed-optimizer).",
        DeprecationWarning,
        stacklevel=3,
    )
    # A copy: the caller's config stays as it was.
    return dataclasses.replace(
        config, optimizer=name, use_layer_wise_distributed_optimizer=True, use_distributed_optimizer=False
    )


def _distributed_as_layer_wise(config: OptimizerConfig) -> OptimizerConfig:
    """use_distributed_optimizer=True over whole gradients means the layer-wise distributed
    optimizer, for every optimizer (reduce-scattered gradients go to megatron-core's, above).

    It shards the optimizer state (and fp32 main copies) over data-parallel ranks, by whole
    parameters, and takes the same steps as the non-distributed optimizer. A copy: the caller's
    config is kept.
    """
    if not config.use_distributed_optimizer:
        return config
    if first_time("distributed is layer-wise"):  # the info line is logged once per process
        logger.info(
            "use_distributed_optimizer=True: optimizer %r uses megatron_eopt's layer-wise distributed "
            "optimizer (each data-parallel rank keeps the state of whole parameters it owns).",
            config.optimizer,
        )
    return dataclasses.replace(config, use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=True)


def _megatron_core_distributed(
    config: OptimizerConfig,
    chunks: list[torch.nn.Module],
    config_overrides: Optional[Mapping[Any, Mapping[str, Any]]],
    use_gloo_process_groups: bool,
    pg_collection: Any,
    dump_param_to_param_group_map: Optional[str],
) -> Any:
    """megatron-core's ChainedOptimizer of DistributedOptimizers, as its own factory builds it for
    `config`, over chunks whose DDP reduce-scatters (docs/layer-wise.md says why megatron-core's)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronCoreConfig
    from megatron.core.optimizer import get_megatron_optimizer as megatron_core_get_megatron_optimizer

    check_byte_sharded_config(config, chunks, lookup_optimizer(config.optimizer).routing != "all")
    if pg_collection is not None and not hasattr(pg_collection, "dp_cp"):
        raise TypeError(f"megatron-core's DistributedOptimizer takes megatron-core's ProcessGroupCollection as "
                        f"pg_collection (or None for its parallel_state); got {type(pg_collection).__name__}.")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(MegatronCoreConfig)
              if f.init and hasattr(config, f.name)}
    # Our ParamKeys match parameters as megatron-core's do (`matches(param, name)`); None gives
    # megatron-core's standard overrides, which are ours.
    return megatron_core_get_megatron_optimizer(
        MegatronCoreConfig(**values), chunks, config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
        dump_param_to_param_group_map=dump_param_to_param_group_map)


def _layer_wise(build: _Build) -> LayerWiseDistributedOptimizer:
    """Children over the parameters this rank owns, wrapped to reduce and broadcast."""
    config, groups, routing, records = build.config, build.groups, build.routing, build.records
    # Parameters stepped by a matrix optimizer (Muon & co.) are balanced by Newton-Schulz cost.
    matrix_fqns = {r.fqn for r in records if routing.routing != "all" and r.optimizer_name == routing.optimizer}
    # Every rank must learn of an inf/NaN anywhere, so the check of non-owned gradients is summed
    # over the dense and the expert groups (only "> 0" matters, so the overlap is harmless).
    shards, owned_fqns, check_groups = [], set(), []
    for is_expert in (False, True):
        members = [r for r in records if r.is_expert_parallel == is_expert]
        if not members and not any(g["is_expert_parallel"] == is_expert for g in build.param_groups):
            continue
        dp_group = _data_parallel_group(groups, is_expert)
        tp_group, norm_group = _gradient_groups(groups, is_expert)
        check_groups += [dp_group, norm_group]
        owners = assign_owners(members, matrix_fqns, group_size(dp_group), group_size(tp_group))
        by_owner = [[r.param for r in members if owners[r.fqn] == rank] for rank in range(group_size(dp_group))]
        # Reduced expert gradients are divided by the dense data-parallel size (megatron-core DDP's
        # expert scaling; layer_wise.py's docstring).
        divisor = group_size(_data_parallel_group(groups, False)) if is_expert else None
        shards.append(DataParallelShards(dp_group, by_owner, grad_divisor=divisor))
        owned_fqns |= {r.fqn for r in members if owners[r.fqn] == group_rank(dp_group)}
    children = _children(build, owned_fqns)
    norm_params = _norm_params(build)
    whole = _group_of_every_rank(build.groups) if any(child.is_expert for child in norm_params) else None
    chain = _megatron_core_chain(build) if whole is not None else ()
    norm_order = MegatronCoreNormOrder(norm_params, _device_of(records) or torch.device("cpu"), whole, chain)
    # With overlap_param_gather_with_optimizer_step a bucket is launched once the child that
    # steps its parameters (on their owner) has stepped; every rank knows which child that is.
    index_of_child = {child.name: index for index, child in enumerate(children)}
    phase_of = {id(r.param): index_of_child[_child_name(routing, r.optimizer_name, r.is_expert_parallel)]
                for r in records}
    return LayerWiseDistributedOptimizer(
        children, shards, [r.param for r in records], check_groups, reduce_grads=config.layer_wise_reduce_grads,
        overlap_param_gather=config.overlap_param_gather,
        overlap_param_gather_with_optimizer_step=config.overlap_param_gather_with_optimizer_step,
        model_chunks=build.chunks, phase_of=phase_of, qk_clip=build.qk_clip, norm_order=norm_order,
    )


def _data_parallel_group(groups: ParallelGroups, is_expert: bool) -> Any:
    if is_expert:
        return groups.require("expt_dp", "the layer-wise optimizer for expert parameters")
    return groups.require("dp_cp", "the layer-wise optimizer")


def _norm_params(build: _Build) -> list[ChildNormParams]:
    """Each layer-wise child's parameters on every owner, in its order, with those its norm counts
    (as FP32Optimizer counts them: not a tied copy, TP-duplicated on TP rank 0 only, with elements)."""
    record_of = {id(r.param): r for r in build.records}
    children = []
    for is_expert, _, child_groups in _child_param_groups(build):
        tp_rank = group_rank(_gradient_groups(build.groups, is_expert)[0])
        groups = [list(group["params"]) for group in child_groups]
        counted = {id(p): grad_norm_group_of(p, record_of[id(p)].fqn) for group in groups for p in group
                   if not record_of[id(p)].is_shared and (record_of[id(p)].tensor_model_parallel or tp_rank == 0)
                   and p.numel() > 0}
        children.append(ChildNormParams(groups, counted, _data_parallel_group(build.groups, is_expert), is_expert))
    return children


def _group_of_every_rank(groups: ParallelGroups) -> Optional[Any]:
    """A group the caller gave that is exactly the dense (dp x mp) and the expert (expt_dp x expt_mp)
    grid, as megatron-core's layer-wise optimizer sums its norm over every rank; else None."""
    grids = [(groups.dp_cp, groups.mp), (groups.expt_dp, groups.expt_mp)]
    for role in ("job", "tp_dp_cp"):
        whole = getattr(groups, role) if role in groups.provided else None
        if whole is not None and all(group_size(whole) == group_size(a) * group_size(b)
                                     and set(group_ranks(a)) | set(group_ranks(b)) <= set(group_ranks(whole))
                                     for a, b in grids):
            return whole
    return None


def _megatron_core_chain(build: _Build) -> list[list[torch.Tensor]]:
    """megatron-core's layer-wise param groups, each its parameters, in its optimizers' order: per
    optimizer, dense and expert groups sorted by merged override (none first; `_get_param_groups`),
    ties by the first parameter's place in the model."""
    position = {id(r.param): index for index, r in enumerate(build.records)}
    record_of = {id(r.param): r for r in build.records}
    overrides = build.overrides

    def key(group: dict) -> tuple:
        first = min(group["params"], key=lambda p: position[id(p)])
        keys = matching_keys(overrides, first, record_of[id(first)].name)
        merged = tuple(sorted(merge_overrides(keys, overrides, record_of[id(first)].name).items())) if keys else None
        return merged is not None, merged or (), position[id(first)]

    chain = []
    for name in build.routing.optimizers:
        groups = [g for g in build.param_groups if g["optimizer"] == name and g["params"]]
        chain += [list(g["params"]) for g in sorted(groups, key=key)]
    return chain


def _child_param_groups(build: _Build) -> list[tuple[bool, str, list[dict]]]:
    """(is_expert, optimizer name, its param groups) of each child, in the chain's order."""
    children = []
    for is_expert in (False, True):
        for name in build.routing.optimizers:
            child_groups = [g for g in build.param_groups if (g["is_expert_parallel"], g["optimizer"]) == (is_expert, name)]
            if child_groups:
                children.append((is_expert, name, child_groups))
    return children


def _children(build: _Build, owned_fqns: Optional[set[str]] = None) -> list[Any]:
    """One wrapped optimizer per (optimizer, dense|expert) that has param groups.

    With `owned_fqns` (layer-wise), each child steps only those parameters (its groups keep
    their keys, possibly empty) and sums its gradient norm over the data-parallel group too.
    With `build.fsdp` (torch FSDP2), each child steps the local shards and sums its gradient
    norm over the mesh's group.
    """
    config, groups, routing, records, fsdp = build.config, build.groups, build.routing, build.records, build.fsdp
    grad_scaler = make_grad_scaler(config, _device_of(records))
    wrapper = MixedPrecisionOptimizer if (config.bf16 or config.fp16) else FP32Optimizer
    if fsdp is not None:
        wrapper = fully_sharded_optimizer_class(fsdp, mixed_precision=config.bf16)
    children = []
    for is_expert, name, child_groups in _child_param_groups(build):
        tp_group, norm_group = _gradient_groups(groups, is_expert)
        norm_groups = (norm_group,)
        if owned_fqns is not None:
            child_groups = [_owned_only(g, owned_fqns) for g in child_groups]
            norm_groups = (_data_parallel_group(groups, is_expert), norm_group)
        if fsdp is not None:
            # Disjoint row shards: their squares sum over the mesh, then over the model-parallel
            # group (a TP-replicated parameter counts on TP rank 0 only, as without FSDP2); the
            # experts' over their own mesh, then over the expert model-parallel group; on
            # Megatron-FSDP in one reduction over both, as megatron-core sums (norm_groups). A mesh's
            # tensor-parallel dimension (torchtitan's) is summed as part of the mesh.
            norm_groups = fsdp.norm_groups(is_expert, norm_group)
        child_records = [r for r in records if (r.is_expert_parallel, r.optimizer_name) == (is_expert, name)]
        make_optimizer = _optimizer_maker(lookup_optimizer(name), config, build.chunks, child_records, tp_group,
                                          fsdp, is_expert)
        children.append(wrapper(child_groups, make_optimizer, config, records, tp_group, norm_groups,
                                _child_name(routing, name, is_expert), grad_scaler,
                                state_precision=state_precision_for(name, config), qk_clip=build.qk_clip))
        if fsdp is not None:
            children[-1].placed_fqns = fsdp.placed
    return children


def _child_name(routing: ParamRouting, optimizer_name: str, is_expert: bool) -> str:
    """'dense'/'expert', or '<optimizer>/dense' ... when the parameters are routed to several."""
    kind = "expert" if is_expert else "dense"
    return kind if len(routing.optimizers) == 1 else f"{optimizer_name}/{kind}"


def _owned_only(group: dict, owned_fqns: set[str]) -> dict:
    kept = [(p, f) for p, f in zip(group["params"], group["param_fqns"]) if f in owned_fqns]
    return {**group, "params": [p for p, _ in kept], "param_fqns": [f for _, f in kept]}


def _routing(spec: OptimizerSpec, config: OptimizerConfig) -> ParamRouting:
    scalar = None if spec.routing == "all" else config.muon_scalar_optimizer
    batches = spec.emerging and takes_matrix_batches(spec.entry.optimizer_cls)
    return ParamRouting(spec.name, spec.routing, scalar, _lookup_table_types(), matrix_batches=batches,
                        use_muon_names=_use_muon_names(spec, config))


def _use_muon_names(spec: OptimizerSpec, config: OptimizerConfig) -> tuple[tuple[str, bool], ...]:
    """(glob, use_muon) from muon_include_params / muon_exclude_params; refused where nothing is routed."""
    pairs = tuple((glob.strip(), value) for field, value in (("muon_include_params", True), ("muon_exclude_params", False))
                  for glob in getattr(config, field).split(",") if glob.strip())
    if pairs and spec.routing == "all":
        raise ValueError(
            f"OptimizerConfig.muon_include_params / muon_exclude_params have no effect with optimizer "
            f"{spec.name!r}, which steps every parameter; they apply to optimizers that route parameters "
            f"(muon, adaptive_muon, ...). Leave them ''.")
    return pairs


def _lookup_table_types() -> tuple[type, ...]:
    """Embedding modules: torch's, and megatron-core's vocab-parallel one if it is loaded."""
    if "megatron.core.tensor_parallel" not in sys.modules:
        return (torch.nn.Embedding,)  # no megatron-core model exists; don't pay its import
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    return (torch.nn.Embedding, VocabParallelEmbedding)


def _overrides(
    config: OptimizerConfig, config_overrides: Optional[Mapping[Any, Mapping[str, Any]]], spec: OptimizerSpec
) -> Mapping[Any, Mapping[str, Any]]:
    if config_overrides is not None:
        return config_overrides
    overrides = dict(get_standard_config_overrides(config))
    for key, override in spec.default_param_overrides.items():
        if key in overrides and any(overrides[key].get(f, v) != v for f, v in override.items()):
            raise ValueError(
                f"optimizer {spec.name!r}: its default override for {key!r} conflicts with the "
                f"standard override {overrides[key]}."
            )
        overrides[key] = {**overrides.get(key, {}), **override}
    return overrides


def _check_supported(config: OptimizerConfig, specs: Mapping[str, OptimizerSpec], fsdp2: bool = False) -> None:
    """Refuse what the registry's support facts (the README's table) say cannot work."""
    checks = (("fp16", config.fp16), ("bf16", config.bf16),
              ("layer_wise", config.use_layer_wise_distributed_optimizer), ("fsdp2", fsdp2))
    settings = {"layer_wise": "use_layer_wise_distributed_optimizer=True",
                "fsdp2": "a sharded DTensor model (torch FSDP2 or Megatron-FSDP)"}
    for feature, wanted in checks:
        refused = [name for name, spec in specs.items() if wanted and not getattr(spec.support, feature)]
        if refused:
            spec = specs[refused[0]]
            setting = settings.get(feature, f"{feature}=True")
            raise ValueError(
                f"{setting} is not supported with optimizer {refused[0]!r}: "
                f"{spec.support.why_not(feature)}. Optimizers that support it: "
                f"{', '.join(optimizers_supporting(feature))}."
            )


def _optimizer_maker(
    spec: OptimizerSpec,
    config: OptimizerConfig,
    chunks: list[torch.nn.Module],
    records: list[ParamRecord],
    tp_group: Any,
    fsdp: Optional[FullyShardedLayout] = None,
    is_expert: bool = False,
):
    """`make_optimizer(torch param groups)` for one child, with its TP group and layouts.

    For torch FSDP2 (`fsdp`), a whole-matrix optimizer gets the layouts of the matrices FSDP2
    splits by rows (a DTensor's shape is global over the mesh: the whole matrix, or this TP
    rank's shard of it) as row shards with an owner rank each, instead of `layouts`; an expert
    child's rows and owners are over the experts' mesh.
    """
    tp_size = group_size(tp_group)
    _check_tensor_parallel_support(spec, records, tp_size)
    layouts = None
    if spec.accepts("layouts"):
        split_qkv = config.muon_split_qkv and spec.entry.qkv_split
        layouts = matrix_layouts(records, chunks, tp_size, split_qkv, split_qkv and config.muon_split_qkv_per_head)
    if records:
        on_cpu = all(r.param.device.type == "cpu" for r in records)
    else:
        on_cpu = not torch.cuda.is_available()
    if fsdp is not None and spec.accepts("fsdp_shards"):
        context = BuildContext(tp_group=tp_group, on_cpu=on_cpu, fsdp_group=fsdp.group_of(is_expert),
                               fsdp_shards=fsdp.row_shards(records, layouts, is_expert))
    else:
        context = BuildContext(tp_group=tp_group, layouts=layouts, on_cpu=on_cpu)
    return lambda param_groups: spec.build(param_groups, config, context)


def _check_tensor_parallel_support(spec: OptimizerSpec, records: list[ParamRecord], tp_size: int) -> None:
    """A matrix optimizer that cannot see other TP shards would make the update depend on TP."""
    if tp_size == 1 or spec.support.tensor_parallel:
        return
    sharded = [r.fqn for r in records if r.tensor_model_parallel]
    if sharded:
        raise ValueError(
            f"optimizer {spec.name!r} ({spec.entry.optimizer_cls.__name__}) does not support tensor "
            f"parallelism: {spec.support.why_not('tensor_parallel')} (parameter {sharded[0]!r} is split "
            f"over {tp_size} TP ranks). Use tensor_model_parallel_size=1 or an optimizer that supports "
            f"it: {', '.join(optimizers_supporting('tensor_parallel'))}."
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
