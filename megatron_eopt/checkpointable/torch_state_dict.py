"""Each child of a chain as torch's state-dict helpers read a torch optimizer.

`torch.distributed.checkpoint.state_dict`'s helpers (`get_/set_optimizer_state_dict`,
`get_/set_state_dict`; AReaL, torchtitan, flattened or nested) and torchtitan 0.3's own flat ones
take a torch optimizer or an iterable of them, and read `param_groups` (parameters named by
identity through `model.named_parameters()`, or by `param_names`), `state` keyed by them,
`state_dict()` / `load_state_dict()` in torch's format. Our children's inner optimizers step
other tensors than the model's parameters (FSDP2 shard aliases, fp32 copies of 16-bit ones), which
the helpers cannot name (`KeyError: 0`). So a chain iterates over one `TorchOptimizerView` per
child (`ChainedOptimizer.__iter__`): the model's parameters, each one's state as the child's
`state_dict()` holds it (DTensors under FSDP2; a 16-bit parameter's fp32 main copy as the state
`fp32_param`) and the inner optimizer's hyperparameters. A load goes through the child's own
checked `load_state_dict`, and refuses missing state rather than restarting it from zero.
"""

from typing import Any, Callable, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor

from megatron_eopt.checkpointable.child import CheckpointableChild, ChildParam
from megatron_eopt.runtime.process_groups import group_size

# A 16-bit parameter's fp32 main copy, as one more state of it (megatron-core's name for the copy).
MAIN_PARAM = "fp32_param"
Group = tuple[dict, list[ChildParam]]  # a live param group and its parameters as checkpoints see them


class TorchOptimizerView:
    """One child (FP32Optimizer or a subclass) as torch's state-dict helpers read a torch optimizer.

    Its `param_groups` are copies (the helpers set lr to 0 around the step that makes lazy state,
    which must not reach the live groups) of the child's non-empty groups: torch's helpers match
    a loaded group to a live one by its parameters' names, which an empty group has none of.
    """

    def __init__(self, child: CheckpointableChild) -> None:
        if group_size(getattr(child, "tp_group", None)) > 1:
            raise ValueError(
                f"optimizer {child.name!r} steps tensor-parallel shards, which torch's state-dict helpers would "
                f"save under the names every TP rank shares; use megatron_eopt.checkpointing.save_checkpoint "
                f"(or, without TP, get_optimizer_state_dict).")
        self._child = child

    @property
    def param_groups(self) -> list[dict]:
        return [{**_hyperparameters(self._child, group), "params": [p.model for p in members],
                 "param_names": [p.fqn for p in members]} for group, members in _groups(self._child)]

    @property
    def state(self) -> dict:
        """{model parameter: {state name: this rank's value}}, made first where torch's optimizers make
        it at their first step (the helpers would otherwise step to make it)."""
        self._child.init_state()
        flat = self._child.local_state_dict()
        entries = {p.model: _entries(flat, p, p.fqn) for _, members in _groups(self._child) for p in members}
        return {param: values for param, values in entries.items() if values}

    def state_dict(self) -> dict:
        """torch's format: state by position in `param_groups`, each value as the child's
        `state_dict()` holds it (DTensors under FSDP2; a collective over the parameters' mesh)."""
        flat = self._child.state_dict()
        if flat.get("grad_scaler"):
            raise ValueError(
                f"optimizer {self._child.name!r} keeps fp16 loss-scaler state, which torch's optimizer format has "
                f"no place for; save it with optimizer.state_dict() or megatron_eopt.checkpointing.save_checkpoint.")
        state, groups, index = {}, [], 0
        for group, members in _groups(self._child):
            for position, param in enumerate(members, start=index):
                entries = _entries(flat, param, _flat_name(param))
                if entries:
                    state[position] = entries
            ids = list(range(index, index + len(members)))
            index += len(members)
            groups.append({**_hyperparameters(self._child, group), "params": ids,
                           "param_names": [p.fqn for p in members]})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """torch's format, its groups in `param_groups`' order and each group's parameters in theirs
        (keyed by position or by name, as torch's helpers hand it over): the hyperparameters
        and every state this optimizer keeps, checked (ValueError) before anything changes."""
        live = _groups(self._child)
        saved_groups = _checked_groups(self._child, live, state_dict)
        state, mains = {}, {}
        for (_, members), saved in zip(live, saved_groups):
            for param, key in zip(members, saved["params"]):
                entries = dict(state_dict["state"].get(key, {}))
                if MAIN_PARAM in entries:
                    mains[param.stored_name] = entries.pop(MAIN_PARAM)
                state[param.stored_name] = entries
        self._check_complete(state, mains)
        hyperparameters = {group["group_key"]: saved for (group, _), saved in zip(live, saved_groups)}
        self._child.load_state_dict(self._flat(hyperparameters, state, mains))

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        """What torch's helpers call, with zero gradients and lr 0, to make the state torch's
        optimizers make at their first step: that state is made here and nothing is updated. Train
        with the chain's `step()`, which clips and checks all children together."""
        if closure is not None:
            raise TypeError("TorchOptimizerView.step() takes no closure: it only makes the optimizer's state.")
        self._child.init_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._child.zero_grad(set_to_none)

    def _check_complete(self, state: dict[str, dict], mains: dict[str, Any]) -> None:
        """Every state the live optimizer keeps is loaded, as a tensor or number: torch's helpers
        fill what the checkpoint lacks with nothing ({} in the flattened layout), and an optimizer
        loaded so would restart from zero without a word."""
        live = self.state
        for _, members in _groups(self._child):
            for param in members:
                expected = set(live.get(param.model, {}))
                loaded = {name for name, value in state[param.stored_name].items() if _is_value(value)}
                if param.stored_name in mains and _is_value(mains[param.stored_name]):
                    loaded.add(MAIN_PARAM)
                missing = sorted(expected - loaded)
                if missing:
                    raise ValueError(
                        f"optimizer {self._child.name!r}: the state dict restores no {missing} for parameter "
                        f"{param.fqn!r} (it holds {sorted(loaded)}); loading it would restart that state from zero. "
                        f"Load a checkpoint saved from this model and optimizer (get_optimizer_state_dict), or load "
                        f"the model only.")

    def _flat(self, hyperparameters: dict[str, Mapping], state: dict, mains: dict) -> dict:
        """The child's own state-dict layout (wrappers/flat_state.py), keyed by stored name: empty
        groups keep their live hyperparameters."""
        names = {id(p.main): p.stored_name for p in self._child.checkpoint_params()}
        groups = {}
        for group in self._child.param_groups:
            saved = hyperparameters.get(group["group_key"], group)
            groups[group["group_key"]] = {**_hyperparameters(self._child, saved),
                                          "params": [names[id(main)] for main in group["params"]]}
        flat = {"optimizer_class": self._child.inner_class_name(), "param_groups": groups, "state": state,
                "grad_scaler": None}
        return {**flat, "main_params": mains} if mains else flat


