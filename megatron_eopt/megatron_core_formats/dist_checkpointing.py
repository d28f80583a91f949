"""Optimizer state as megatron-core 0.19.2's optimizer of the same kind writes it, both ways.

Its kinds are the one table in layouts.py. In `sharded_state_dict` each parameter-shaped state
tensor is the model parameter's ShardedTensor re-keyed `optimizer.state.<name>.<model key>` (main
copies `optimizer.state.fp32_param.<key>`), the step once as `common_step`; a chain of several
children is `{i: child}` with `chained_{i}.` prefixes by megatron-core's rule (`adds_chain_prefix`).
Param groups leave `optimizer` out where it names the run's own optimizer; scalar state other than
the step goes under `eopt_scalar_state`, of other shapes under `eopt_own_state` (megatron-core reads
neither). The layer-wise owner writes a parameter's state as the main replica. With a
distributed-optimizer format in the metadata, megatron-core's DistributedOptimizer's (for an
emerging optimizer, chained after its LayerWiseDistributedOptimizer): `fully_reshardable` written
and read, `dp_reshardable` (by DDP bucket: distributed_optimizer.py) read. `metadata[LAYOUT_KEY]` records the
layout, our earlier one (EOPT_V1_LAYOUT) loads when named; megatron-core's layer-wise chain joins
dense and expert children (layer_wise_optimizer.py).
"""

import functools
from dataclasses import replace
from typing import Any, Mapping, NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor

from megatron_eopt.megatron_core_formats.layouts import (
    COMMON_STEP,
    CORE_FORMATS,
    CoreFormat,
    DISTRIBUTED_LAYOUTS,
    DISTRIBUTED_MAIN_PARAM,
    EOPT_V1_LAYOUT,
    EXTRA_SCALARS,
    GROUP_PARAMS,
    LAYOUTS,
    LAYOUT_KEY,
    MAIN_PARAM_STATE,
    MEGATRON_CORE_DISTRIBUTED_LAYOUT,
    MEGATRON_CORE_LAYER_WISE_LAYOUT,
    MEGATRON_CORE_LAYOUT,
    MEGATRON_CORE_PING_PONG_LAYOUT,
    OWN_GROUP_FIELDS,
    OWN_STATE,
    PARAMETER_KEYED_FORMATS,
    READ_DISTRIBUTED_FORMATS,
    SHARDING_TYPE_KEY,
    STATE_PREFIX,
    core_format_in,
    core_format_of,
    torch_state_of,
)
from megatron_eopt.megatron_core_formats.distributed_optimizer import DistributedOptimizerBuckets
from megatron_eopt.megatron_core_formats.fsdp_dtensor import asks_for_fsdp_dtensor, merged_fsdp_dtensor_states
from megatron_eopt.megatron_core_formats.layer_wise_optimizer import merged_by_optimizer
from megatron_eopt.config.optimizer_names import BUILTIN_OPTIMIZERS, run_optimizer
from megatron_eopt.params.groups import stored_child_name
from megatron_eopt.runtime.once import warn_once
from megatron_eopt.checkpointable.child import CheckpointableChild, ChildParam


# ---------------------------------------------------------------- Our child -> megatron-core's format


def core_state_dict(child: CheckpointableChild) -> dict:
    """The child's state as megatron-core's optimizer of the same kind returns it from `state_dict()`."""
    params = child.checkpoint_params()
    index_of = {id(p.main): i for i, p in enumerate(params)}
    primary = run_optimizer(child.config)
    groups = []
    for group in child.param_groups:
        fields = {k: v for k, v in group.items() if k not in OWN_GROUP_FIELDS}
        if fields.get("optimizer") == primary:
            del fields["optimizer"]
        groups.append({**fields, "params": [index_of[id(p)] for p in group["params"]]})
    torch_state = {"state": {i: dict(p.state) for i, p in enumerate(params) if p.state}, "param_groups": groups}
    layout = core_format_of(child)
    if layout.torch_state_key is None:
        return torch_state
    mains = child.fp32_main_params()
    state_dict = {layout.torch_state_key: torch_state,
                  layout.main_params_key: [[mains[i] for i in _main_copy_indices(params, group["params"])]
                                           for group in groups]}
    if child.grad_scaler is not None:  # the scale as megatron-core's scalers keep it: their load calls .cuda() on it
        scale = child.grad_scaler.scale.detach().clone()
        state_dict["grad_scaler"] = {**child.grad_scaler.state_dict(), "scale": scale}
    return state_dict


def megatron_core_state_dict(optimizer: Any) -> Any:
    """What megatron-core's optimizer of the same kind returns from `state_dict()` (the plain
    `--ckpt-format torch`): one child's dict, or a list for a chain of several. Our own
    `state_dict()` keys state by parameter name, which megatron-core cannot read; this is the way back."""
    states = [core_state_dict(child) for child in getattr(optimizer, "chained_optimizers", [optimizer])]
    return states[0] if len(states) == 1 else states


