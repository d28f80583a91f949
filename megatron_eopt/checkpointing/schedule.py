"""The lr scheduler's part of a checkpoint, checked before anything is loaded.

megatron-core's `OptimizerParamScheduler.load_state_dict` asserts that the checkpoint's schedule
(lr, min lr, warmup and decay steps, decay style, weight-decay range) equals its own, unless a
flag says which to keep:
- `override_opt_param_scheduler`: this run's values; only the step count comes from the checkpoint;
- `use_checkpoint_opt_param_scheduler`: the checkpoint's values.
Its assertion fires halfway through loading. Here the comparison runs first, on every rank, and
a mismatch is a CheckpointError naming each value and the two flags. The param groups'
`max_lr`/`min_lr` are compared too, and restored only with `use_checkpoint_opt_param_scheduler`,
so the flags hold for them as well.
"""

import json
from typing import Any, Callable, Optional

from megatron_eopt.checkpointing.global_names import stored_child_name, stored_group_key
from megatron_eopt.checkpointing.storage import CheckpointError
from megatron_eopt.checkpointable.child import CheckpointableChild

SCHEDULER_KEY = "scheduler"  # the scheduler's state_dict (JSON)
LR_BOUNDS_KEY = "scheduler_lr_bounds"  # {child: {group_key: [max_lr, min_lr]}} (JSON)
# state_dict key -> what megatron-core's load_state_dict calls it.
SCHEDULE_VALUES = {
    "max_lr": "learning rate",
    "min_lr": "minimum learning rate",
    "lr_warmup_steps": "warmup steps",
    "lr_decay_steps": "decay steps",
    "lr_decay_style": "learning rate decay style",
    "start_wd": "start weight decay",
    "end_wd": "end weight decay",
    "wd_incr_steps": "weight decay increment steps",
    "wd_incr_style": "weight decay increment style",
}
FLAGS = ("pass --override-opt_param-scheduler to keep this run's schedule (the step count still comes "
         "from the checkpoint) or --use-checkpoint-opt_param-scheduler to keep the checkpoint's "
         "(Python: SchedulerConfig.override_opt_param_scheduler / use_checkpoint_opt_param_scheduler)")


def scheduler_entries(scheduler: Any, children: list[CheckpointableChild]) -> dict[str, str]:
    return {SCHEDULER_KEY: json.dumps(scheduler.state_dict()), LR_BOUNDS_KEY: json.dumps(_lr_bounds(children))}


def _lr_bounds(children: list[CheckpointableChild]) -> dict[str, dict[str, list]]:
    # By stored names: an expert child's groups merge into its dense child's (global_names.py).
    bounds: dict[str, dict[str, list]] = {}
    for child in children:
        groups = bounds.setdefault(stored_child_name(child.name), {})
        for g in child.param_groups:
            groups[stored_group_key(g["group_key"])] = [g.get("max_lr"), g.get("min_lr")]
    return bounds


def plan_scheduler_load(scheduler: Any, saved_json: str, bounds_json: Optional[str],
                        children: list[CheckpointableChild], path: str) -> Callable[[], None]:
    """Check the saved schedule against `scheduler` (raises, changing nothing); returns the load."""
    saved = json.loads(saved_json)
    saved_bounds = json.loads(bounds_json) if bounds_json is not None else {}
    override = bool(getattr(scheduler, "override_opt_param_scheduler", False))
    use_checkpoint = bool(getattr(scheduler, "use_checkpoint_opt_param_scheduler", False)) and not override
    if not override and not use_checkpoint:
        differences = _schedule_differences(scheduler, saved) + _bound_differences(scheduler, children, saved_bounds, saved)
        if differences:
            raise CheckpointError(
                f"the lr schedule of {path} differs from this run's: {'; '.join(differences)}. Nothing "
                f"was loaded; {FLAGS}."
            )

    def load() -> None:
        if use_checkpoint:
            _restore_bounds(children, saved_bounds)
        scheduler.num_steps = 0  # load_state_dict adds the saved step count to the current one
        scheduler.load_state_dict(saved)

    return load


def _schedule_differences(scheduler: Any, saved: dict) -> list[str]:
    differences = []
    for key, description in SCHEDULE_VALUES.items():
        if key in saved and getattr(scheduler, key) != saved[key]:
            differences.append(f"{description} ({key}): checkpoint {saved[key]!r}, now {getattr(scheduler, key)!r}")
    return differences


def _bound_differences(scheduler: Any, children: list[CheckpointableChild], saved_bounds: dict, saved: dict) -> list[str]:
    """Group bounds that differ other than as the scheduler's own lr / min lr do (said once above)."""
    explained = {(saved.get("max_lr"), scheduler.max_lr), (saved.get("min_lr"), scheduler.min_lr)}
    differences = []
    for child_name, groups in _lr_bounds(children).items():
        for key, live in groups.items():
            stored = saved_bounds.get(child_name, {}).get(key)
            if stored is None:
                continue
            for name, old, new in zip(("max_lr", "min_lr"), stored, live):
                if old != new and (old, new) not in explained:
                    differences.append(f"{name} of param group {key!r} of {child_name!r}: checkpoint {old!r}, now {new!r}")
    return differences


def _restore_bounds(children: list[CheckpointableChild], saved_bounds: dict) -> None:
    for child in children:
        stored_groups = saved_bounds.get(stored_child_name(child.name), {})
        for group in child.param_groups:
            stored = stored_groups.get(stored_group_key(group["group_key"]))
            if stored is not None:
                group["max_lr"], group["min_lr"] = stored
