"""torch DCP loads of optimizer state saved under another routing: `optimizer_load_planner`.

`dcp.load(state, checkpoint_id=path)` into `optimizer.state_dict(is_loading=True)` (or what torch's
`get_optimizer_state_dict` gives) fails with DCP's `Missing key in checkpoint state_dict` on every
rank when a parameter's optimizer changed since the save (checkpointable/optimizer_change.py). The
planner is made before the load, from the checkpoint alone (no collective), torch's layout by name:
- a parameter whose state the checkpoint holds under another child with the same state names (an
  AdamW run's `dense`, a Muon run's `adam/dense`) is read from there;
- one whose state the checkpoint holds under other names (Adam's `exp_avg` where Muon keeps
  `momentum_buffer`), or not at all, has changed optimizer: a ValueError names them all and the
  opt-in, before DCP reads anything; with `allow_optimizer_change_on_load` their entries are not
  read but set to zero in the load target (the state a new Adam, SGD or Muon-family optimizer
  starts from, step 0), and the param-group entries the checkpoint lacks and the groups' parameter
  lists keep the live values.
Without a change it is DCP's default planner. `load_chain_state` is Megatron-LM's torch_dcp load of ours.
"""

from typing import Any, Mapping, Optional, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, StorageReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.tensor import DTensor

from megatron_eopt.checkpointable.optimizer_change import (Owner, allows_optimizer_change, optimizer_changes,
                                                          settle_optimizer_changes)

STATE = "state"
GROUPS = "param_groups"
GROUP_MEMBERS = ("params", "param_fqns", "param_names")  # a param group's parameters: the live ones


def optimizer_load_planner(optimizer: Any, state_dict: Mapping, checkpoint: Union[str, StorageReader]
                           ) -> DefaultLoadPlanner:
    """The planner for `dcp.load(state_dict, checkpoint_id=checkpoint, planner=...)` (module docstring)."""
    return _planner(_live_children(optimizer), allows_optimizer_change(optimizer), state_dict, checkpoint)


def load_chain_state(target: dict, checkpoint: str, allowed: bool, key: str = "optimizer") -> None:
    """Read into `target`, a chain's `state_dict(is_loading=True)`, what `checkpoint` (a DCP directory)
    holds under `key`, through the planner above (Megatron-LM's `--ckpt-format torch_dcp` load of
    ours: integrations/megatron_lm.py); `allowed`: the opt-in. Collective over the default group."""
    import torch.distributed.checkpoint as dcp

    state = {key: target}
    children = {name: child for child, entry in target.get("optimizers", {}).items() for name in entry.get(STATE, {})}
    planner = _planner(children, allowed, state, checkpoint)
    dcp.load(state, storage_reader=FileSystemReader(checkpoint), planner=planner)


def _planner(live_children: dict[str, str], allowed: bool, state_dict: Mapping,
             checkpoint: Union[str, StorageReader]) -> DefaultLoadPlanner:
    reader = FileSystemReader(checkpoint) if isinstance(checkpoint, str) else checkpoint
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    flat, mappings = flatten_state_dict(dict(state_dict))
    if all(key in saved_keys for key in flat):
        return DefaultLoadPlanner()
    live_paths, saved_named = _positions_as_names(state_dict, mappings, saved_keys, reader)
    live_named = {key: ".".join(map(str, path)) for key, path in live_paths.items()}
    flat = {live_named.get(key, key): value for key, value in flat.items()}
    mappings = {live_named.get(key, key): live_paths.get(key, path) for key, path in mappings.items()}
    saved_keys = {saved_named.get(key, key) for key in saved_keys}
    missing = [key for key in flat if key not in saved_keys]
    if not missing:  # every position's state is there under its name: read each from where it was saved
        return _RenamingPlanner.named(live_named, saved_named, {}, set())
    live_state = _state_keys({key: mappings[key] for key in flat}, live_children)
    saved_state = _saved_state_names(saved_keys, set(live_children))
    renames, changes, fresh = {}, [], set()
    for name in sorted({live_state[key][1] for key in missing if key in live_state}):
        keys = {key: entry for key, entry in live_state.items() if entry[1] == name}
        names = {entry[2] for entry in keys.values()}
        source = next((prefix for prefix, held in saved_state.get(name, {}).items() if held == names), None)
        if source is not None:
            head = f"{source}.{STATE}" if source else STATE
            renames.update({key: f"{head}.{name}.{entry[2]}" for key, entry in keys.items() if key in missing})
            continue
        saved = saved_state.get(name, {})
        changes.append((name, _owner(*next(iter(saved.items()))) if saved else None,
                        Owner(live_children[name], ", ".join(sorted(names)))))
        fresh.update(key for key in keys if key in missing)
    if not changes and not renames:  # missing keys of another kind: DCP names the first one
        return DefaultLoadPlanner()
    _settle(changes, allowed)
    for key in fresh:  # a load target may be uninitialized (state_dict(is_loading=True) under FSDP2)
        _zero(flat[key])
    skipped = fresh | {key for key in missing if key not in live_state and key not in renames}
    skipped |= {key for key in flat if _live_group_entry(mappings[key], {name for name, _, _ in changes})}
    return _RenamingPlanner.named(live_named, saved_named, renames, skipped)


