"""Parameters whose optimizer changed since a megatron-core-layout `torch_dist` checkpoint was saved.

Our sharded state dict asks for `[chained_<i>.]optimizer.state.<state name>.<model key>`
(dist_checkpointing.py). When a parameter's optimizer changed (checkpointable/optimizer_change.py),
the checkpoint holds its state under other state names (Adam's `exp_avg` where Muon keeps
`momentum_buffer`), and `dist_checkpointing.load` fails on the first missing key.
`refuse_moved_state` reads the checkpoint's keys first (its metadata, no collective) and refuses
in one ValueError naming every such parameter: Megatron-LM's `torch_dist` load does not start
their state fresh (its `torch_dcp` load does).
"""

import re
from typing import Any

from megatron_eopt.checkpointable.optimizer_change import OPT_IN_FLAG, Owner, optimizer_changes, settle_optimizer_changes
from megatron_eopt.megatron_core_formats.layouts import STATE_PREFIX

_STATE_KEY = re.compile(rf"^(?:chained_\d+\.)?{re.escape(STATE_PREFIX)}\.([^.]+)\.(.+)$")
REMEDY = (f"Megatron-LM's torch_dist load does not start their state fresh ({OPT_IN_FLAG} applies to "
          f"--ckpt-format torch_dcp); load the model only (--no-load-optim) to start all optimizer state fresh.")


def refuse_moved_state(optimizer_state_dict: Any, checkpoint_dir: str) -> None:
    """Raise ValueError naming the parameters whose optimizer state the checkpoint holds under other
    state names than `optimizer_state_dict` (our sharded_state_dict(is_loading=True)) asks for."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = _state_names(FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata)
    except (OSError, ValueError, RuntimeError):  # no or a damaged checkpoint: dist_checkpointing's load says so
        return
    live = _state_names(value.key for value in nested_values(optimizer_state_dict) if isinstance(value, ShardedTensor))
    # with no saved state at all (saved before its first step, or another model) dist_checkpointing names it
    missing = {name for name, names in live.items() if saved.get(name) and not names <= saved[name]}
    changes = optimizer_changes({name: Owner("saved", ", ".join(sorted(saved[name]))) for name in missing},
                                {name: Owner("now", ", ".join(sorted(live[name]))) for name in missing})
    settle_optimizer_changes(changes, False, f"loading {checkpoint_dir}", remedy=REMEDY)


def _state_names(keys: Any) -> dict[str, set[str]]:
    """{model key: the state names} of the optimizer-state keys among `keys`."""
    names: dict[str, set[str]] = {}
    for key in keys:
        match = _STATE_KEY.match(key)
        if match:
            names.setdefault(match.group(2), set()).add(match.group(1))
    return names