def plain_state_dict_for_megatron_core(optimizer: Any, state_dict: Any) -> Any:
    """What Megatron-LM's `--ckpt-format torch` saves: for a chain of ours megatron-core's layout, which
    megatron-core's optimizer and ours load; else `state_dict` (the layer-wise one writes files of its own)."""
    children = getattr(optimizer, "chained_optimizers", None)
    if children is None or getattr(optimizer, "owner_is_main_replica", False) or getattr(
            optimizer, "is_stub_optimizer", False) or not all(hasattr(c, "checkpoint_params") for c in children):
        return state_dict
    return megatron_core_state_dict(optimizer)


def _main_copy_indices(params: list[ChildParam], indices: list[int]) -> list[int]:
    """The indices of parameters with a separate fp32 main copy (megatron-core's 16-bit ones)."""
    return [i for i in indices if params[i].main is not params[i].model]


def child_sharded_state_dict(child: CheckpointableChild, model_sharded_state_dict: dict, is_loading: bool,
                             owner_is_main_replica: bool, layer_wise: bool = False) -> dict:
    """`core_state_dict` with its tensors replaced by megatron-core sharded tensors. `layer_wise`: as
    megatron-core's LayerWiseDistributedOptimizer writes its child (a rank may own none of a group's
    parameters): the main copies as `{group index: list}`, empty ones and empty state not saved."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if is_loading:
        child.init_state()
    params = child.checkpoint_params()
    sharded_of = _sharded_params(params, model_sharded_state_dict, owner_is_main_replica)
    state_dict = core_state_dict(child)
    layout = core_format_of(child)
    torch_state = torch_state_of(state_dict, layout)
    shaped, own, scalars = _sorted_state(child, params, torch_state, is_loading)
    state = {i: {name: make_sharded_optimizer_tensor(sharded_of(i), value, f"{STATE_PREFIX}.{name}")
                 for name, value in entries.items()} for i, entries in shaped.items()}
    if own:
        state_dict[OWN_STATE] = _own_sharded(own, sharded_of)
    if "step" in scalars:
        state[COMMON_STEP] = scalars.pop("step")
    torch_state["state"] = state
    if layout.main_params_key is not None:
        state_dict[layout.main_params_key] = [
            [make_sharded_optimizer_tensor(sharded_of(i), main, f"{STATE_PREFIX}.{MAIN_PARAM_STATE}")
             for i, main in zip(_main_copy_indices(params, group["params"]), mains)]
            for group, mains in zip(torch_state["param_groups"], state_dict[layout.main_params_key])
        ]
    for group in torch_state["param_groups"]:  # which parameters: this rank's own business
        group["params"] = LocalNonpersistentObject(group["params"])
    if scalars:
        state_dict[EXTRA_SCALARS] = scalars
    if layer_wise:
        if layout.main_params_key is not None:
            state_dict[layout.main_params_key] = {i: mains if mains else LocalNonpersistentObject(mains)
                                                  for i, mains in enumerate(state_dict[layout.main_params_key])}
        if not torch_state["state"]:
            torch_state["state"] = LocalNonpersistentObject(torch_state["state"])
    return state_dict


def _sharded_params(params: list[ChildParam], model_sharded_state_dict: dict, owner_is_main_replica: bool):
    """index -> the model parameter's ShardedTensor (or factory); a getter that names a missing one."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    by_index = get_param_id_to_sharded_param_map(model_sharded_state_dict, [p.model for p in params])

    def sharded_of(index: int) -> Any:
        if index not in by_index:
            raise ValueError(
                f"parameter {params[index].fqn!r} has no entry in the model's sharded_state_dict; build it with "
                f"the model's own sharded_state_dict() (its tensors must be the parameters themselves)."
            )
        return _as_main_replica(by_index[index], owner_is_main_replica)

    return sharded_of


def adds_chain_prefix(metadata: Mapping) -> bool:
    """megatron-core's ChainedOptimizer rule: `chained_{i}.` unless `chained_optim_avoid_prefix`, and
    always with a distributed-optimizer format keyed by DDP buckets."""
    sharding = metadata.get("distrib_optim_sharding_type")
    bucket_keyed = sharding is not None and sharding not in PARAMETER_KEYED_FORMATS
    return bucket_keyed or not metadata.get("chained_optim_avoid_prefix", False)