def _positions_as_names(state_dict: Mapping, mappings: Mapping[str, tuple], saved_keys: set[str],
                        reader: StorageReader) -> tuple[dict[str, tuple], dict[str, str]]:
    """({live key: its path by name}, {saved key: its key by name}) for the state kept by position in
    torch's layout: `<prefix>.state.<position>.<state>` becomes `<prefix>.state.<parameter name>.<state>`,
    the live positions named by the load target's groups, the saved ones by the groups the checkpoint
    holds (read here, in this process alone)."""
    live_named, saved_named = {}, {}
    prefixes = {path[:path.index(STATE)] for path in mappings.values()  # a position: "3" in DCP's paths
                if STATE in path and path.index(STATE) + 1 < len(path) and str(path[path.index(STATE) + 1]).isdigit()}
    for prefix in prefixes:
        live = _position_names(_at(state_dict, prefix)[GROUPS])
        saved = _position_names(_saved_groups(prefix, saved_keys, reader))
        head = ".".join(map(str, prefix + (STATE,)))
        for key, path in mappings.items():
            position = str(path[len(prefix) + 1]) if path[:len(prefix) + 1] == prefix + (STATE,) else ""
            if position.isdigit() and int(position) in live:
                live_named[key] = (*prefix, STATE, live[int(position)], *path[len(prefix) + 2:])
        for key in saved_keys:
            position, _, rest = key[len(head) + 1:].partition(".") if key.startswith(f"{head}.") else ("", "", "")
            if position.isdigit() and int(position) in saved:
                saved_named[key] = f"{head}.{saved[int(position)]}.{rest}"
    return live_named, saved_named


def _at(tree: Mapping, path: tuple) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _position_names(groups: list) -> dict[int, str]:
    return {position: name for group in groups if "param_names" in group
            for position, name in zip(group["params"], group["param_names"]) if isinstance(position, int)}


def _saved_groups(prefix: tuple, saved_keys: set[str], reader: StorageReader) -> list[dict]:
    """The param groups' `params` and `param_names` the checkpoint holds at `prefix` (torch's layout)."""
    import torch.distributed.checkpoint as dcp

    head = ".".join(map(str, prefix + (GROUPS,)))
    indices = sorted({int(key[len(head) + 1:].split(".")[0]) for key in saved_keys
                      if key.startswith(f"{head}.") and key.endswith(".param_names")})
    groups = [{"params": [], "param_names": []} for _ in indices]
    target: dict = {GROUPS: groups}
    for part in reversed(prefix):
        target = {part: target}
    dcp.load(target, storage_reader=reader, no_dist=True)
    return groups


def _live_group_entry(path: tuple, moved: set[str]) -> bool:
    """Whether a param-group entry keeps its live value once parameters moved: the groups' parameter
    lists; torch's nested layout's groups, which are numbered (group i saved may not be group i now);
    its flattened layout's entries of a moved parameter (`param_groups.<name>.<key>`). Ours are keyed
    by group key, so a group the checkpoint holds loads."""
    parts = [str(part) for part in path]
    last = parts[-1]  # flattened: 'param_groups.<name>.<key>' in one part
    if last in GROUP_MEMBERS or (last.startswith(f"{GROUPS}.") and last.rsplit(".", 1)[-1] in GROUP_MEMBERS):
        return True
    if GROUPS in parts and parts.index(GROUPS) + 1 < len(parts) and parts[parts.index(GROUPS) + 1].isdigit():
        return True
    flattened = [part for part in parts if part.startswith(f"{GROUPS}.")]
    return bool(flattened) and _split_state(flattened[0], moved) is not None


