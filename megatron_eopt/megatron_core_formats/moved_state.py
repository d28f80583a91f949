"""Parameters whose optimizer changed since a megatron-core-layout `torch_dist` checkpoint was saved.

Our sharded state dict asks for `[chained_<i>.]optimizer.state.<state name>.<model key>`
(dist_checkpointing.py). When a parameter's optimizer changed (checkpointable/optimizer_change.py),
the checkpoint holds its state under other state names, and `dist_checkpointing.load` would fail on
the first missing key. `moved_parameters` names them from the checkpoint's metadata (no
collective): in a ValueError, or with the opt-in in one line; then `load_moved_fresh` runs the
caller's one load for every sharded tensor and object but their state (main copies are weights:
read), under a key of its own, apart from the checkpoint's non-tensor part. It gives back our
chain's structure: the moved state as the fresh optimizer made it (`init_state`, its step); each
child's param groups (matched by megatron-core's identifying values), step, scalars and loss scale
from the saved child of the same kind (the same param-group fields); what the checkpoint lacks, live.
"""

import re
from typing import Any, Callable, Mapping, Optional

import torch

from megatron_eopt.checkpointable.child import param_group_identifier
from megatron_eopt.checkpointable.optimizer_change import (OPT_IN_FLAG, Owner, optimizer_changes, say_on_rank_zero,
                                                           settle_optimizer_changes)
from megatron_eopt.megatron_core_formats.dist_checkpointing import core_chain_states
from megatron_eopt.megatron_core_formats.layouts import (COMMON_STEP, DISTRIBUTED_MAIN_PARAM, EXTRA_SCALARS,
                                                         MAIN_PARAM_STATE, OWN_STATE, STATE_PREFIX, core_format_in,
                                                         torch_state_of)

_STATE_KEY = re.compile(rf"^(?:chained_\d+\.)?{re.escape(STATE_PREFIX)}\.([^.]+)\.(.+)$")
_BUCKET_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\..*bucket_idx_\d+\.")
_OWN_STATE_KEY = re.compile(rf"^(?:chained_\d+\.)?{re.escape(OWN_STATE)}\.([^.]+)\.(.+)\.chunk_[\d_]+$")
MAIN_COPIES = {MAIN_PARAM_STATE, DISTRIBUTED_MAIN_PARAM}  # weights, not an optimizer's state: always read
READS = "eopt_reads_around_moved_state"  # our request's tensors, apart from the checkpoint's optimizer part
SAVED_ONLY = ("params", "optimizer")  # group fields that say nothing of the optimizer's kind


def moved_parameters(optimizer_state_dict: Any, checkpoint_dir: str, allowed: bool,
                     keys: Optional[list[str]]) -> set[str]:
    """The model keys of the parameters whose optimizer state the checkpoint holds under other state
    names than `optimizer_state_dict` (our sharded_state_dict(is_loading=True)) asks for (main copies
    aside), from the checkpoint's metadata `keys` (saved_keys); without `allowed` (the opt-in) a
    ValueError names them, with it one line does."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if keys is None:  # no or a damaged checkpoint (saved_keys): dist_checkpointing's load says so
        return set()
    saved = _state_names(keys)
    live = _state_names(value.key for value in nested_values(optimizer_state_dict) if isinstance(value, ShardedTensor))
    # with no saved state at all (saved before its first step, or another model) dist_checkpointing names it
    moved = {name for name, names in live.items()
             if saved.get(name) and names - MAIN_COPIES != saved[name] - MAIN_COPIES}
    changes = optimizer_changes({name: Owner("saved", ", ".join(sorted(saved[name] - MAIN_COPIES))) for name in moved},
                                {name: Owner("now", ", ".join(sorted(live[name] - MAIN_COPIES))) for name in moved})
    return settle_optimizer_changes(changes, allowed, f"loading {checkpoint_dir}")


def saved_keys(checkpoint_dir: str) -> Optional[list[str]]:
    """The keys of the checkpoint's metadata (no collective); None for no or a damaged checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return list(FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata)
    except (OSError, ValueError, RuntimeError):
        return None