def describe_layout(metadata: Optional[dict], layer_wise: bool) -> None:
    """Record in the caller's `metadata` (Megatron-LM saves it with the checkpoint and hands it back
    on load) what we write: with a distributed-optimizer format, DistributedOptimizer's
    `fully_reshardable` (keyed by parameter, whatever format was asked for: we have no DDP
    buckets), for an emerging optimizer's run in megatron-core's layer-wise chain
    (`layer_wise`); otherwise the layout of megatron-core's optimizer of the same kind."""
    if metadata is None:
        return
    if layer_wise and metadata.get(LAYOUT_KEY) == MEGATRON_CORE_PING_PONG_LAYOUT:
        return  # asked for (megatron_lm.install): the sharding type stays as given
    if metadata.get("distrib_optim_sharding_type") is None:
        metadata[LAYOUT_KEY] = MEGATRON_CORE_LAYOUT
        return
    metadata[LAYOUT_KEY] = MEGATRON_CORE_LAYER_WISE_LAYOUT if layer_wise else MEGATRON_CORE_DISTRIBUTED_LAYOUT
    metadata["distrib_optim_sharding_type"] = "fully_reshardable"


def kept_by_layer_wise(child: CheckpointableChild) -> bool:
    """Whether megatron-core's chain for Megatron-LM's `--optimizer <emerging> --use-distributed-optimizer`
    keeps the child's parameters in its LayerWiseDistributedOptimizer (the run's emerging optimizer's,
    written as its FP32/Float16 optimizer writes them), not in the DistributedOptimizer chained after
    it (the others': Adam's, ...)."""
    primary = run_optimizer(child.config)
    return primary not in BUILTIN_OPTIMIZERS and any(g.get("optimizer", primary) == primary
                                                     for g in child.param_groups)


def layout_of(metadata: Optional[Mapping]) -> str:
    layout = (metadata or {}).get(LAYOUT_KEY, MEGATRON_CORE_LAYOUT)
    if layout not in LAYOUTS:
        raise ValueError(f"metadata[{LAYOUT_KEY!r}] is {layout!r}; the layouts are {LAYOUTS}: megatron-core's "
                         f"optimizer's, its DistributedOptimizer's, ours before them.")
    return layout


def chain_sharded_state_dict(names: list[str], children: list[CheckpointableChild], model_sharded_state_dict: dict,
                             is_loading: bool, owner_is_main_replica: bool, metadata: Optional[dict],
                             buckets: Optional[DistributedOptimizerBuckets] = None) -> dict:
    """A chain's sharded state dict in the layout `metadata` asks for (megatron-core's by default).
    `buckets`: megatron-core's DDP bucket layout for the run's model, to read a `dp_reshardable` one.
    DTensor-sharded children (FSDP2, Megatron-FSDP) answer themselves: megatron_core_formats/fsdp_dtensor.py."""
    if asks_for_fsdp_dtensor(metadata) or _any_dtensor_sharded(children):
        states = [child.sharded_state_dict(model_sharded_state_dict, is_loading, metadata=metadata)
                  for child in children]
        return merged_fsdp_dtensor_states(states)
    if layout_of(metadata) == EOPT_V1_LAYOUT:
        return {"optimizers": {name: v1_child_sharded_state_dict(child, model_sharded_state_dict, is_loading,
                                                                 owner_is_main_replica)
                               for name, child in zip(names, children)}}
    if not is_loading:
        describe_layout(metadata, layer_wise=any(map(kept_by_layer_wise, children)))
    ping_pong = layout_of(metadata) == MEGATRON_CORE_PING_PONG_LAYOUT
    distributed = not ping_pong and (written_by_distributed_optimizer(metadata) if is_loading
                                     else layout_of(metadata) in DISTRIBUTED_LAYOUTS)
    if distributed:
        return _distributed_chain(children, model_sharded_state_dict, is_loading, owner_is_main_replica,
                                  metadata, buckets)
    states = [child_sharded_state_dict(child, model_sharded_state_dict, is_loading, owner_is_main_replica, ping_pong)
              if hasattr(child, "checkpoint_params")  # else megatron-core's own optimizer in our chain
              else child.sharded_state_dict(model_sharded_state_dict, is_loading, metadata=metadata)
              for child in children]
    if ping_pong:
        states = merged_by_optimizer(children, states)
    return states[0] if len(states) == 1 else _chained(states, metadata)