def _zero(value: Any) -> None:
    """Fresh state, as torch's optimizers and the Muon family start it: zero moments and momentum, step 0."""
    local = value.to_local() if isinstance(value, DTensor) else value
    if torch.is_tensor(local):
        with torch.no_grad():
            local.zero_()


def _settle(changes: list, allowed: bool) -> None:
    found = optimizer_changes({name: saved for name, saved, _ in changes if saved is not None},
                              {name: live for name, _, live in changes})
    settle_optimizer_changes(found, allowed, "loading optimizer state with torch DCP")


def _owner(prefix: str, names: set[str]) -> Owner:
    """The saved child (ours: `...optimizers.<child>`; torch's layouts name none) and its state names."""
    return Owner(prefix.rsplit("optimizers.", 1)[-1] if "optimizers." in prefix else "saved", ", ".join(sorted(names)))


def _live_children(optimizer: Any) -> dict[str, str]:
    """{parameter name (fqn and stored name): the child that steps it}."""
    children = {}
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param in child.checkpoint_params():
            children[param.fqn] = children[param.stored_name] = child.name
    return children


def _state_keys(paths: Mapping[str, tuple], names: Mapping[str, str]) -> dict[str, tuple[str, str, str]]:
    """{flat key: (prefix, parameter name, state name)} of the keys that hold a parameter's state:
    `<prefix>.state.<name>.<state>` nested (ours, torch's) or flattened (`state.<name>.<state>` in one)."""
    found = {}
    for key, path in paths.items():
        parts = [str(part) for part in path]
        for index, part in enumerate(parts):
            if part == STATE and index + 2 < len(parts) and parts[index + 1] in names:
                found[key] = (".".join(parts[:index]), parts[index + 1], ".".join(parts[index + 2:]))
                break
            split = _split_state(part, names) if part.startswith(f"{STATE}.") else None
            if split is not None:
                found[key] = (".".join(parts[:index]), *split)
                break
    return found


def _split_state(text: str, names: Any) -> Optional[tuple[str, str]]:
    """'state.<name>.<state>' -> (name, state) for a live parameter name (the longest that fits)."""
    words = text.split(".")[1:]
    for stop in range(len(words) - 1, 0, -1):
        name = ".".join(words[:stop])
        if name in names:
            return name, ".".join(words[stop:])
    return None


def _saved_state_names(saved_keys: set[str], names: set[str]) -> dict[str, dict[str, set[str]]]:
    """{parameter name: {prefix: the state names the checkpoint holds for it there}}."""
    held: dict[str, dict[str, set[str]]] = {}
    for key in saved_keys:
        start = key.find(f"{STATE}.")
        while start >= 0:
            if start == 0 or key[start - 1] == ".":
                split = _split_state(key[start:], names)
                if split is not None:
                    held.setdefault(split[0], {}).setdefault(key[:max(start - 1, 0)], set()).add(split[1])
                    break
            start = key.find(f"{STATE}.", start + 1)
    return held


class _RenamingPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading `renames`' keys from other checkpoint keys and leaving `skipped` as they are."""

    def __init__(self, renames: dict[str, str], skipped: set[str]) -> None:
        super().__init__()
        self._renames, self._skipped = renames, skipped

    @classmethod
    def named(cls, live_named: dict[str, str], saved_named: dict[str, str], renames: dict[str, str],
              skipped: set[str]) -> "_RenamingPlanner":
        """The planner for keys by name (`_positions_as_names`), back in the keys the target and the
        checkpoint hold: every live key read from the saved key of the same name unless renamed."""
        live_key = {named: key for key, named in live_named.items()}
        saved_key = {named: key for key, named in saved_named.items()}
        reads = {named: renames.get(named, named) for named in live_key}
        reads.update(renames)
        return cls({live_key.get(named, named): saved_key.get(source, source) for named, source in reads.items()},
                   {live_key.get(named, named) for named in skipped})

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, saved in self._renames.items():
            self.mappings[saved] = self.mappings[key]

    def create_local_plan(self) -> Any:
        """The default plan of the renamed and kept keys (not the parent's fallback to torch 2.3's key
        format, which the keys the checkpoint holds beyond the live ones would trigger)."""
        self.state_dict = {self._renames.get(key, key): value for key, value in self.state_dict.items()
                           if key not in self._skipped}
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