def skip_bucket_state(optimizer_state_dict: Any, checkpoint_dir: str, allowed: bool,
                      keys: Optional[list[str]]) -> bool:
    """Whether the checkpoint keeps its optimizer state by megatron-core DistributedOptimizer's buffer
    buckets (its torch_dist default, dp_reshardable), which name no parameter, while this run's
    optimizer asks per parameter: then, with `allowed`, one line says the optimizer starts fresh (as
    with --no-load-optim; the caller skips it); without, a ValueError with the ways on. The other way
    round (megatron-core's DistributedOptimizer asking buckets of a checkpoint with none) a ValueError."""
    keys, requested = keys or [], _keys_of(optimizer_state_dict)
    if keys and any(_BUCKET_KEY.match(key) for key in requested) and not any(_BUCKET_KEY.match(key) for key in keys):
        raise ValueError(f"{checkpoint_dir} holds no optimizer state by buffer bucket, which megatron-core's "
                         f"DistributedOptimizer asks for (it holds it per parameter: megatron_eopt's, or a "
                         f"non-distributed optimizer's): pass --no-load-optim (the model and the iteration load, the "
                         f"optimizer starts fresh), or continue with the optimizer that saved it.")
    asked = [key for key in requested if _STATE_KEY.match(key) or _OWN_STATE_KEY.match(key)]
    if not asked or not any(_BUCKET_KEY.match(key) for key in keys) or any(_STATE_KEY.match(key) for key in keys):
        return False
    what = (f"{checkpoint_dir} holds megatron-core's DistributedOptimizer state by buffer bucket (torch_dist "
            f"without --dist-ckpt-optim-fully-reshardable), which names no parameter, so this run's optimizer "
            f"cannot read it")
    if not allowed:
        raise ValueError(f"{what}: pass --no-load-optim or {OPT_IN_FLAG} (here the same: the "
                         f"model and the iteration load, the optimizer and its lr schedule start fresh, the main "
                         f"copies from the model's weights), or save the original run with "
                         f"--dist-ckpt-optim-fully-reshardable.")
    say_on_rank_zero(f"megatron_eopt: {what}; the optimizer and its lr schedule start fresh ({OPT_IN_FLAG}), as "
                     f"with --no-load-optim.")
    return True


def _state_names(keys: Any) -> dict[str, set[str]]:
    """{model key: the state names} of the optimizer-state keys among `keys`."""
    names: dict[str, set[str]] = {}
    for key in keys:
        match = _STATE_KEY.match(key)
        if match:
            names.setdefault(match.group(2), set()).add(match.group(1))
    return names


def load_moved_fresh(load: Callable[[], Any], state_dict: dict, moved: set[str], key: str = "optimizer") -> Any:
    """`load()` (Megatron-LM's dist_checkpointing load of `state_dict`, which returns (loaded state
    dict, ...)) with `state_dict[key]`, our optimizer's request, read around the `moved` parameters'
    state (module docstring); the loaded `[key]` in our chain's structure for its load_state_dict."""
    live = state_dict[key]
    leaves = _sharded_leaves(live)
    reads = {index: leaf for index, leaf in enumerate(leaves) if not _of_moved(leaf.key, moved)}
    state_dict[key] = {READS: reads}
    try:
        loaded = load()
    finally:
        state_dict[key] = live
    saved = loaded[0][key]
    values = saved.pop(READS)
    by_leaf = {id(leaf): values[index] if index in reads else leaf.data for index, leaf in enumerate(leaves)}
    loaded[0][key] = _with_saved_common(live, _resolved(live, by_leaf), core_chain_states(saved) or [], moved)
    return loaded


def _sharded_leaves(tree: Any) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return [value for value in nested_values(tree) if isinstance(value, ShardedBase)]


def _moved_key(key: str) -> Optional[str]:
    """The model key of a parameter's optimizer state (none for its main copy), or None."""
    match = _STATE_KEY.match(key)
    if match:
        return None if match.group(1) in MAIN_COPIES else match.group(2)
    match = _OWN_STATE_KEY.match(key)
    return match.group(2) if match else None


def _keys_of(tree: Any) -> list[str]:
    return [leaf.key for leaf in _sharded_leaves(tree)]


def _of_moved(key: str, moved: set[str]) -> bool:
    return _moved_key(key) in moved