def _distributed_chain(children: list[CheckpointableChild], model_sharded_state_dict: dict, is_loading: bool,
                       owner_is_main_replica: bool, metadata: Optional[dict],
                       buckets: Optional[DistributedOptimizerBuckets]) -> dict:
    """megatron-core's DistributedOptimizer layout (`fully_reshardable` written; read as the metadata
    says), or for an emerging optimizer its layer-wise chain: [LayerWiseDistributedOptimizer (the
    emerging optimizer's children, parameter-keyed, dense and expert ones merged as one optimizer:
    layer_wise_optimizer.py), DistributedOptimizer (the rest; with the matrices' DDP buffers the
    layer-wise one's)]. Our own earlier checkpoints (MEGATRON_CORE_DISTRIBUTED_LAYOUT) hold every
    child in the DistributedOptimizer's layout."""
    format_name = (metadata or {}).get("distrib_optim_sharding_type") if is_loading else "fully_reshardable"
    layout = READ_DISTRIBUTED_FORMATS[format_name]
    layer_wise = [layout_of(metadata) != MEGATRON_CORE_DISTRIBUTED_LAYOUT and kept_by_layer_wise(child)
                  for child in children]
    if any(layer_wise):
        _check_layer_wise_chain(children, layer_wise)
        buckets = buckets.after_layer_wise() if buckets is not None else None
    states = [child_sharded_state_dict(child, model_sharded_state_dict, is_loading, owner_is_main_replica,
                                       layer_wise=True) if kept
              else distributed_sharded_state(child, model_sharded_state_dict, layout, buckets, is_loading,
                                             owner_is_main_replica)
              for child, kept in zip(children, layer_wise)]
    if sum(layer_wise) > 1:  # the emerging optimizer's dense and expert children: one optimizer there
        kept = [index for index, keeps in enumerate(layer_wise) if keeps]
        merged = merged_by_optimizer([children[i] for i in kept], [states[i] for i in kept])
        states = merged + [state for state, keeps in zip(states, layer_wise) if not keeps]
    return states[0] if len(states) == 1 else _chained(states, metadata)


def _check_layer_wise_chain(children: list[CheckpointableChild], layer_wise: list[bool]) -> None:
    """megatron-core's layer-wise chain holds one optimizer for all of the emerging optimizer's
    parameters, dense and expert, first, and the others' after it in a DistributedOptimizer that
    takes no expert parameters (megatron-core's factory refuses them there, e.g. expert biases)."""
    names = [getattr(child, "name", "?") for child in children]
    experts_outside = [name for name, child, kept in zip(names, children, layer_wise)
                       if not kept and any(g.get("is_expert_parallel") for g in child.param_groups)]
    if layer_wise[0] and not experts_outside:
        return
    primary = run_optimizer(children[0].config)
    raise ValueError(
        f"megatron-core's layer-wise distributed-optimizer checkpoint holds the emerging optimizer's ({primary!r}) "
        f"dense and expert parameters first, then the others' in a DistributedOptimizer without expert "
        f"parameters; this chain has {names}"
        + (f", and {experts_outside} steps expert parameters outside {primary!r} (e.g. expert biases, which "
           f"megatron-core's factory refuses on this layout: build the experts without biases, "
           f"add_bias_linear=False)" if experts_outside else f", and its first child does not step {primary!r}")
        + ". Or save and load it with megatron_eopt.checkpointing.save_checkpoint, or without "
          "--use-distributed-optimizer.")


def _any_dtensor_sharded(children: list[CheckpointableChild]) -> bool:
    return any(isinstance(p.model, DTensor) for child in children if hasattr(child, "checkpoint_params")
               for p in child.checkpoint_params()[:1])


def _chained(states: list[dict], metadata: Optional[Mapping]) -> dict:
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    if adds_chain_prefix(metadata or {}):
        for index, state in enumerate(states):
            add_prefix_for_sharding(state, f"chained_{index}.")
    return dict(enumerate(states))


def written_by_distributed_optimizer(metadata: Optional[Mapping]) -> bool:
    """Whether a checkpoint holds megatron-core's DistributedOptimizer layout: its metadata names a
    distributed-optimizer format, with our mark of that layout or no mark (megatron-core wrote it).
    Refuses the formats we do not read."""
    metadata = metadata or {}
    sharding = metadata.get("distrib_optim_sharding_type")
    layout = metadata.get(LAYOUT_KEY, MEGATRON_CORE_DISTRIBUTED_LAYOUT)
    if sharding is None or layout not in DISTRIBUTED_LAYOUTS:
        return False
    if sharding not in READ_DISTRIBUTED_FORMATS:
        raise ValueError(
            f"the checkpoint holds megatron-core DistributedOptimizer state in its {sharding!r} format, which "
            f"megatron_eopt cannot read (only {sorted(READ_DISTRIBUTED_FORMATS)}): save it with "
            f"--dist-ckpt-optim-fully-reshardable, or load the model only (--no-load-optim). If megatron_eopt "
            f"wrote it before its megatron-core layout, set metadata[{LAYOUT_KEY!r}] = {EOPT_V1_LAYOUT!r}."
        )
    return True