def _groups(child: CheckpointableChild) -> list[Group]:
    by_main = {id(p.main): p for p in child.checkpoint_params()}
    return [(group, [by_main[id(main)] for main in group["params"]]) for group in child.param_groups
            if group["params"]]


def _hyperparameters(child: CheckpointableChild, group: Mapping) -> dict:
    """The inner optimizer's hyperparameters (its `defaults`' keys) of `group`: our own fields
    (`default_config`, `param_fqns`, ...) say how the run grouped its parameters and stay live."""
    return {key: group[key] for key in child.hyperparameter_names() if key in group}


def _flat_name(param: ChildParam) -> str:
    """A parameter's key in the child's `state_dict()`: DTensor state is keyed by stored name."""
    return param.stored_name if isinstance(param.model, DTensor) else param.fqn


def _entries(flat: Mapping, param: ChildParam, name: str) -> dict:
    entries = dict(flat["state"].get(name, {}))
    main = (flat.get("main_params") or {}).get(name)
    return {**entries, MAIN_PARAM: main} if main is not None else entries


def _checked_groups(child: CheckpointableChild, live: list[Group], state_dict: Any) -> list[Mapping]:
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise TypeError(
            f"optimizer {child.name!r} loads torch's optimizer format ('state' and 'param_groups', as "
            f"get_optimizer_state_dict/set_optimizer_state_dict hand it over); got "
            f"{sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__}.")
    saved = list(state_dict["param_groups"])
    sizes = [len(members) for _, members in live]
    if [len(group["params"]) for group in saved] != sizes:
        raise ValueError(
            f"optimizer {child.name!r} has {len(live)} param groups of {sizes} parameters, the state dict "
            f"{[len(group['params']) for group in saved]}; it was saved from another model or optimizer.")
    return saved


def _is_value(value: Any) -> bool:
    return torch.is_tensor(value) or isinstance(value, (bool, int, float))


def torch_optimizer_views(children: list[Any], state_on_owners_only: bool,
                          others: list[str]) -> list[TorchOptimizerView]:
    """A chain's children as torch's state-dict helpers read torch optimizers (ChainedOptimizer.__iter__);
    `others` names the children that are not megatron_eopt's (the chain knows its classes)."""
    if state_on_owners_only:
        raise ValueError(
            "the layer-wise distributed optimizer keeps each parameter's state on its owner rank only, which "
            "torch's state-dict helpers cannot save; use optimizer.state_dict() or "
            "megatron_eopt.checkpointing.save_checkpoint.")
    if others:
        raise TypeError(
            f"torch's state-dict helpers take the children of a megatron_eopt chain (FP32Optimizer and its "
            f"subclasses); this chain holds {others}: hand their torch optimizers to the helpers directly.")
    return [TorchOptimizerView(child) for child in children]
