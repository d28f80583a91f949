"""Optimizer state of DTensor-sharded models (torch FSDP2, Megatron-FSDP) in megatron-core's
`fsdp_dtensor` layout: what Megatron-LM's `--ckpt-format fsdp_dtensor` saves and loads with torch
DCP (`torch.distributed.checkpoint`) through `optimizer.sharded_state_dict(..., metadata=
{'distrib_optim_sharding_type': 'fsdp_dtensor'})`.

A chain's dict is `{'state': {fqn: {name: value}}, 'param_to_group_meta': {fqn: group fields}}`, as
megatron-core's DistributedOptimizer writes it for Megatron-FSDP (the fields add the optimizer's
class, checked on load). State shaped like the parameter's shard is a DTensor, Shard(0)
on the parameter's mesh, its rows where the parameter's are: the shards may be uneven or empty, so
each carries its chunk (offset, size) for DCP, from one all_gather of the ranks' row counts over
the mesh. Scalars (the step) stay plain. A load's targets are new tensors: the live state changes
only in `load_state_dict`, after DCP has read everything, and another DP size reads other rows.
"""

from typing import Any, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor, Shard

from megatron_eopt.ops.row_shards import gathered_rows
from megatron_eopt.wrappers.base import CheckpointableChild, ChildParam
from megatron_eopt.wrappers.flat_state import param_group_identifier

FSDP_DTENSOR = "fsdp_dtensor"  # megatron-core's distrib_optim_sharding_type for Megatron-FSDP
SHARDING_TYPE_KEY = "distrib_optim_sharding_type"
GROUP_META = "param_to_group_meta"
OPTIMIZER_CLASS = "optimizer_class"
GROUP_FIELDS_LEFT_OUT = ("params", "param_fqns")  # which parameters: the keys say it


def asks_for_fsdp_dtensor(metadata: Optional[Mapping]) -> bool:
    return (metadata or {}).get(SHARDING_TYPE_KEY) == FSDP_DTENSOR


def is_fsdp_dtensor_state(state_dict: Any) -> bool:
    """Whether `state_dict` is optimizer state in the fsdp_dtensor layout (a chain's or one child's)."""
    return isinstance(state_dict, Mapping) and {"state", GROUP_META} <= set(state_dict)


def merged_fsdp_dtensor_states(states: list[dict]) -> dict:
    """A chain's children's dicts as one, as megatron-core's one DistributedOptimizer writes it for
    Megatron-FSDP (and as Megatron-LM's SwiGLU step reads it): their parameters are disjoint."""
    return {"state": {fqn: entries for state in states for fqn, entries in state["state"].items()},
            GROUP_META: {fqn: fields for state in states for fqn, fields in state[GROUP_META].items()}}


def check_names(state_dict: Mapping, fqns: list[str]) -> None:
    """The checkpoint holds state of exactly these parameters (the chain's), else one-line ValueError."""
    saved = set(state_dict[GROUP_META])
    missing, extra = sorted(set(fqns) - saved), sorted(saved - set(fqns))
    if missing or extra:
        raise ValueError(f"the fsdp_dtensor optimizer state is of other parameters: missing in it {missing[:3]}, "
                         f"only in it {extra[:3]} (of {len(missing)} and {len(extra)}); load the matching model.")


def fsdp_dtensor_state_dict(child: CheckpointableChild, is_loading: bool) -> dict:
    """The child's state in the fsdp_dtensor layout (module docstring); with `is_loading`, empty
    targets of the same structure for DCP to read into. A collective over the parameters' mesh."""
    if is_loading:
        child.init_state()
    flat = child.state_dict()
    params = child.checkpoint_params()
    offsets = _row_offsets(params)
    state = {}
    for param in params:
        entries = flat["state"].get(param.fqn, {})
        state[param.fqn] = {name: _stored(child, param, name, value, offsets[param.fqn], is_loading)
                            for name, value in entries.items()}
    meta = {}
    for group in flat["param_groups"].values():
        fields = {k: v for k, v in group.items() if k not in GROUP_FIELDS_LEFT_OUT}
        meta.update({fqn: {**fields, OPTIMIZER_CLASS: flat[OPTIMIZER_CLASS]} for fqn in group["params"]})
    return {"state": state, GROUP_META: meta}