def distributed_sharded_state(child: CheckpointableChild, model_sharded_state_dict: dict, layout: CoreFormat,
                              buckets: Optional[DistributedOptimizerBuckets], is_loading: bool,
                              owner_is_main_replica: bool) -> dict:
    """The child's state as megatron-core's DistributedOptimizer writes it in `layout` (one of
    READ_DISTRIBUTED_FORMATS; only `fully_reshardable` is written): per parameter its state and fp32
    main copy (`param`), keyed by the parameter (`optimizer.state.<name>.<key>`) or by the DDP bucket
    range it lies in; the param groups with the step. Loading asks for the main copies of 16-bit
    parameters only (an fp32 parameter's is the model's own)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    if is_loading:
        child.init_state()
    params = child.checkpoint_params()
    sharded_of = _sharded_params(params, model_sharded_state_dict, owner_is_main_replica)
    sharded = _bucket_sharded(params, buckets) if layout.keyed_by_bucket else _parameter_sharded(sharded_of)
    torch_state = torch_state_of(core_state_dict(child), core_format_of(child))
    mains = dict(enumerate(child.fp32_main_params()))
    shaped, own, scalars = _sorted_state(child, params, torch_state, is_loading)
    param_state = {}
    for i, tensors in shaped.items():
        if not is_loading or _main_copy_indices(params, [i]):
            tensors[DISTRIBUTED_MAIN_PARAM] = mains[i]
        param_state[i] = {name: sharded(i, name, value) for name, value in tensors.items()}
    step = scalars.pop("step", None)
    groups = [{**group, "params": LocalNonpersistentObject(group["params"]),
               **({"step": step.item() if torch.is_tensor(step) else step} if step is not None else {})}
              for group in torch_state["param_groups"]]
    state = {layout.param_state_key: param_state, SHARDING_TYPE_KEY: layout.sharding_type}
    if scalars:
        state[EXTRA_SCALARS] = scalars
    if own:
        state[OWN_STATE] = _own_sharded(own, sharded_of)
    if not layout.keyed_by_bucket:
        return {**state, "optimizer": {"param_groups": groups}}
    group_params = [group["params"] for group in torch_state["param_groups"]]
    return {**state, "optimizer": _bucket_common_state(buckets, "optimizer", groups),
            GROUP_PARAMS: LocalNonpersistentObject(group_params)}


def _parameter_sharded(sharded_of: Any):
    """(index, name, tensor) -> the tensor keyed `optimizer.state.<name>.<model key>`, as its parameter
    (`sharded_of(index)`: the parameter's ShardedTensor, _sharded_params)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    return lambda i, name, value: make_sharded_optimizer_tensor(sharded_of(i), value, f"{STATE_PREFIX}.{name}")


def _bucket_sharded(params: list[ChildParam], buckets: Optional[DistributedOptimizerBuckets]):
    """(index, name, tensor) -> the flattened tensor as its range of megatron-core's DDP bucket."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if buckets is None:
        raise ValueError("reading megatron-core's 'dp_reshardable' checkpoint needs the model's DDP bucket layout; "
                         "build the optimizer with megatron_eopt.get_megatron_optimizer(config, model_chunks).")
    places = buckets.places()
    for param in params:
        if id(param.model) not in places:
            raise ValueError(
                f"parameter {param.fqn!r} is in no dense DDP buffer of megatron-core's DistributedOptimizer "
                f"(an expert or layer-wise-managed one): its 'dp_reshardable' state is not read; save with "
                f"--dist-ckpt-optim-fully-reshardable.")

    def sharded(i: int, name: str, value: torch.Tensor) -> Any:
        place = places[id(params[i].model)]
        flat = value.detach().reshape(-1)
        return ShardedTensor(place.tensor_key(buckets.model_parallel_rank, name), flat, flat.dtype, tuple(flat.shape),
                             (place.bucket_numel_unpadded,), (place.start,), axis_fragmentations=None,
                             replica_id=(0, 0, buckets.dp_rank))

    return sharded


def _bucket_common_state(buckets: DistributedOptimizerBuckets, name: str, value: Any) -> Any:
    """megatron-core's DistributedOptimizer keeps its non-parameter state per model-parallel rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(f"optimizer.distributed.dp_group_idx_{buckets.model_parallel_rank}.{name}",
                         {"param_groups": value}, (1,), (0,), replica_id=(0, 0, buckets.dp_rank))


# ---------------------------------------------------------------- megatron-core's format -> our child


def core_chain_states(state_dict: Any) -> Optional[list]:
    """A chain's megatron-core state dict as a list of its children's, or None (ours).

    `state_dict()` gives one child's dict or a list; a sharded load `{i: child}`."""
    if isinstance(state_dict, list):
        return state_dict
    if isinstance(state_dict, Mapping):
        if state_dict and all(isinstance(key, int) for key in state_dict):
            return [state_dict[key] for key in sorted(state_dict)]
        if core_format_in(state_dict) is not None:
            return [state_dict]
    return None


