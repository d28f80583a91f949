"""megatron-core's optimizer state in a torch DCP checkpoint (Megatron-LM's `--ckpt-format torch_dcp`), read into ours.

Megatron-LM saves `optimizer.state_dict()` with DCP. megatron-core's optimizer of one child writes
torch's optimizer layout (layouts.py): `optimizer.optimizer.state.<index>.<name>` and
`optimizer.optimizer.param_groups.<g>.<key>` for its Float16OptimizerWithFloat16Params, with the fp32
main copies as `optimizer.fp32_from_fp16_params.<g>.<j>` (`optimizer.state.<index>.<name>` for its
FP32Optimizer), each state a DTensor of its parameter's global shape under FSDP2. Ours loads into
`state_dict(is_loading=True)`, keyed by parameter name. `load_megatron_core_dcp_state` first reads the
saved param groups (small objects), matches them to ours by their identifying values as
megatron-core matches groups, pairs each saved index with our parameter at the same place in the
matched group, and reads every state and main copy straight into our load target's DTensors.
"""

from typing import Any, Optional

from megatron_eopt.checkpointable.child import param_group_identifier

STATE, GROUPS, MAINS = "state", "param_groups", "fp32_from_fp16_params"


def megatron_core_torch_prefix(saved_keys: set[str], key: str = "optimizer") -> Optional[str]:
    """Where a checkpoint's keys hold megatron-core's one-child torch layout under `key`
    (`<key>.optimizer` or `<key>`); None for ours (`<key>.optimizers.`) or anything else."""
    if any(k.startswith(f"{key}.optimizers.") for k in saved_keys):
        return None
    for prefix in (f"{key}.optimizer", key):
        if any(k.startswith(f"{prefix}.{STATE}.") or k.startswith(f"{prefix}.{GROUPS}.") for k in saved_keys):
            return prefix
    return None


def load_megatron_core_dcp_state(target: dict, checkpoint: str, key: str = "optimizer") -> None:
    """Read megatron-core's optimizer state from `checkpoint` into `target`, our chain's
    `state_dict(is_loading=True)` (module docstring). Collective over the default group (DCP's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved_keys = set(FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
    prefix = megatron_core_torch_prefix(saved_keys, key)
    children = target.get("optimizers", {})
    if prefix is None or len(children) != 1:
        raise ValueError(
            f"{checkpoint} holds megatron-core's optimizer state, which megatron_eopt reads from torch_dcp for a "
            f"single optimizer only; this run's optimizer has {sorted(children)}. Load with --no-load-optim.")
    groups = {k: None for k in saved_keys if k.startswith(f"{prefix}.{GROUPS}.")}
    dcp.load(groups, storage_reader=FileSystemReader(checkpoint))
    child = next(iter(children.values()))
    reads = _targets(child, _saved_groups(groups, f"{prefix}.{GROUPS}."), prefix, key, saved_keys, checkpoint)
    dcp.load(reads, storage_reader=FileSystemReader(checkpoint))


def _saved_groups(flat: dict[str, Any], head: str) -> list[dict]:
    groups: dict[int, dict] = {}
    for flat_key, value in flat.items():
        index, name = flat_key[len(head):].split(".", 1)
        groups.setdefault(int(index), {})[name] = value
    return [groups[index] for index in sorted(groups)]


def _targets(child: dict, saved_groups: list[dict], prefix: str, key: str, saved_keys: set[str],
             checkpoint: str) -> dict[str, Any]:
    """{checkpoint key: our target tensor} for every saved state and main copy of our parameters."""
    by_identifier = {_identifier(group): (index, group) for index, group in enumerate(saved_groups)}
    mains, reads = child.get("main_params") or {}, {}
    for live in child[GROUPS].values():
        if not live["params"]:
            continue
        index, saved = by_identifier.get(_identifier(live), (None, None))
        if saved is None or len(saved["params"]) != len(live["params"]):
            raise ValueError(
                f"{checkpoint}: no saved param group of megatron-core's has the identifying values and size of ours "
                f"({_identifier(live)}, {len(live['params'])} parameters): it was saved from another model or setting.")
        for name, position in zip(live["params"], saved["params"]):
            for state_name, value in child[STATE].get(name, {}).items():
                reads[f"{prefix}.{STATE}.{position}.{state_name}"] = value
        for place, name in enumerate(name for name in live["params"] if name in mains):
            reads[f"{key}.{MAINS}.{index}.{place}"] = mains[name]
    missing = sorted(k for k in reads if k not in saved_keys)
    if missing:
        raise ValueError(f"{checkpoint} holds no {missing[:3]} of megatron-core's optimizer state, which this "
                         f"optimizer keeps; it was saved by another kind of optimizer. Load with --no-load-optim.")
    return reads


def _identifier(group: dict) -> tuple:
    """megatron-core's identifying values; its groups leave `optimizer` None for the run's own (one child here)."""
    return param_group_identifier({**group, "optimizer": None})
