"""Model chunks + overrides -> torch param groups, and one record of facts per parameter.

A group is identified by a stable text key: whether it holds expert parameters, plus the
descriptions of the override keys its parameters matched (never the override values, so a
checkpoint still matches its groups after an lr change). Every rank creates the same set of
keys, some groups possibly empty, because checkpoints match groups by key.
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_eopt.param_key import describe_key, matching_keys, merge_overrides

DEFAULT_GROUP_NAME = "default"


@dataclass(frozen=True)
class ParamRecord:
    """What the optimizer needs to know about one parameter, computed once."""

    fqn: str  # unique across model chunks; the key of this parameter's optimizer state
    name: str  # name inside its model chunk, as override globs see it
    param: torch.nn.Parameter
    group_key: str
    is_expert_parallel: bool  # megatron-core: param.allreduce is False
    tensor_model_parallel: bool  # sharded over the (expert) tensor-parallel group
    partition_dim: int  # -1 when not tensor-parallel
    is_shared: bool  # a second copy of a tied parameter (megatron-core: param.shared)


def named_trainable_parameters(
    model_chunks: Iterable[torch.nn.Module],
) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(fqn, name, param) for every trainable parameter, each parameter once.

    With several chunks (virtual pipeline stages) names repeat across chunks, so the fqn
    gets a `model_chunk{i}.` prefix.
    """
    chunks = list(model_chunks)
    seen: set[int] = set()
    result = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(
                f"model_chunks must be torch.nn.Module objects; item {index} is "
                f"{type(chunk).__name__}."
            )
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            fqn = name if len(chunks) == 1 else f"model_chunk{index}.{name}"
            result.append((fqn, name, param))
    return result


def group_key_for(is_expert_parallel: bool, key_descriptions: Iterable[str]) -> str:
    kind = "expert" if is_expert_parallel else "dense"
    keys = sorted(set(key_descriptions))
    return f"{kind}/{'+'.join(keys) if keys else DEFAULT_GROUP_NAME}"


def build_param_groups(
    model_chunks: Iterable[torch.nn.Module],
    config: Any,
    config_overrides: Mapping[Any, Mapping[str, Any]],
    align_group: Optional[dist.ProcessGroup] = None,
) -> tuple[list[dict], list[ParamRecord]]:
    """Param groups (torch format plus megatron-core's keys) and the per-parameter records.

    `align_group`: the ranks whose group keys must agree (all ranks that checkpoint together);
    None for a single process.
    """
    key_by_description: dict[str, Any] = {}
    for key in config_overrides:
        description = describe_key(key)
        if description in key_by_description:
            # Groups are identified by these descriptions; two keys sharing one would share a
            # group and silently lose one key's override.
            raise ValueError(
                f"config_overrides has two different keys described as {description}: "
                f"{key_by_description[description]!r} and {key!r}. Give their predicates "
                f"distinct names, or merge them into one key."
            )
        key_by_description[description] = key
    records: list[ParamRecord] = []
    matched_descriptions: dict[str, tuple[str, ...]] = {}
    for fqn, name, param in named_trainable_parameters(model_chunks):
        keys = matching_keys(config_overrides, param, name)
        merge_overrides(keys, config_overrides, name)  # a conflict raises here, naming `name`
        is_expert = not getattr(param, "allreduce", True)
        descriptions = tuple(sorted(describe_key(key) for key in keys))
        group_key = group_key_for(is_expert, descriptions)
        matched_descriptions[group_key] = descriptions
        records.append(_make_record(fqn, name, param, group_key, is_expert))

    groups = []
    for group_key, descriptions in _aligned_group_keys(matched_descriptions, align_group):
        unknown = [d for d in descriptions if d not in key_by_description]
        if unknown:
            raise ValueError(
                f"param group {group_key!r} exists on another rank but its override keys "
                f"{unknown} are not in this rank's config_overrides; every rank must pass the "
                f"same config_overrides."
            )
        keys = [key_by_description[d] for d in descriptions]
        override = merge_overrides(keys, config_overrides, f"<group {group_key}>")
        params = [r.param for r in records if r.group_key == group_key]
        groups.append(_make_group(group_key, params, override, config))
    return groups, records


def _make_record(
    fqn: str, name: str, param: torch.nn.Parameter, group_key: str, is_expert: bool
) -> ParamRecord:
    tensor_parallel = bool(getattr(param, "tensor_model_parallel", False))
    return ParamRecord(
        fqn=fqn,
        name=name,
        param=param,
        group_key=group_key,
        is_expert_parallel=is_expert,
        tensor_model_parallel=tensor_parallel,
        partition_dim=int(getattr(param, "partition_dim", -1)) if tensor_parallel else -1,
        is_shared=bool(getattr(param, "shared", False)),
    )


def _aligned_group_keys(
    local: dict[str, tuple[str, ...]], group: Optional[dist.ProcessGroup]
) -> list[tuple[str, tuple[str, ...]]]:
    """(group_key, override-key descriptions) of all ranks, in one order on every rank."""
    if group is None or dist.get_world_size(group) == 1:
        gathered = [local]
    else:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    union = {key: descriptions for per_rank in gathered for key, descriptions in per_rank.items()}
    # Dense before expert, the default group first within each.
    order = sorted(union, key=lambda k: (k.startswith("expert/"), bool(union[k]), k))
    return [(key, union[key]) for key in order]


def _make_group(group_key: str, params: list, override: dict, config: Any) -> dict:
    group = {
        "params": params,
        "group_key": group_key,
        "is_expert_parallel": group_key.startswith("expert/"),
        # megatron-core's logging reads the lr of the first default_config group.
        "default_config": not any("lr" in field for field in override),
        "wd_mult": 1.0,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": config.lr,
        "min_lr": config.min_lr,
    }
    group.update(override)
    if group["max_lr"] is None:
        raise ValueError(
            f"param group {group_key!r} has no learning rate: set OptimizerConfig.lr (the peak "
            f"learning rate), or max_lr in its override."
        )
    # Right before any scheduler runs; the scheduler later sets both the same way.
    group["lr"] = group["max_lr"]
    start_wd = group.get("start_wd", config.weight_decay)
    group["weight_decay"] = start_wd * group["wd_mult"]
    return group


def dump_param_group_map(
    path: str, param_groups: list[dict], records: list[ParamRecord], optimizer_names: Mapping[str, str]
) -> str:
    """Write which optimizer and group every parameter of this rank got, as JSON.

    `path` is a directory; each rank writes `rank_{rank:05d}.json` there. Returns the file.
    `optimizer_names` maps group_key -> the name of the optimizer that steps that group.
    """
    index_by_key = {group["group_key"]: i for i, group in enumerate(param_groups)}
    entries = {
        r.fqn: {
            "group_index": index_by_key[r.group_key],
            "group_key": r.group_key,
            "optimizer": optimizer_names[r.group_key],
            "shape": list(r.param.shape),
        }
        for r in records
    }
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    os.makedirs(path, exist_ok=True)
    file_path = os.path.join(path, f"rank_{rank:05d}.json")
    with open(file_path, "w") as handle:
        json.dump(entries, handle, indent=1, sort_keys=True)
    return file_path