def unpack_core_state_dict(state_dict: Mapping, params: list[ChildParam], config: Any,
                           ) -> tuple[dict, list[dict], dict[int, torch.Tensor], Optional[dict]]:
    """(torch state by index, saved param groups, fp32 main copies by index, grad scaler state) from
    megatron-core's format; the step spread to every parameter's state (where it has none of its own),
    each group's `optimizer` filled in. Changes nothing; refuses state of another shape than its parameter's."""
    layout = core_format_in(state_dict)
    torch_state = torch_state_of(state_dict, layout)
    shared = dict(state_dict.get(EXTRA_SCALARS) or {})
    mains = {}
    if layout.param_state_key is not None:  # DistributedOptimizer: the step in the groups, mains in the state
        entries = {i: dict(values) for i, values in state_dict[layout.param_state_key].items()}
        if layout.keyed_by_bucket:
            entries = {i: _unflattened(i, values, params) for i, values in entries.items()}
        for index, values in entries.items():
            main = values.pop(DISTRIBUTED_MAIN_PARAM, None)
            if main is not None and index in _main_copy_indices(params, [index]):
                mains[index] = main
        steps = {group["step"] for group in torch_state["param_groups"] if group.get("step") is not None}
        if steps:
            shared["step"] = torch.tensor(float(steps.pop()))
    else:
        entries = dict(torch_state["state"])
    if COMMON_STEP in entries:
        shared["step"] = entries.pop(COMMON_STEP)
    own = state_dict.get(OWN_STATE) or {}
    state = {}
    for index in {*entries, *own}:
        values = entries.get(index, {})
        _check_shapes(index, values, params)
        # a parameter's own scalars (a moved one's fresh step: moved_state.py) before the child's shared ones
        state[index] = {**{name: _copy(value) for name, value in shared.items()}, **values, **own.get(index, {})}
    primary = run_optimizer(config)
    groups = [{**group, "optimizer": group.get("optimizer") or primary} for group in torch_state["param_groups"]]
    if GROUP_PARAMS in state_dict:  # dp_reshardable: ours, by position, as the other formats' merge gives them
        groups = [{**group, "params": params_of} for group, params_of in zip(groups, state_dict[GROUP_PARAMS])]
    if layout.main_params_key is not None:
        for group, values in zip(groups, _by_group(state_dict.get(layout.main_params_key))):
            mains.update(zip(_main_copy_indices(params, list(group["params"])), values))
    return state, groups, mains, state_dict.get("grad_scaler")


def _by_group(main_copies: Any) -> list:
    """Main copies per param group: a list, or megatron-core's layer-wise `{group index: list}`."""
    if isinstance(main_copies, Mapping):
        return [main_copies[i] for i in sorted(main_copies)]
    return list(main_copies or [])


def _check_shapes(index: Any, values: Mapping, params: list[ChildParam]) -> None:
    if not isinstance(index, int) or not 0 <= index < len(params):
        raise ValueError(f"megatron-core optimizer state for parameter index {index!r}, but this optimizer "
                         f"steps {len(params)} parameters: the checkpoint is of another model or optimizer.")
    shape = tuple(params[index].model.shape)
    for name, value in values.items():
        if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shape:
            raise ValueError(
                f"megatron-core optimizer state {name!r} at index {index} has shape {tuple(value.shape)}, but "
                f"parameter {params[index].fqn!r} there has shape {shape}: the checkpoint is of another model "
                f"(or another parameter order)."
            )


def _unflattened(index: Any, values: Mapping, params: list[ChildParam]) -> dict:
    """A parameter's state read flat from its DDP bucket range, in the parameter's shape."""
    _check_shapes(index, {}, params)
    shape = params[index].model.shape
    unflattened = {}
    for name, value in values.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == params[index].model.numel():
            value = value.view(shape)
        unflattened[name] = value
    return unflattened


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


# ------------------------------ our layout before megatron-core's (EOPT_V1_LAYOUT): read, and written when asked

V1_COMMON_STATE = "common_state"