def flat_from_fsdp_dtensor(state_dict: Mapping, fqns: list[str], live_class: str) -> dict:
    """What DCP loaded into `fsdp_dtensor_state_dict`'s targets -> the flat `state_dict()`
    (wrappers/flat_state.py) of the child stepping `fqns`: this rank's rows of each state, groups
    rebuilt from the per-parameter fields. megatron-core's own writes name no optimizer class: the
    live one is assumed (shapes are checked)."""
    fields_of = {fqn: state_dict[GROUP_META][fqn] for fqn in fqns if fqn in state_dict[GROUP_META]}
    # detach(): a tensor object of its own, without the DCP hooks `row_sharded` set on the target
    state = {fqn: {name: value.to_local().detach() if isinstance(value, DTensor) else value
                   for name, value in entries.items()}
             for fqn, entries in state_dict["state"].items() if fqn in fields_of}
    groups: dict[str, dict] = {}
    for fqn, fields in fields_of.items():
        key = fields.get("group_key", str(param_group_identifier(fields)))
        groups.setdefault(key, {**fields, "group_key": key, "params": []})["params"].append(fqn)
    classes = sorted({fields.get(OPTIMIZER_CLASS, live_class) for fields in fields_of.values()})
    return {OPTIMIZER_CLASS: " and ".join(classes) or live_class, "param_groups": groups, "state": state,
            "grad_scaler": None}


def _row_offsets(params: list[ChildParam]) -> dict[str, int]:
    """fqn -> the first row of this rank's shard in the whole parameter."""
    if not params:
        return {}
    first = params[0].model
    if not isinstance(first, DTensor):
        raise TypeError(f"parameter {params[0].fqn!r} is not a DTensor; the fsdp_dtensor layout is for models "
                        f"sharded by torch FSDP2 or Megatron-FSDP (megatron-core's format: metadata without it).")
    rows = gathered_rows([p.model.to_local().shape[0] for p in params], first.device_mesh.get_group(), first.device)
    rank = first.device_mesh.get_local_rank()
    return {p.fqn: sum(split[:rank]) for p, split in zip(params, rows)}


def _stored(child: CheckpointableChild, param: ChildParam, name: str, value: Any, row_offset: int,
            is_loading: bool) -> Any:
    """A state value as saved: shaped like the shard, a DTensor; a scalar, itself (a load's target: a copy)."""
    shard_shape = param.model.to_local().shape
    if torch.is_tensor(value) and value.dim() > 0 and value.shape == shard_shape:
        return row_sharded(torch.empty_like(value) if is_loading else value.detach(), param.model, row_offset)
    if torch.is_tensor(value) and value.dim() == 0:
        return value.clone() if is_loading else value
    if isinstance(value, (bool, int, float, str)):
        return value
    shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
    raise ValueError(
        f"optimizer {child.name!r} keeps state {name!r} ({shape}) for parameter {param.fqn!r}, whose shard here is "
        f"{tuple(shard_shape)}; the fsdp_dtensor layout holds state shaped like the shard and scalars only. "
        f"Use megatron_eopt.checkpointing.save_checkpoint for this optimizer."
    )


def row_sharded(local: torch.Tensor, param: DTensor, row_offset: int) -> DTensor:
    """`local` (this rank's rows of a tensor shaped like `param`) as a DTensor laid out like `param`,
    with its chunk for DCP: DCP's own offsets assume torch.chunk's split, Megatron-FSDP's is not."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    tensor = DTensor.from_local(local, param.device_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                stride=param.stride())
    offsets = (row_offset,) + (0,) * (local.dim() - 1)
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape)

    def write_items(fqn: str, _: Any) -> list:
        if local.numel() == 0:  # an empty shard writes nothing
            return []
        data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=param.shape)
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk.offsets), tensor_data=data)]

    # torch's DTensor hands DCP's planners these hooks of its local tensor when it has them.
    tensor._local_tensor.__create_chunk_list__ = lambda: [chunk]
    tensor._local_tensor.__create_write_items__ = write_items
    return tensor
