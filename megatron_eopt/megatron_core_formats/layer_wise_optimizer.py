"""megatron-core's layer-wise chains keep one optimizer per optimizer name, its dense and expert
parameters together; ours keeps one per (optimizer, dense|expert). Both ways here.

megatron-core's `_get_megatron_emerging_optimizer` does not split expert param groups off in
layer-wise mode, so with MoE its "ping-pong" chain is [Muon: dense groups, expert groups; Adam: the
same], and its layout-path chain (`use_layer_wise_param_layout`) [LayerWiseDistributedOptimizer(Muon:
dense groups, expert groups), DistributedOptimizer(Adam: dense groups only)]. `merged_by_optimizer`
joins our children's megatron-core state dicts (dist_checkpointing.py's `child_sharded_state_dict`,
layer-wise) in that order: param groups concatenated, parameter and group indices shifted, the step
once. Each merged dict carries, as a local object that is never saved, which of our children it
holds; `split_merged` cuts a loaded one back along it.
"""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from megatron_eopt.megatron_core_formats.layouts import (
    COMMON_STEP,
    EXTRA_SCALARS,
    OWN_STATE,
    core_format_in,
    torch_state_of,
)
from megatron_eopt.config.optimizer_names import run_optimizer

MEMBERS_KEY = "eopt_merged_children"
_GROUP_PARAMS = "params"


class Member(NamedTuple):
    """One of our children inside a merged state dict: its groups and parameters from these offsets."""

    name: str
    first_group: int
    groups: int
    first_param: int
    params: int


def merged_by_optimizer(children: list[Any], states: list[dict]) -> list[dict]:
    """Our children's states, one per optimizer name in the order the names first appear (dense
    children come before expert ones, as ours are built)."""
    names = [child.name for child in children]
    optimizer_names = [child.param_groups[0].get("optimizer") or run_optimizer(child.config) for child in children]
    order = list(dict.fromkeys(optimizer_names))
    return [_merged([(n, s) for n, o, s in zip(names, optimizer_names, states) if o == optimizer])
            for optimizer in order]


def _merged(named_states: list[tuple[str, dict]]) -> dict:
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    layout = core_format_in(named_states[0][1])
    merged_torch = {"state": {}, "param_groups": []}
    merged = merged_torch if layout.torch_state_key is None else {layout.torch_state_key: merged_torch}
    if layout.main_params_key is not None:
        merged[layout.main_params_key] = {}
    members, first_param = [], 0
    for name, state_dict in named_states:
        torch_state = torch_state_of(state_dict, layout)
        first_group = len(merged_torch["param_groups"])
        params = _param_count(torch_state["param_groups"])
        members.append(Member(name, first_group, len(torch_state["param_groups"]), first_param, params))
        for group in torch_state["param_groups"]:
            indices = [first_param + i for i in _local(group[_GROUP_PARAMS])]
            merged_torch["param_groups"].append({**group, _GROUP_PARAMS: LocalNonpersistentObject(indices)})
        for index, entries in _local(torch_state["state"]).items():
            if index == COMMON_STEP:
                _add_step(merged_torch["state"], entries, name)
            else:
                merged_torch["state"][first_param + index] = entries
        if layout.main_params_key is not None:
            for index, mains in state_dict[layout.main_params_key].items():
                merged[layout.main_params_key][first_group + index] = mains
        for index, entries in (state_dict.get(OWN_STATE) or {}).items():
            merged.setdefault(OWN_STATE, {})[first_param + index] = entries
        for key in (EXTRA_SCALARS, "grad_scaler"):  # one per chain, as megatron-core keeps them
            if key in state_dict:
                merged[key] = state_dict[key]
        first_param += params
    if not merged_torch["state"]:
        merged_torch["state"] = LocalNonpersistentObject({})  # as megatron-core's layer-wise child writes it
    merged[MEMBERS_KEY] = LocalNonpersistentObject(members)
    return merged


def _add_step(state: dict, step: Any, name: str) -> None:
    """megatron-core's child keeps one step; ours take every step together, so theirs agree."""
    if COMMON_STEP in state and not torch.equal(torch.as_tensor(state[COMMON_STEP]), torch.as_tensor(step)):
        raise ValueError(f"optimizer {name!r} is at step {step}, the optimizer it is saved with at "
                         f"{state[COMMON_STEP]}; megatron-core's layer-wise chain keeps one step for both.")
    state[COMMON_STEP] = step


def _param_count(groups: list[dict]) -> int:
    indices = [i for group in groups for i in _local(group[_GROUP_PARAMS])]
    return max(indices) + 1 if indices else 0


def _local(value: Any) -> Any:
    return value.unwrap() if hasattr(value, "unwrap") else value


def split_merged(states: list[Any], names: list[str]) -> list[tuple[Optional[str], Any]]:
    """(our child's name, its state) for each loaded state, cut along its members. Without a merged
    state, (None, state) for each; with one, a state that is not merged (the DistributedOptimizer
    after megatron-core's layer-wise one) takes the next of the chain's `names` no member claims."""
    split = []
    for state_dict in states:
        members = state_dict.get(MEMBERS_KEY) if isinstance(state_dict, Mapping) else None
        if members is None:
            split.append((None, state_dict))
            continue
        split += [(member.name, _member_state(state_dict, Member(*member))) for member in members]
    if all(name is None for name, _ in split):
        return split
    unclaimed = iter([name for name in names if name not in {claimed for claimed, _ in split}])
    return [(name if name is not None else next(unclaimed, f"(unnamed state {index})"), state)
            for index, (name, state) in enumerate(split)]


def _member_state(state_dict: Mapping, member: Member) -> dict:
    layout = core_format_in(state_dict)
    torch_state = torch_state_of(state_dict, layout)
    params = range(member.first_param, member.first_param + member.params)
    groups = range(member.first_group, member.first_group + member.groups)
    loaded = _local(torch_state["state"])
    state = {index - member.first_param: loaded[index] for index in params if index in loaded}
    if state and COMMON_STEP in loaded:
        state[COMMON_STEP] = loaded[COMMON_STEP]
    param_groups = [{**torch_state["param_groups"][g],
                     _GROUP_PARAMS: [i - member.first_param for i in torch_state["param_groups"][g][_GROUP_PARAMS]]}
                    for g in groups]
    own_torch = {"state": state, "param_groups": param_groups}
    own = own_torch if layout.torch_state_key is None else {layout.torch_state_key: own_torch}
    if layout.main_params_key is not None:
        mains = state_dict[layout.main_params_key]
        own[layout.main_params_key] = {g - member.first_group: mains[g] for g in groups if g in mains}
    shifted_own = {index - member.first_param: entries for index, entries in (state_dict.get(OWN_STATE) or {}).items()
                   if index in params}
    if shifted_own:
        own[OWN_STATE] = shifted_own
    for key in (EXTRA_SCALARS, "grad_scaler"):
        if key in state_dict:
            own[key] = state_dict[key]
    return own
