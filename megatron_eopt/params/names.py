"""The names by which errors and checks refer to parameters.

Param groups built by `param_groups.py` name their parameters in 'param_fqns'; groups a caller
builds by hand may not, and then a parameter is named by its position in its group.
"""

from typing import Any, Iterator, Mapping, Sequence

import torch


def group_param_names(group: Mapping[str, Any], start: int = 0) -> list[str]:
    """The fully qualified name of every parameter of `group`, in order ('<parameter i>' unnamed,
    i counted from `start`)."""
    return list(group.get("param_fqns") or [f"<parameter {start + i}>" for i in range(len(group["params"]))])


def named_params(param_groups: Sequence[Mapping[str, Any]]) -> Iterator[tuple[torch.Tensor, str]]:
    """(parameter, name) of every parameter of `param_groups`, group by group; an unnamed one is
    '<parameter i>', i its position over all groups (torch's state-dict index)."""
    start = 0
    for group in param_groups:
        yield from zip(group["params"], group_param_names(group, start))
        start += len(group["params"])


# megatron-core's routed experts live in `*.experts.*` (SequentialMLP's local_experts, TEGroupedMLP);
# `shared_experts` are dense.
EXPERT_NAME_PART = ".experts."


def is_expert_name(fqn: str) -> bool:
    """Whether `fqn` names a routed expert's parameter (MoE), by megatron-core's module names."""
    return EXPERT_NAME_PART in f".{fqn}"
