"""A chain's state dict in torch's optimizer layout, keyed by the model's parameters.

`ChainedOptimizer.state_dict()` is what torch's optimizers write: `{"state": {position: {name: value}},
"param_groups": [{every group value, "params": [positions], "param_names": [fqns]}]}`, positions counting
the model's parameters in `param_groups` order, so `torch.save` takes it and torch's DCP helpers
(`get_/set_optimizer_state_dict`; AReaL, torchtitan) name its entries as for torch's optimizers.
Values are as the child's `state_dict()` holds them: DTensors under FSDP2 and Megatron-FSDP (DCP
reshards them), plain tensors otherwise; a 16-bit parameter's fp32 main copy is the state
`fp32_param`, an fp16 run's loss scaler the top-level `grad_scaler`. Empty groups (a layer-wise
rank's unowned ones) are left out; a megatron-core routed expert (EP) is keyed by its global name.
A load matches parameters by name within each group, goes through each child's checked
`load_state_dict`, and refuses state the live optimizer keeps but the dict lacks.
"""

from typing import Any, Callable, Mapping

import torch
from torch.distributed.tensor import DTensor

from megatron_eopt.checkpointable.child import CheckpointableChild, ChildParam

# A 16-bit parameter's fp32 main copy, as one more state of it (megatron-core's name for the copy).
MAIN_PARAM = "fp32_param"
GRAD_SCALER = "grad_scaler"
OPTIMIZER_CLASS = "optimizer_class"  # the inner torch optimizer's class, in each saved group
Group = tuple[dict, list[ChildParam]]  # a live param group and its parameters as checkpoints see them


class TorchOptimizerView:
    """One child (FP32Optimizer or a subclass) in torch's optimizer layout (module docstring)."""

    def __init__(self, child: CheckpointableChild) -> None:
        self.child = child

    @property
    def groups(self) -> list[Group]:
        """The child's non-empty param groups with their parameters."""
        return _groups(self.child)

    def state_dict(self, first: int = 0, is_loading: bool = False) -> dict:
        """torch's layout with positions from `first` on; each value as the child's `state_dict()`
        holds it (DTensors under FSDP2: a collective over the parameters' mesh)."""
        flat = self.child.state_dict(is_loading=is_loading)
        state, groups, index = {}, [], first
        for group, members in self.groups:
            keys = [_state_key(param, position) for position, param in enumerate(members, start=index)]
            for key, param in zip(keys, members):
                entries = _entries(flat, param, _flat_name(param))
                if entries:
                    state[key] = entries
            kept = {key: value for key, value in group.items() if key != "params"}  # as torch's optimizers save
            groups.append({**kept, "params": keys,
                           "param_names": [p.fqn for p in members], OPTIMIZER_CLASS: self.child.inner_class_name()})
            index += len(members)
        return {"state": state, "param_groups": groups}

    def flat_state_dict(self, state: Mapping, saved_groups: list[Mapping]) -> dict:
        """The child's own layout for its `load_state_dict`, from `saved_groups` (this child's, in
        `groups` order) with their parameters' state in `state`, keyed by position or by name:
        the hyperparameters and every state this optimizer keeps, checked (ValueError) first."""
        live = self.groups
        _check_names(self.child, live, saved_groups)
        loaded, mains = {}, {}
        for (_, members), saved in zip(live, saved_groups):
            for param, key in zip(members, saved["params"]):
                # a routed expert by its own global name: the groups a DCP load gives back are one rank's
                entries = dict(state.get(param.stored_name if param.globally_named else key, {}))
                if MAIN_PARAM in entries:
                    mains[param.stored_name] = entries.pop(MAIN_PARAM)
                loaded[param.stored_name] = entries
        hyperparameters = {group["group_key"]: saved for (group, _), saved in zip(live, saved_groups)}
        saved_classes = {group.get(OPTIMIZER_CLASS) for group in saved_groups} - {None}
        flat = self._flat(hyperparameters, loaded, mains, min(saved_classes, default=self.child.inner_class_name()))
        self.child.check_state_dict(flat)  # the optimizer class, the groups and the shapes
        self._check_complete(live, loaded, mains)
        return flat

    def _check_complete(self, live_groups: list[Group], state: dict[str, dict], mains: dict[str, Any]) -> None:
        """Every state the live optimizer keeps is loaded, as a tensor or number: torch's helpers
        fill what the checkpoint lacks with nothing ({} in the flattened layout), and an optimizer
        loaded so would restart from zero without a word."""
        self.child.init_state()
        live = self.child.local_state_dict()
        for _, members in live_groups:
            for param in members:
                expected = set(_entries(live, param, param.fqn))
                loaded = {name for name, value in state[param.stored_name].items() if _is_value(value)}
                if param.stored_name in mains and _is_value(mains[param.stored_name]):
                    loaded.add(MAIN_PARAM)
                missing = sorted(expected - loaded)
                if missing:
                    raise ValueError(
                        f"optimizer {self.child.name!r}: the state dict restores no {missing} for parameter "
                        f"{param.fqn!r} (it holds {sorted(loaded)}); loading it would restart that state from zero. "
                        f"Load a state dict saved from this model and optimizer, or load the model only.")

    def _flat(self, hyperparameters: dict[str, Mapping], state: dict, mains: dict, optimizer_class: str) -> dict:
        """The child's own state-dict layout (wrappers/flat_state.py), keyed by stored name: empty
        groups keep their live hyperparameters."""
        names = {id(p.main): p.stored_name for p in self.child.checkpoint_params()}
        groups = {}
        for group in self.child.param_groups:
            saved = hyperparameters.get(group["group_key"], group)
            groups[group["group_key"]] = {**_hyperparameters(self.child, saved),
                                          "params": [names[id(main)] for main in group["params"]]}
        flat = {OPTIMIZER_CLASS: optimizer_class, "param_groups": groups, "state": state,
                "grad_scaler": None}
        return {**flat, "main_params": mains} if mains else flat


