"""The chain's children as torch's optimizer interface shows them: param groups and state keyed by
the model's own parameters.

Each child's inner torch optimizer steps what it keeps as main parameters: the model's parameter
itself, an fp32 copy of a 16-bit one, or the local shard of an FSDP2 DTensor. Torch's lr
schedulers, the engines' offload walks (verl's `offload_fsdp_optimizer`) and torch's state-dict
helpers read `param_groups` and `state` by the model's parameters. So the chain shows:
- each inner param group as a `ParamGroupView`: its "params" are the model's parameters and
  "param_names" their names (as torch's optimizers built from `named_parameters()` have them;
  torchtitan's flat state dict reads them), every other key is read from and written to the live
  inner group (an lr a scheduler sets is the lr the inner optimizer steps with);
- `ModelParamState`: the inner optimizers' live state by model parameter ({} for a parameter
  without state, as torch's defaultdict gives).
"""

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch


def main_params_by_model(child: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """id(model parameter) -> (model parameter, main parameter) for one of our children (FP32Optimizer
    and subclasses); a chained torch optimizer's parameters stand for themselves."""
    if hasattr(child, "model_params") and hasattr(child, "main_params"):
        return {id(model): (model, main) for model, main in zip(child.model_params, child.main_params)}
    return {id(p): (p, p) for group in child.param_groups for p in group["params"]}


class ParamGroupView(MutableMapping):
    """One inner param group, with the model's parameters under "params".

    The inner group is looked up at each access (a load replaces the inner optimizer's group
    dicts), so a view stays live for the optimizer's life.
    """

    def __init__(self, child: Any, index: int, model_of_main: Mapping[int, torch.Tensor],
                 name_of_main: Mapping[int, str]) -> None:
        self._child = child
        self._index = index
        self._model_of_main = model_of_main
        self._name_of_main = name_of_main

    @property
    def inner(self) -> dict:
        """The inner optimizer's own group dict (main parameters under "params")."""
        return self._child.param_groups[self._index]

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return [self._model_of_main.get(id(p), p) for p in self.inner["params"]]
        if key == "param_names" and self._name_of_main:
            return [self._name_of_main[id(p)] for p in self.inner["params"]]
        return self.inner[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._fixed_keys():
            raise TypeError(f"a param group's {key!r} are fixed by get_megatron_optimizer's routing; build a new "
                            f"optimizer over other model_chunks to step other parameters.")
        self.inner[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._fixed_keys():
            raise TypeError(f"a param group's {key!r} cannot be removed.")
        del self.inner[key]

    def __iter__(self) -> Iterator[str]:
        yield from self.inner
        if "param_names" in self._fixed_keys() and "param_names" not in self.inner:
            yield "param_names"

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _fixed_keys(self) -> tuple[str, ...]:
        return ("params", "param_names") if self._name_of_main else ("params",)

    def __repr__(self) -> str:
        return repr({key: value for key, value in self.inner.items() if key != "params"})


def param_group_views(children: list[Any]) -> list[ParamGroupView]:
    """Every child's param groups, in chain order, as views with the model's parameters."""
    views = []
    for child in children:
        model_of_main = {id(main): model for model, main in main_params_by_model(child).values()}
        name_of_main = dict(getattr(child, "fqn_of_main", None) or {})  # ours name their parameters
        views += [ParamGroupView(child, index, model_of_main, name_of_main) for index in range(len(child.param_groups))]
    return views


def inner_groups(children: list[Any], groups: list[Any]) -> list[dict]:
    """Groups to set as the children's param groups: a view becomes its inner group; a plain dict
    (a copy of a view, or megatron-core's own group) keeps its keys, its model parameters
    replaced by the main parameters the inner optimizer steps."""
    main_of = {key: main for child in children for key, (_, main) in main_params_by_model(child).items()}
    result = []
    for group in groups:
        if isinstance(group, ParamGroupView):
            result.append(group.inner)
        else:
            copied = {key: value for key, value in group.items() if key != "param_names"}
            result.append({**copied, "params": [main_of.get(id(p), p) for p in group["params"]]})
    return result


class ModelParamState(Mapping):
    """The children's live optimizer state by model parameter (or by main parameter, as the
    children key it). A parameter without state gives {} without adding an entry, so a lookup
    never hides state or changes what a state dict holds. Each child's `state` is read at each
    access: torch's load replaces the inner optimizer's state dict."""

    def __init__(self, children: list[Any]) -> None:
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        for child in children:
            for model, main in main_params_by_model(child).values():
                self._entries[id(model)] = (model, main, child)
                self._entries.setdefault(id(main), (model, main, child))

    def __getitem__(self, param: Any) -> dict:
        entry = self._entries.get(id(param))
        if entry is None:
            return {}
        _, main, child = entry
        return child.state[main] if main in child.state else {}

    def __contains__(self, param: Any) -> bool:
        entry = self._entries.get(id(param))
        return entry is not None and entry[1] in entry[2].state

    def __iter__(self) -> Iterator[torch.Tensor]:
        seen = set()
        for model, main, child in self._entries.values():
            if id(model) not in seen and main in child.state:
                seen.add(id(model))
                yield model

    def __len__(self) -> int:
        return sum(1 for _ in self)
