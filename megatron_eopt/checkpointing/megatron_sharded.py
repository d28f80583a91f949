"""`sharded_state_dict` in megatron-core's format, for Megatron-LM and Megatron-Bridge trainers.

A trainer calls `optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading)` and hands
the result to megatron-core's `dist_checkpointing.save/load`, then `optimizer.load_state_dict`
with what `load` returned. Each parameter-shaped state tensor (and fp32 main copy) becomes the
model parameter's ShardedTensor (or factory, e.g. the gated fc1's) re-keyed
`optimizer.<child>.state.<name>.<model key>`, as megatron-core's own optimizers do, so
megatron-core reshards it over TP/DP; the model's keys carry global layer and expert offsets, so
the optimizer's do too at any PP/EP size (expert state keyed under the dense child's name). With
the layer-wise optimizer the owner writes a parameter's state as the main replica (only the
owner has it). Scalar state (Adam's `step`) is one value per state name (every parameter has
taken the same steps); the parameter lists of the groups stay local (not saved), everything
else is common to all ranks (megatron-core saves rank 0's copy).
"""

from typing import Any

import torch

from megatron_eopt.params.groups import stored_child_name
from megatron_eopt.wrappers.base import CheckpointableChild

COMMON_STATE = "common_state"


def child_sharded_state_dict(
    child: CheckpointableChild, model_sharded_state_dict: dict, is_loading: bool, owner_is_main_replica: bool
) -> dict:
    """The child's `state_dict()` with its tensors replaced by megatron-core sharded tensors."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    if is_loading:
        child.init_state()
    state_dict = child.state_dict()
    params = child.checkpoint_params()
    by_index = get_param_id_to_sharded_param_map(model_sharded_state_dict, [p.model for p in params])
    sharded_of = {params[i].fqn: _as_main_replica(s, owner_is_main_replica) for i, s in by_index.items()}
    # Expert state is keyed under the dense child's name: at EP=1 megatron-core makes experts
    # dense parameters (param_groups.stored_child_name), and the keys must not depend on EP.
    prefix = f"optimizer.{stored_child_name(child.name).replace('/', '.')}"
    param_of = {p.fqn: p.model for p in params}
    tensors, common = {}, {}
    for fqn, entries in state_dict["state"].items():
        for name, value in entries.items():
            param = param_of[fqn]
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
                tensors[f"{fqn}/{name}"] = make_sharded_optimizer_tensor(_sharded(sharded_of, fqn), value, f"{prefix}.state.{name}")
            elif (torch.is_tensor(value) and value.dim() == 0) or isinstance(value, (bool, int, float, str)):
                _add_common(common, name, value, fqn)
            else:
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(
                    f"optimizer {child.name!r} keeps state {name!r} ({shape}) for parameter {fqn!r} of "
                    f"shape {tuple(param.shape)}; megatron-core's sharded format holds parameter-shaped "
                    f"and scalar state only. Use megatron_eopt.checkpointing.save_checkpoint for this optimizer."
                )
    state_dict["state"] = tensors
    state_dict[COMMON_STATE] = common
    state_dict["main_params"] = {
        fqn: make_sharded_optimizer_tensor(_sharded(sharded_of, fqn), main, f"{prefix}.fp32_param")
        for fqn, main in state_dict.get("main_params", {}).items()
    }
    for group in state_dict["param_groups"].values():  # which parameters: this rank's own business
        for key in ("params", "param_fqns"):
            if key in group:
                group[key] = LocalNonpersistentObject(group[key])
    return state_dict


def expand_sharded_state_dict(state_dict: dict) -> dict:
    """What `dist_checkpointing.load` returned -> the child's usual `state_dict()` format."""
    if COMMON_STATE not in state_dict:
        return state_dict
    state: dict[str, dict[str, Any]] = {}
    for key, value in state_dict["state"].items():
        fqn, name = key.rsplit("/", 1)
        state.setdefault(fqn, {})[name] = value
    for entries in state.values():
        for name, value in state_dict[COMMON_STATE].items():
            entries[name] = value.clone() if torch.is_tensor(value) else value
    rest = {k: v for k, v in state_dict.items() if k not in ("state", COMMON_STATE)}
    return {**rest, "state": state}


def _sharded(sharded_of: dict, fqn: str) -> Any:
    if fqn not in sharded_of:
        raise ValueError(
            f"parameter {fqn!r} has no entry in the model's sharded_state_dict; build it with "
            f"the model's own sharded_state_dict() (its tensors must be the parameters themselves)."
        )
    return sharded_of[fqn]


def _as_main_replica(sharded: Any, owner_is_main_replica: bool) -> Any:
    """The layer-wise owner writes the state: the data-parallel part of its replica id is 0."""
    from dataclasses import replace

    if not owner_is_main_replica:
        return sharded
    replica_id = sharded.replica_id
    if isinstance(replica_id, tuple) and replica_id:
        return replace(sharded, replica_id=(*replica_id[:-1], 0))
    return replace(sharded, replica_id=0)


def _add_common(common: dict, name: str, value: Any, fqn: str) -> None:
    if name not in common:
        common[name] = value
        return
    same = torch.equal(common[name], value) if torch.is_tensor(value) else common[name] == value
    if not same:
        raise ValueError(
            f"state {name!r} differs between parameters (e.g. {fqn!r}); megatron-core's sharded "
            f"format keeps one value per scalar state. Use megatron_eopt.checkpointing.save_checkpoint."
        )