def chain_state_dict(children: list[CheckpointableChild], is_loading: bool = False) -> dict:
    """The children's state in torch's layout, positions counted over all of them in chain order."""
    state, groups = {}, []
    for child in children:
        part = TorchOptimizerView(child).state_dict(first=sum(len(g["params"]) for g in groups), is_loading=is_loading)
        state.update(part["state"])
        groups += part["param_groups"]
    result = {"state": state, "param_groups": groups}
    scalers = _scalers(children)
    if scalers:
        result[GRAD_SCALER] = scalers[0].state_dict()
    return result


def is_torch_layout(state_dict: Any, children: list[CheckpointableChild]) -> bool:
    """Whether `state_dict` is `chain_state_dict`'s for `children`, as saved or as torch's helpers hand it
    over (its groups' parameters named), or as torchtitan's flat helpers do (by position, the groups'
    `group_key`s those of the live non-empty groups, in order). megatron-core's FP32Optimizer writes
    torch's layout too, one child's, its parameters by position alone."""
    if not (isinstance(state_dict, Mapping) and isinstance(state_dict.get("state"), Mapping)
            and isinstance(state_dict.get("param_groups"), list)):
        return False
    saved = [group for group in state_dict["param_groups"] if group.get("params")]
    if all("param_names" in group or all(isinstance(key, str) for key in group["params"]) for group in saved):
        return True
    live_keys = [group["group_key"] for child in children for group, _ in _groups(child)]
    return [group.get("group_key") for group in saved] == live_keys