def _resolved(tree: Any, by_leaf: Mapping[int, Any]) -> Any:
    """`tree` with its sharded leaves replaced by what was read (or, for moved state, their data) and
    its local objects unwrapped: what dist_checkpointing's load returns for it."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    if isinstance(tree, dict):
        return {k: _resolved(v, by_leaf) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_resolved(v, by_leaf) for v in tree]
    if isinstance(tree, LocalNonpersistentObject):
        return tree.unwrap()
    return by_leaf.get(id(tree), tree)


def _with_saved_common(live: Any, resolved: Any, saved_children: list, moved: set[str]) -> Any:
    """`resolved` with each child's non-tensor state from the saved child of its kind (module docstring)."""
    live_children = core_chain_states(live) or []
    children = core_chain_states(resolved) or []
    kinds = [_kind(child) for child in saved_children]
    for index, (request, child) in enumerate(zip(live_children, children)):
        matches = [i for i, kind in enumerate(kinds) if kind is not None and kind == _kind(child)]
        fresh = _fresh_scalars(child)
        if matches:
            _take_saved_common(child, saved_children[index if index in matches else matches[0]])
        elif any(key is not None and key not in moved for key in map(_moved_key, _keys_of(request))):
            say_on_rank_zero(f"megatron_eopt: loading, optimizer child {index} (param-group fields "
                             f"{sorted(_kind(child)[0]) if _kind(child) else 'unknown'}) has no saved child of its "
                             f"kind; its unmoved parameters' state loads, but its step, param-group values and "
                             f"scalars are this run's fresh ones.")
        _start_fresh(request, child, fresh, moved)
    return resolved


def _kind(child: Any) -> Optional[tuple]:
    """The child's param-group fields (its torch optimizer's hyperparameters and ours) and whether
    it steps experts: two children of one kind keep state of the same names."""
    layout = core_format_in(child)
    if layout is None:
        return None
    groups = torch_state_of(child, layout)["param_groups"]
    fields = frozenset(k for group in groups for k in group if k not in SAVED_ONLY)
    return fields, frozenset(bool(group.get("is_expert_parallel")) for group in groups)


def _fresh_scalars(child: dict) -> dict:
    """The step and scalars the fresh optimizer keeps per parameter (one value per child)."""
    layout = core_format_in(child)
    if layout is None:
        return {}
    torch_state = torch_state_of(child, layout)
    state = torch_state.get("state")
    fresh = dict(child.get(EXTRA_SCALARS) or {})
    if isinstance(state, Mapping) and COMMON_STEP in state:
        fresh["step"] = state[COMMON_STEP]
    steps = [group["step"] for group in torch_state["param_groups"] if group.get("step") is not None]
    if steps:  # DistributedOptimizer's layout keeps it in the groups; its load spreads it as a tensor
        fresh["step"] = torch.tensor(float(steps[0]))
    return fresh


def _take_saved_common(child: dict, saved: Mapping) -> None:
    """Into `child` (resolved, ours): `saved`'s param-group values, matched by megatron-core's
    identifying values, its step, scalars and loss scale."""
    layout, saved_layout = core_format_in(child), core_format_in(saved)
    if saved_layout != layout:
        return
    torch_state, saved_torch_state = torch_state_of(child, layout), torch_state_of(saved, layout)
    by_identifier = {_identifier(group): group for group in saved_torch_state["param_groups"]}
    torch_state["param_groups"] = [
        {**group, **{k: v for k, v in by_identifier.get(_identifier(group), {}).items() if k not in SAVED_ONLY}}
        for group in torch_state["param_groups"]]
    saved_state, state = saved_torch_state.get("state"), torch_state.get("state")
    if isinstance(saved_state, Mapping) and COMMON_STEP in saved_state and isinstance(state, dict):
        state[COMMON_STEP] = saved_state[COMMON_STEP]
    for name in (EXTRA_SCALARS, "grad_scaler"):
        if saved.get(name) is not None:
            child[name] = saved[name]


def _identifier(group: Mapping) -> tuple:
    """megatron-core's identifying values, but `optimizer`: a run's own optimizer's groups leave it out."""
    return param_group_identifier({**group, "optimizer": None})


def _start_fresh(request: Any, child: dict, fresh: dict, moved: set[str]) -> None:
    """Give each moved parameter's entry the fresh scalars (its step): per parameter, they override
    the child's shared ones (unpack_core_state_dict)."""
    layout = core_format_in(child)
    if layout is None:
        return
    key = layout.param_state_key
    requested = request.get(key) if key else torch_state_of(request, layout).get("state")
    entries = child.get(key) if key else torch_state_of(child, layout).get("state")
    if not fresh or not isinstance(requested, Mapping) or not isinstance(entries, dict):
        return
    for index, values in requested.items():
        if isinstance(values, Mapping) and any(_of_moved(leaf.key, moved) for leaf in _sharded_leaves(values)):
            entries[index] = {**entries[index], **{name: _copy(value) for name, value in fresh.items()}}


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value