def v1_child_sharded_state_dict(child: CheckpointableChild, model_sharded_state_dict: dict, is_loading: bool,
                                owner_is_main_replica: bool) -> dict:
    """The child's flat `state_dict()` with tensors keyed `optimizer.<child>.state.<name>.<model key>`
    (expert children under the dense name) and `optimizer.<child>.fp32_param.<model key>`, scalar
    state once per name under 'common_state'."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if is_loading:
        child.init_state()
    state_dict = child.local_state_dict()
    params = child.checkpoint_params()
    sharded_of = _sharded_params(params, model_sharded_state_dict, owner_is_main_replica)
    index_of = {p.fqn: i for i, p in enumerate(params)}
    prefix = f"optimizer.{stored_child_name(child.name).replace('/', '.')}"
    tensors, common = {}, {}
    for fqn, entries in state_dict["state"].items():
        for name, value in entries.items():
            if _is_parameter_shaped(child, name, value, params[index_of[fqn]]):
                tensors[f"{fqn}/{name}"] = make_sharded_optimizer_tensor(sharded_of(index_of[fqn]), value,
                                                                         f"{prefix}.state.{name}")
            else:
                _add_common(common, name, value, fqn)
    state_dict["state"] = tensors
    state_dict[V1_COMMON_STATE] = common
    state_dict["main_params"] = {
        fqn: make_sharded_optimizer_tensor(sharded_of(index_of[fqn]), main, f"{prefix}.fp32_param")
        for fqn, main in state_dict.get("main_params", {}).items()
    }
    for group in state_dict["param_groups"].values():
        for key in ("params", "param_fqns"):
            if key in group:
                group[key] = LocalNonpersistentObject(group[key])
    return state_dict


def expand_v1_sharded_state_dict(state_dict: dict) -> dict:
    """What `dist_checkpointing.load` returned for the v1 layout -> the child's flat `state_dict()`."""
    if V1_COMMON_STATE not in state_dict:
        return state_dict
    state: dict[str, dict[str, Any]] = {}
    for key, value in state_dict["state"].items():
        fqn, name = key.rsplit("/", 1)
        state.setdefault(fqn, {})[name] = value
    for entries in state.values():
        for name, value in state_dict[V1_COMMON_STATE].items():
            entries[name] = _copy(value)
    rest = {k: v for k, v in state_dict.items() if k not in ("state", V1_COMMON_STATE)}
    return {**rest, "state": state}


def checkpoint_optimizer_layout(checkpoint_dir: str, content_metadata: Optional[Mapping] = None) -> Optional[str]:
    """The optimizer layout a torch_dist checkpoint holds, from its keys and content metadata (read
    when not given): MEGATRON_CORE_LAYOUT (`[chained_i.]optimizer.state.*`), or with a distributed
    format MEGATRON_CORE_PING_PONG_LAYOUT; EOPT_V1_LAYOUT (`optimizer.<child>.state.*`); None (no
    optimizer state, or DistributedOptimizer's: `optimizer.distributed.*`, `optimizer.state.param.*`,
    which the metadata's format names). Put it in the load's metadata under LAYOUT_KEY."""
    from megatron.core.dist_checkpointing import load_content_metadata
    from torch.distributed.checkpoint import FileSystemReader

    bare_keys = [key.split(".", 1)[1] if key.startswith("chained_") else key
                 for key in FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata]
    if any(key.startswith(("optimizer.distributed.", f"{STATE_PREFIX}.{DISTRIBUTED_MAIN_PARAM}.")) for key in bare_keys):
        return None
    for bare in bare_keys:
        if bare.startswith(f"{STATE_PREFIX}."):
            if content_metadata is None:
                content_metadata = load_content_metadata(checkpoint_dir) or {}
            distributed = content_metadata.get("distrib_optim_sharding_type") is not None
            return MEGATRON_CORE_PING_PONG_LAYOUT if distributed else MEGATRON_CORE_LAYOUT
        if bare.startswith("optimizer.") and (".state." in bare or bare.endswith(".fp32_param")
                                              or ".fp32_param." in bare):
            return EOPT_V1_LAYOUT
    return None


# ---------------------------------------------------------------- helpers


def _as_main_replica(sharded: Any, owner_is_main_replica: bool) -> Any:
    """The layer-wise owner writes the state: the data-parallel part of its replica id is 0."""
    if not owner_is_main_replica:
        return sharded
    replica_id = sharded.replica_id
    if isinstance(replica_id, tuple) and replica_id:
        return replace(sharded, replica_id=(*replica_id[:-1], 0))
    return replace(sharded, replica_id=0)


PARAMETER_SHAPED, SCALAR, OWN_SHAPED = "parameter-shaped", "scalar", "own-shaped"


def _state_kind(value: Any, param: ChildParam) -> str:
    """PARAMETER_SHAPED, SCALAR, or OWN_SHAPED (a tensor of another shape, SOAP's lists of factors, ...)."""
    if torch.is_tensor(value) and value.dim() > 0:
        return PARAMETER_SHAPED if value.shape == param.model.shape else OWN_SHAPED
    return SCALAR if torch.is_tensor(value) or isinstance(value, (bool, int, float, str)) else OWN_SHAPED