def load_chain_state_dict(children: list[CheckpointableChild], state_dict: Mapping,
                          check_then_load: Callable[[list[tuple[Any, Any]]], None]) -> None:
    """torch's layout back into the children: its non-empty groups in chain order (torch's helpers
    hand every group over, empty ones included), each child's checked before any child loads."""
    saved = [group for group in state_dict["param_groups"] if group["params"]]
    views = [TorchOptimizerView(child) for child in children]
    sizes = [len(view.groups) for view in views]
    if len(saved) != sum(sizes):
        raise ValueError(
            f"the state dict has {len(saved)} non-empty param groups, this optimizer {sum(sizes)} "
            f"({dict(zip([child.name for child in children], sizes))}); it was saved from another model, "
            f"optimizer or parameter routing.")
    scalers = _scalers(children)
    if scalers and state_dict.get(GRAD_SCALER) is None:
        raise ValueError("the state dict restores no fp16 loss-scaler state ('grad_scaler'), which this optimizer "
                         "keeps; load a state dict saved by optimizer.state_dict() of an fp16 run.")
    loads, start = [], 0
    for view, size in zip(views, sizes):
        loads.append((view.child, view.flat_state_dict(state_dict["state"], saved[start:start + size])))
        start += size
    check_then_load(loads)
    for scaler in scalers:
        scaler.load_state_dict(state_dict[GRAD_SCALER])


def _scalers(children: list[CheckpointableChild]) -> list[Any]:
    found = {id(c.grad_scaler): c.grad_scaler for c in children if getattr(c, "grad_scaler", None) is not None}
    return list(found.values())


def _groups(child: CheckpointableChild) -> list[Group]:
    by_main = {id(p.main): p for p in child.checkpoint_params()}
    return [(group, [by_main[id(main)] for main in group["params"]]) for group in child.param_groups
            if group["params"]]


def _hyperparameters(child: CheckpointableChild, group: Mapping) -> dict:
    """The inner optimizer's hyperparameters (its `defaults`' keys) of `group`: our own fields
    (`default_config`, `param_fqns`, ...) say how the run grouped its parameters and stay live."""
    return {key: group[key] for key in child.hyperparameter_names() if key in group}


def _state_key(param: ChildParam, position: int) -> int | str:
    """A parameter's key in `state`: its position, as torch's; a routed expert of megatron-core's
    expert parallelism is keyed by its global name (its stored name), as the EP ranks' experts at one
    position are different experts that a DCP save of the state dict would otherwise write as one."""
    return param.stored_name if param.globally_named else position


def _flat_name(param: ChildParam) -> str:
    """A parameter's key in the child's `state_dict()`: DTensor state is keyed by stored name."""
    return param.stored_name if isinstance(param.model, DTensor) else param.fqn


def _entries(flat: Mapping, param: ChildParam, name: str) -> dict:
    entries = dict(flat["state"].get(name, {}))
    main = (flat.get("main_params") or {}).get(name)
    return {**entries, MAIN_PARAM: main} if main is not None else entries


def _check_names(child: CheckpointableChild, live: list[Group], saved: list[Mapping]) -> None:
    """The saved groups hold this child's parameters, group by group (by name where the dict names
    them: torch's `param_names`, or the names torch's helpers put under `params`)."""
    for (_, members), group in zip(live, saved):
        names = group.get("param_names")
        if names is None and all(isinstance(key, str) for key in group["params"]):
            names = group["params"]
        expected = [p.fqn for p in members]
        if len(group["params"]) != len(members) or (names is not None and list(names) != expected):
            raise ValueError(
                f"optimizer {child.name!r}: a saved param group holds {list(names or group['params'])[:4]}... "
                f"({len(group['params'])} parameters) where this optimizer's holds {expected[:4]}... ({len(members)}); "
                f"it was saved from another model, optimizer or parameter routing.")


def _is_value(value: Any) -> bool:
    """A state value: a tensor, a number, or a list of them (PSGD-Pro's Kronecker factors)."""
    if isinstance(value, (list, tuple)):
        return all(_is_value(item) for item in value)
    return torch.is_tensor(value) or isinstance(value, (bool, int, float))
