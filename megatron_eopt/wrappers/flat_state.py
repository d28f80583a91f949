"""Optimizer state keyed by parameter name and param groups keyed by group key.

torch numbers state by position, which breaks as soon as the parameter order or the group
layout differs between save and load. Here state is `{fqn: {name: tensor}}` and groups are
`{group_key: {hyperparameter: number, "params": [fqn, ...]}}`, so a checkpoint is matched by
names, and a mismatch is reported by name. Saved group keys that are not the live ones (renamed
override rules, megatron-core's groups) are matched by their identifying keys, as megatron-core's
`MegatronOptimizer._filter_and_reorder_param_groups` does (`match_param_groups`).

Between steps every state tensor is row-major contiguous in a 64-byte-aligned storage of its own
(`canonical_state_layout`), as a checkpoint loads it: SOAP's and REKLS's eigenbases come out of
LAPACK column-major, and on Intel CPUs MKL's results depend on layout and alignment, so a resumed
run would not continue bitwise otherwise (docs/reliability.md).
"""

from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_eopt.checkpointable.child import PARAM_GROUP_IDENTIFIER_KEYS, param_group_identifier

def match_param_groups(current_groups: Sequence[Mapping[str, Any]],
                       saved_groups: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The saved group with each current group's identifier, in the current groups' order."""
    by_identifier: dict[tuple, Mapping[str, Any]] = {}
    for group in saved_groups:
        identifier = param_group_identifier(group)
        if identifier in by_identifier:
            raise ValueError(
                f"two saved param groups have the same identifying values {identifier} (keys "
                f"{PARAM_GROUP_IDENTIFIER_KEYS}); they cannot be told apart on load."
            )
        by_identifier[identifier] = group
    matched = []
    for group in current_groups:
        identifier = param_group_identifier(group)
        if identifier not in by_identifier:
            raise ValueError(
                f"no saved param group has the identifying values {identifier} (keys "
                f"{PARAM_GROUP_IDENTIFIER_KEYS}); the saved ones have {sorted(map(str, by_identifier))}."
            )
        matched.append(by_identifier[identifier])
    return matched


def flat_state_dict(optimizer: torch.optim.Optimizer, fqn_of: Mapping[int, str]) -> dict[str, Any]:
    """torch's state dict of `optimizer`, re-keyed by fqn (`fqn_of` maps id(param) -> fqn)."""
    torch_state = optimizer.state_dict()
    index_to_fqn = [fqn_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = {}
    for saved, live in zip(torch_state["param_groups"], optimizer.param_groups):
        hyperparameters = {k: v for k, v in saved.items() if k != "params"}
        groups[live["group_key"]] = {
            **hyperparameters,
            "params": [index_to_fqn[i] for i in saved["params"]],
        }
    return {
        "optimizer_class": type(optimizer).__name__,
        "param_groups": groups,
        "state": {index_to_fqn[i]: value for i, value in torch_state["state"].items()},
    }


def load_flat_state_dict(
    optimizer: torch.optim.Optimizer, flat: Mapping[str, Any], fqn_of: Mapping[int, str]
) -> None:
    """Load a `flat_state_dict` into `optimizer`, refusing any mismatch by name."""
    optimizer.load_state_dict(torch_state_dict_from_flat(optimizer, flat, fqn_of))


STATE_ALIGNMENT = 64  # bytes: what torch's CPU allocator gives a new tensor


def canonical_state_layout(optimizer: torch.optim.Optimizer, params: Optional[list] = None) -> None:
    """Give every plain state tensor of `optimizer` (of `params` only, when given) the layout of a
    fresh one (module docstring): contiguous, in a storage of its own that starts at a 64-byte
    boundary. Copies only those that are not; values are unchanged."""
    for state in optimizer.state.values() if params is None else [optimizer.state[p] for p in params]:
        for key, value in state.items():
            if type(value) is torch.Tensor and value.dim() > 0 and not _canonical(value):
                state[key] = value.clone(memory_format=torch.contiguous_format)


def _canonical(value: torch.Tensor) -> bool:
    return (value.is_contiguous() and value.storage_offset() == 0
            and value.untyped_storage().nbytes() == value.numel() * value.element_size()
            and (value.device.type != "cpu" or value.data_ptr() % STATE_ALIGNMENT == 0))


def torch_state_dict_from_flat(
    optimizer: torch.optim.Optimizer, flat: Mapping[str, Any], fqn_of: Mapping[int, str]
) -> dict[str, Any]:
    """Check `flat` against `optimizer` by name and translate it to torch's positional format.

    Changes nothing, so callers can check every part of a checkpoint before loading any.
    Optimizer hyperparameters (lr, betas, ...) come from the checkpoint; the group's own
    metadata (group_key, max_lr, wd_mult, ...) stays as the live config built it.
    """
    if not isinstance(flat, Mapping) or not {"param_groups", "state"} <= set(flat):
        raise ValueError(
            "not an optimizer state dict written by megatron_eopt (expected 'optimizer_class', "
            "'param_groups' and 'state' entries)."
        )
    _check_same_optimizer(optimizer, flat)
    saved_groups = flat["param_groups"]
    if {group["group_key"] for group in optimizer.param_groups} != set(saved_groups):
        saved_groups = _matched_by_identifier(optimizer, saved_groups)
    torch_groups, torch_state, index = [], {}, 0
    for live in optimizer.param_groups:
        saved = saved_groups[live["group_key"]]
        _check_same_params(live, saved, fqn_of)
        indices = []
        for param in live["params"]:
            fqn = fqn_of[id(param)]
            if fqn in flat["state"]:
                torch_state[index] = flat["state"][fqn]
            indices.append(index)
            index += 1
        hyperparameters = {k: saved[k] for k in optimizer.defaults if k in saved}
        metadata = {k: v for k, v in live.items() if k != "params"}
        torch_groups.append({**metadata, **hyperparameters, "params": indices})
    return {"state": torch_state, "param_groups": torch_groups}


def _check_same_optimizer(optimizer: torch.optim.Optimizer, flat: Mapping[str, Any]) -> None:
    saved_class = flat.get("optimizer_class")
    if saved_class != type(optimizer).__name__:
        raise ValueError(
            f"optimizer state was saved by {saved_class!r} but this optimizer is "
            f"{type(optimizer).__name__!r}; its state cannot be loaded here. Load the model "
            f"only (e.g. --no-load-optim) to change optimizers."
        )


def _matched_by_identifier(optimizer: torch.optim.Optimizer, saved_groups: Mapping[str, Any]) -> dict[str, Any]:
    """live group_key -> the saved group with its identifying values (the keys differ)."""
    live_keys = {group["group_key"] for group in optimizer.param_groups}
    differ = (f"param groups differ from the checkpoint's: missing in the checkpoint "
              f"{sorted(live_keys - set(saved_groups))}, only in the checkpoint {sorted(set(saved_groups) - live_keys)}")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{differ}. The overrides (or the model) changed since it was saved.")
    try:
        matched = match_param_groups(optimizer.param_groups, list(saved_groups.values()))
    except ValueError as error:
        raise ValueError(f"{differ}, and matching them by their values failed: {error} The overrides (or the "
                         f"model) changed since it was saved.") from None
    return {group["group_key"]: saved for group, saved in zip(optimizer.param_groups, matched)}


def _check_same_params(live: Mapping[str, Any], saved: Mapping[str, Any], fqn_of: Mapping[int, str]) -> None:
    live_fqns = [fqn_of[id(p)] for p in live["params"]]
    missing = sorted(set(live_fqns) - set(saved["params"]))
    extra = sorted(set(saved["params"]) - set(live_fqns))
    if missing or extra:
        raise ValueError(
            f"param group {live['group_key']!r}: parameters missing in the checkpoint "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, only in the checkpoint "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''}."
        )
