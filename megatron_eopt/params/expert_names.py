"""Routed experts by their global index.

With expert parallelism megatron-core numbers each rank's experts from 0 (SequentialMLP's
`experts.local_experts.<i>`), so the ranks name different experts alike. A checkpoint names each
by its global index instead, as megatron-core's own fsdp_dtensor checkpoint does
(`handle_experts_in_state_dict`, megatron/core/transformer/fsdp_dtensor_checkpoint.py). The global
index comes from what megatron-core records on the MoE layer holding the experts: its
`local_expert_indices` (the global index of each local expert).

Transformer Engine's grouped experts (TEGroupedMLP: `experts.linear_fc1.weight<i>`) number their
weights instead of their modules; they have no global name here (`GROUPED_EXPERT`).
"""

import re
from typing import Iterable, Optional

import torch

LOCAL_EXPERT = re.compile(r"(^|\.)experts\.local_experts\.(\d+)$")  # a SequentialMLP expert module's name
GROUPED_EXPERT = re.compile(r"(^|\.)experts\.linear_fc[12]\.(weight|bias)\d+$")  # a TEGroupedMLP weight's name


def global_expert_index(modules: dict[str, torch.nn.Module], name: str, match: re.Match) -> int:
    """The global index of local expert module `name` (`match`: LOCAL_EXPERT's on it), from the MoE
    layer holding its `experts`."""
    moe_layer = modules.get(name[:match.start()] if match.start() else "")
    indices = getattr(moe_layer, "local_expert_indices", None)
    local = int(match.group(2))
    if indices is None or local >= len(indices):
        raise ValueError(
            f"module {name!r} is a local expert, but its MoE layer has no local_expert_indices "
            f"entry {local} (got {indices!r}); global expert numbers come from megatron-core's MoELayer."
        )
    return int(indices[local])


def expert_global_names(chunks: Iterable[torch.nn.Module], fqns: Iterable[str]) -> dict[str, Optional[str]]:
    """{fqn: its name with the global expert index} for each of `fqns` (named as
    `named_trainable_parameters` names them) that lies in a SequentialMLP's local expert; None for
    the others (`unnamed_expert_layout` says which layout they have)."""
    chunks = list(chunks)
    wanted = set(fqns)
    result: dict[str, Optional[str]] = {}
    for index, chunk in enumerate(chunks):
        prefix = f"model_chunk{index}." if len(chunks) > 1 else ""
        modules = dict(chunk.named_modules())
        for module_name, module in modules.items():
            match = LOCAL_EXPERT.search(module_name)
            if match is None:
                continue
            global_module = f"{module_name[:match.start(2)]}{global_expert_index(modules, module_name, match)}"
            for name, _ in module.named_parameters():
                fqn = f"{prefix}{module_name}.{name}"
                if fqn in wanted:
                    result[fqn] = f"{prefix}{global_module}.{name}"
    result.update({fqn: None for fqn in wanted - set(result)})
    return result


def unnamed_expert_layout(fqn: str) -> str:
    """The expert layout of a parameter `expert_global_names` gives no global name, in words."""
    if GROUPED_EXPERT.search(fqn):
        return "Transformer Engine's grouped experts (TEGroupedMLP, `experts.linear_fc1.weight<i>`)"
    return "an expert module other than SequentialMLP's `experts.local_experts.<i>`"
