"""Optimizer state keyed by parameter name and param groups keyed by group key.

torch numbers state by position, which breaks as soon as the parameter order or the group
layout differs between save and load. Here state is `{fqn: {name: tensor}}` and groups are
`{group_key: {hyperparameter: number, "params": [fqn, ...]}}`, so a checkpoint is matched by
names, and a mismatch is reported by name.

Between steps every state tensor is row-major contiguous in a 64-byte-aligned storage of its own
(`canonical_state_layout`), which is how a checkpoint loads it. A live tensor in another layout
(SOAP's and REKLS's eigenbases come out of LAPACK column-major) would make the next step's
products run other BLAS kernels than after a resume: on Intel CPUs MKL's results depend on the
operands' layout and alignment, so a resumed run would not continue bitwise (docs/reliability.md).
"""

from typing import Any, Mapping

import torch


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
    canonical_state_layout(optimizer)


STATE_ALIGNMENT = 64  # bytes: what torch's CPU allocator gives a new tensor


def canonical_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give every plain state tensor of `optimizer` the layout of a fresh one (module docstring):
    contiguous, in a storage of its own that starts at a 64-byte boundary. Copies only those that
    are not; values are unchanged."""
    for state in optimizer.state.values():
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
    _check_same_groups(optimizer, saved_groups)
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


def _check_same_groups(optimizer: torch.optim.Optimizer, saved_groups: Mapping[str, Any]) -> None:
    live_keys = {group["group_key"] for group in optimizer.param_groups}
    missing, extra = sorted(live_keys - set(saved_groups)), sorted(set(saved_groups) - live_keys)
    if missing or extra:
        raise ValueError(
            f"param groups differ from the checkpoint's: missing in the checkpoint {missing}, "
            f"only in the checkpoint {extra}. The overrides (or the model) changed since it was "
            f"saved."
        )


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