def _is_parameter_shaped(child: CheckpointableChild, name: str, value: Any, param: ChildParam) -> bool:
    """The layout before megatron-core's (v1) holds parameter-shaped and scalar state only."""
    kind = _state_kind(value, param)
    if kind == OWN_SHAPED:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(
            f"optimizer {child.name!r} keeps state {name!r} ({shape}) for parameter {param.fqn!r} of shape "
            f"{tuple(param.model.shape)}; the {EOPT_V1_LAYOUT!r} layout holds parameter-shaped and scalar state "
            f"only. Save in megatron-core's layout (the default) or with megatron_eopt.checkpointing.save_checkpoint.")
    return kind == PARAMETER_SHAPED


def _sorted_state(child: CheckpointableChild, params: list[ChildParam], torch_state: Mapping, is_loading: bool,
                  ) -> tuple[dict, dict, dict]:
    """(parameter-shaped state, own-shaped state) by parameter index, and scalar state once per name.
    Saving own-shaped state says which megatron-core's optimizer will not read."""
    shaped, own, scalars = {}, {}, {}
    for i, entries in torch_state["state"].items():
        shaped[i] = {}
        for name, value in entries.items():
            kind = _state_kind(value, params[i])
            if kind == PARAMETER_SHAPED:
                shaped[i][name] = value
            elif kind == OWN_SHAPED:
                own.setdefault(i, {})[name] = value
            else:
                _add_common(scalars, name, value, params[i].fqn)
    if own and not is_loading:
        names = sorted({name for entries in own.values() for name in entries})
        warn_once(f"megatron-core drops {child.name} {names}",
                  f"optimizer {child.name!r}'s state {names} is not shaped like its parameters; the checkpoint keeps "
                  f"it under {OWN_STATE!r}, which megatron_eopt reads at the same parallel layout and megatron-core's "
                  f"optimizer does not read: loading this checkpoint into megatron-core drops it.")
    return shaped, own, scalars


def _own_sharded(own: dict, sharded_of: Any) -> dict:
    """Own-shaped state as objects, one per parameter shard, keyed by it:
    `eopt_own_state.<name>.<model key>.chunk_<its place among the shards>` (a fused weight's
    factory: its first part's place). Read back at the same parallel layout only."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    objects = {}
    for i, entries in own.items():
        param = sharded_of(i)
        place = next(iter(nested_values(param.build()))) if isinstance(param, ShardedTensorFactory) else param
        chunk = "_".join(map(str, place.local_chunk_offset_in_global()))
        objects[i] = {name: ShardedObject(f"{OWN_STATE}.{name}.{param.key}.chunk_{chunk}", value, (1,), (0,),
                                          replica_id=param.replica_id)
                      for name, value in entries.items()}
    return objects


def _add_common(common: dict, name: str, value: Any, fqn: str) -> None:
    if name not in common:
        common[name] = value
        return
    if not _same(common[name], value):
        raise ValueError(
            f"state {name!r} differs between parameters (e.g. {fqn!r}); megatron-core's sharded "
            f"format keeps one value per scalar state. Use megatron_eopt.checkpointing.save_checkpoint."
        )


class ProbedState(NamedTuple):
    """What a fresh optimizer keeps beside parameter-shaped state, by state name."""

    per_parameter_scalars: tuple[str, ...]  # one number per parameter (muon_hyperball's 'hyperball_R')
    other_shaped: tuple[str, ...]  # tensors of another shape (normuon's per-column second moment, SOAP's factors)


@functools.cache
def probe_state(optimizer: str, fields: tuple[tuple[str, Any], ...] = ()) -> ProbedState:
    """The state `optimizer` (with these OptimizerConfig `fields`) keeps that a checkpoint format
    may have no place for, sorted by the save's own rule (`_state_kind`, `_add_common`): built
    on two small matrices of different norms (cached). Nothing for one that cannot be built on them."""
    from megatron_eopt.config.optimizer_config import OptimizerConfig
    from megatron_eopt.registry import lookup_optimizer

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4, generator=generator) * scale) for scale in (1.0, 3.0)]
    try:
        config = OptimizerConfig(optimizer=optimizer, lr=1e-3, **dict(fields))
        inner = lookup_optimizer(optimizer).build([{"params": params, "lr": 1e-3, "weight_decay": 0.0}], config)
    except (TypeError, ValueError):  # e.g. sinkhorn_muon takes only Sinkhorn-normalized matrices
        return ProbedState((), ())
    states = [inner.state.get(param, {}) for param in params]
    kinds = {name: _state_kind(value, ChildParam("probe", params[0], params[0], states[0], "probe"))
             for name, value in states[0].items()}
    scalars = [name for name, kind in kinds.items()
               if kind == SCALAR and name in states[1] and not _same(states[0][name], states[1][name])]
    return ProbedState(tuple(sorted(scalars)), tuple(sorted(name for name, kind in kinds.items() if kind == OWN_SHAPED)))


def _same(first: Any, second: Any) -> bool:
    return torch.equal(first, second) if torch.is_tensor(first) else first == second
