"""Optimizer state of DTensor-sharded models (torch FSDP2, Megatron-FSDP) as DTensors, for torch DCP
(`torch.distributed.checkpoint`): in `optimizer.state_dict()` (`dtensor_state_dict`: our flat layout,
as torch's own optimizers keep state under FSDP2; torchtitan's flow and Megatron-LM's
`--ckpt-format torch_dcp`), and in megatron-core's `fsdp_dtensor` layout: what Megatron-LM's
`--ckpt-format fsdp_dtensor` saves and loads through `optimizer.sharded_state_dict(..., metadata=
{'distrib_optim_sharding_type': 'fsdp_dtensor'})`.

A chain's dict is `{'state': {fqn: {name: value}}, 'param_to_group_meta': {fqn: group fields}}`, as
megatron-core's DistributedOptimizer writes it for Megatron-FSDP (the fields add the optimizer's
class, checked on load). State holding this rank's rows of the parameter is a DTensor, Shard(0)
on the parameter's mesh, its rows where the parameter's are: the shards may be uneven or empty, so
each carries its chunk (offset, size) for DCP, from one all_gather of the ranks' row counts over
the mesh. A statistic of the whole matrix, equal on every rank, is a replicated DTensor; a scalar
(the step) a 0-dim tensor (`_scalar`). A load's targets are new tensors: the live state changes
only in `load_state_dict`, after DCP has read everything, and another DP size reads other rows.
"""

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_eopt.ops.row_shards import gathered_rows, sharded_dim
from megatron_eopt.params.expert_names import unnamed_expert_layout
from megatron_eopt.checkpointable.child import CheckpointableChild, ChildParam

FSDP_DTENSOR = "fsdp_dtensor"  # megatron-core's distrib_optim_sharding_type for Megatron-FSDP
SHARDING_TYPE_KEY = "distrib_optim_sharding_type"
GROUP_META = "param_to_group_meta"
OPTIMIZER_CLASS = "optimizer_class"
GROUP_FIELDS_LEFT_OUT = ("params", "param_fqns")  # which parameters: the keys say it
OWN_GROUP_FIELDS = ("group_key", "optimizer")  # ours, which megatron-core's groups lack


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
    flat = dtensor_state_dict(child, is_loading)
    if flat.get("main_params"):
        raise ValueError(
            f"optimizer {child.name!r} keeps fp32 main weights of bf16 DTensor parameters (e.g. "
            f"{next(iter(flat['main_params']))!r}), which megatron-core's fsdp_dtensor layout has no place for "
            f"(Megatron-FSDP keeps its fp32 main weights as the parameters); save them with state_dict() and "
            f"torch DCP (Megatron-LM: --ckpt-format torch_dcp) or megatron_eopt.checkpointing.save_checkpoint.")
    state = {param.stored_name: flat["state"].get(param.stored_name, {}) for param in child.checkpoint_params()}
    # A load asks only for the fields megatron-core writes too, so that its checkpoints load (Megatron-LM
    # reads strictly); the live groups take what was saved with their parameters (flat_from_fsdp_dtensor).
    left_out = GROUP_FIELDS_LEFT_OUT + (OWN_GROUP_FIELDS if is_loading else ())
    ours = {} if is_loading else {OPTIMIZER_CLASS: flat[OPTIMIZER_CLASS]}
    meta = {}
    for group in flat["param_groups"].values():
        fields = {k: v for k, v in group.items() if k not in left_out}
        meta.update({name: {**fields, **ours} for name in group["params"]})
    return {"state": state, GROUP_META: meta}


def dtensor_state_dict(child: CheckpointableChild, is_loading: bool) -> dict:
    """The child's flat state dict (wrappers/flat_state.py) as torch's own optimizers keep state
    under FSDP2, keyed by each parameter's stored name (a routed expert's on a mesh of its own by
    its global index, so that the EP ranks' experts do not collide): each tensor holding this
    rank's rows of its parameter (the moments; per-row
    statistics) a DTensor laid out like the parameter (`row_sharded`), each statistic of the whole
    matrix, equal on every rank (normuon's per-column second moment), a replicated DTensor;
    scalars 0-dim tensors (`_scalar`). State torch's optimizers make at their first step is made
    first, so the dict is a complete target; with `is_loading` its tensors are new ones for DCP to
    read into. Collectives over the parameters' mesh."""
    child.init_state()
    every_param = child.checkpoint_params()
    flat = renamed(child.local_state_dict(), stored_names(child.name, every_param))
    placed = {param.stored_name for param in every_param if param.fqn in getattr(child, "placed_fqns", ())}
    every_param = [param._replace(fqn=param.stored_name) for param in every_param]
    params = [param for param in every_param if param.fqn in flat["state"]]
    tensors = [(param, name, value) for param in params for name, value in flat["state"][param.fqn].items()
               if torch.is_tensor(value) and value.dim() > 0]
    _refuse_unlike_parts(child, [(p, name, value) for p, name, value in tensors if p.fqn in placed])
    row_sharded_state, offsets = _split_state([p for p in every_param if p.fqn not in placed],
                                              [(p, name, value) for p, name, value in tensors if p.fqn not in placed])
    replicated = [(p, name, value) for p, name, value in tensors
                  if p.fqn not in placed and (p.fqn, name) not in row_sharded_state]
    _refuse_on_two_dimensional_meshes(child, replicated)
    if not is_loading:
        _check_replicated(child, replicated)
    stored = {}
    for param, name, value in tensors:
        local = torch.empty_like(value) if is_loading else value.detach()
        if param.fqn in placed:
            stored[param.fqn, name] = placed_like(local, param.model)
        elif (param.fqn, name) in row_sharded_state:
            stored[param.fqn, name] = row_sharded(local, param.model, offsets[param.fqn])
        else:
            stored[param.fqn, name] = DTensor.from_local(local, param.model.device_mesh, [Replicate()], run_check=False)
    flat["state"] = {param.fqn: {name: stored[param.fqn, name] if (param.fqn, name) in stored
                                 else _scalar(child, param, name, value, is_loading)
                                 for name, value in flat["state"][param.fqn].items()}
                     for param in params}
    if flat.get("main_params"):  # fp32 main weights of 16-bit parameters: this rank's rows, like the parameter's
        model_of = {param.fqn: param.model for param in every_param}
        mains = {fqn: torch.empty_like(main) if is_loading else main.detach()
                 for fqn, main in flat["main_params"].items()}
        flat["main_params"] = {fqn: placed_like(main, model_of[fqn]) if fqn in placed else
                               row_sharded(main, model_of[fqn], offsets[fqn]) for fqn, main in mains.items()}
    return flat


def placed_like(local: torch.Tensor, param: DTensor) -> DTensor:
    """`local`, shaped like this rank's part of `param`, as a DTensor placed like `param` (any mesh,
    any Shard/_StridedShard/Replicate placements: DCP saves a replicated part once)."""
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _refuse_unlike_parts(child: CheckpointableChild, tensors: list[tuple[ChildParam, str, torch.Tensor]]) -> None:
    """State of a parameter on the placed path (ops/placed_matrices.py) is elementwise: shaped like its part."""
    for param, name, value in tensors:
        if value.shape != param.model.to_local().shape:
            raise ValueError(
                f"optimizer {child.name!r} keeps state {name!r} {tuple(value.shape)} for parameter {param.fqn!r} "
                f"placed {tuple(param.model.placements)}, not shaped like its part "
                f"{tuple(param.model.to_local().shape)}; DTensor optimizer state of such placements holds "
                f"elementwise state only.")


def _split_state(params: list[ChildParam], tensors: list[tuple[ChildParam, str, torch.Tensor]]
                 ) -> tuple[set[tuple[str, str]], dict[str, int]]:
    """Which state tensors hold this rank's rows of their parameter (on every rank, as many rows as
    the parameter's shard), and each parameter's first row here among its data-parallel ranks' rows:
    one all_gather of row counts."""
    if not params:
        return set(), {}
    first = params[0].model
    if not isinstance(first, DTensor):
        raise TypeError(f"parameter {params[0].fqn!r} is not a DTensor; DTensor optimizer state is for models "
                        f"sharded by torch FSDP2 or Megatron-FSDP (megatron-core's format: metadata without it).")
    dims = [sharded_dim(p.model) for p in params]  # 0, or 1 for experts placed Shard(1)
    dim_of = {p.fqn: d for p, d in zip(params, dims)}
    counts = [p.model.to_local().shape[d] for p, d in zip(params, dims)] + [
        value.shape[dim_of[p.fqn]] if value.dim() > dim_of[p.fqn] else -1 for p, _, value in tensors]
    # The data-parallel group is every mesh's first dimension (Megatron-FSDP's (dp, tp) mesh's dp),
    # the same ranks for all the parameters of a child (placement/fully_sharded_layout.py checks it).
    rows = gathered_rows(counts, first.device_mesh.get_group(0), first.device)
    param_rows = dict(zip((p.fqn for p in params), rows))
    rank = first.device_mesh.get_local_rank(0)
    offsets = {fqn: sum(split[:rank]) for fqn, split in param_rows.items()}
    row_state = {(param.fqn, name) for (param, name, _), split in zip(tensors, rows[len(params):])
                 if split == param_rows[param.fqn]}
    return row_state, offsets


def _refuse_on_two_dimensional_meshes(child: CheckpointableChild,
                                      replicated: list[tuple[ChildParam, str, torch.Tensor]]) -> None:
    """On Megatron-FSDP's 2-D (dp, tp) mesh each TP rank holds its own part of the matrix, so a
    statistic of the part is not one tensor that every rank of the mesh holds."""
    for param, name, value in replicated:
        if param.model.device_mesh.ndim > 1:
            raise ValueError(
                f"optimizer {child.name!r} keeps state {name!r} {tuple(value.shape)} for parameter {param.fqn!r} "
                f"on the 2-D (dp, tp) mesh of TP x Megatron-FSDP, not shaped like its shard "
                f"{tuple(param.model.to_local().shape)}; DTensor optimizer state holds such state at TP=1 only. "
                f"Checkpoint this optimizer at --tensor-model-parallel-size 1 --expert-tensor-parallel-size 1."
            )


def _check_replicated(child: CheckpointableChild, replicated: list[tuple[ChildParam, str, torch.Tensor]]) -> None:
    """State that is not row-sharded must be a whole-matrix statistic, equal on every rank."""
    if not replicated:
        return
    group = replicated[0][0].model.device_mesh.get_group()
    local = torch.cat([value.detach().float().flatten() for _, _, value in replicated])
    extremes = torch.cat([local, local.neg()])  # every rank's maximum and minimum, in one all_reduce
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = extremes[:local.numel()], extremes[local.numel():].neg()
    if torch.equal(highest, local) and torch.equal(lowest, local):
        return
    sizes = [value.numel() for _, _, value in replicated]
    differs = (highest != local) | (lowest != local)
    index = next(i for i, part in enumerate(differs.split(sizes)) if part.any())
    param, name, value = replicated[index]
    raise ValueError(
        f"optimizer {child.name!r} keeps state {name!r} {tuple(value.shape)} for parameter {param.fqn!r}, neither "
        f"this rank's rows of it (its shard here is {tuple(param.model.to_local().shape)}) nor equal on every rank; "
        f"DTensor optimizer state cannot hold it. Use megatron_eopt.checkpointing.save_checkpoint for this optimizer."
    )


def _scalar(child: CheckpointableChild, param: ChildParam, name: str, value: Any, is_loading: bool) -> Any:
    """A scalar state value as saved (a load's target: a copy). A Python number (LaProp's int step) is
    saved as a 0-dim tensor: DCP loads a tensor in place, but puts a non-tensor it reads into the
    dict it was given, and Megatron-LM's fsdp_dtensor load hands the optimizer a copy made before
    (`_load_base_checkpoint`), so a plain step came back as the fresh optimizer's (`live_scalar_types`
    makes it a Python number again)."""
    if torch.is_tensor(value):
        return value.clone() if is_loading else value
    if isinstance(value, (bool, int, float)):  # float64: a Python float, exactly
        return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)
    if isinstance(value, str):
        return value
    raise ValueError(f"optimizer {child.name!r} keeps state {name!r} of type {type(value).__name__} for parameter "
                     f"{param.fqn!r}; DTensor optimizer state holds tensors and scalars only. Use "
                     f"megatron_eopt.checkpointing.save_checkpoint for this optimizer.")


def local_values(flat: dict) -> dict:
    """`flat` with each DTensor state value replaced by this rank's rows (what DCP loaded into
    `dtensor_state_dict`'s targets), as a tensor of its own without the DCP hooks of the target."""
    state = {fqn: {name: value.to_local().detach() if isinstance(value, DTensor) else value
                   for name, value in entries.items()}
             for fqn, entries in flat.get("state", {}).items()}
    mains = {fqn: main.to_local().detach() if isinstance(main, DTensor) else main
             for fqn, main in (flat.get("main_params") or {}).items()}
    return {**flat, "state": state, **({"main_params": mains} if mains else {})}


def live_scalar_types(state: Mapping[str, Mapping], live_state: Mapping[str, Mapping]) -> dict:
    """`state` (loaded, by parameter name) with each 0-dim tensor whose live value is a Python number
    (`_scalar` saved it as a tensor) that number again, of the live value's type: the optimizer's
    arithmetic on it stays what an uninterrupted run's is."""
    def as_live(value: Any, live: Any) -> Any:
        if torch.is_tensor(value) and value.dim() == 0 and type(live) in (bool, int, float):
            return type(live)(value.item())
        return value
    return {fqn: {name: as_live(value, live_state.get(fqn, {}).get(name)) for name, value in entries.items()}
            for fqn, entries in state.items()}


def flat_from_fsdp_dtensor(state_dict: Mapping, live_groups: Mapping[str, tuple[list[str], Mapping]],
                           live_class: str) -> dict:
    """What DCP loaded into `fsdp_dtensor_state_dict`'s targets -> the flat `state_dict()`
    (wrappers/flat_state.py) of a child, keyed by stored names: this rank's rows of each state.
    `live_groups`: {group key: (the stored names of its parameters, its live fields)}. The groups
    are the live ones, each with the hyperparameters saved with its parameters: the layout keys
    every field by parameter, and megatron-core groups them otherwise (with Megatron-FSDP it marks
    no parameter expert-parallel). The fields name no optimizer class on a load (its targets ask
    only for megatron-core's fields): the live one is assumed, the state's names and shapes checked."""
    saved_fields = state_dict[GROUP_META]
    groups = {}
    for key, (names, live) in live_groups.items():
        saved = [(name, saved_fields[name]) for name in names if name in saved_fields]
        fields = _same_hyperparameters(key, saved) if saved else {k: v for k, v in live.items() if k != "params"}
        groups[key] = {**fields, "group_key": key, "params": list(names)}
    every_name = {name for names, _ in live_groups.values() for name in names}
    state = {name: entries for name, entries in local_values(state_dict)["state"].items() if name in every_name}
    return {OPTIMIZER_CLASS: live_class, "param_groups": groups, "state": state, "grad_scaler": None}


# Fields that tell how a run grouped its parameters, not with what hyperparameters.
STRUCTURAL_FIELDS = ("is_expert_parallel", *OWN_GROUP_FIELDS, OPTIMIZER_CLASS)


def _same_hyperparameters(group_key: str, saved: list[tuple[str, Mapping]]) -> dict:
    """The fields saved with the parameters of one live group, which must agree (ValueError)."""
    first_name, first = saved[0]
    for name, fields in saved[1:]:
        differ = sorted(k for k in set(fields) | set(first) if k not in STRUCTURAL_FIELDS
                        and fields.get(k) != first.get(k))
        if differ:
            raise ValueError(
                f"param group {group_key!r}: parameters {first_name!r} and {name!r} were saved with different "
                f"{differ[0]!r} ({first.get(differ[0])!r} and {fields.get(differ[0])!r}); the overrides changed "
                f"since the save. Load the model only (Megatron-LM: --no-load-optim) to change them.")
    return dict(first)


def stored_names(child_name: str, params: list[ChildParam]) -> dict[str, str]:
    """{fqn: stored name} of the child's parameters; ValueError naming a routed expert whose layout
    has no global name (params/expert_names.py)."""
    unnamed = [param.fqn for param in params if not param.stored_name]
    if unnamed:
        raise ValueError(
            f"optimizer {child_name!r}: parameter {unnamed[0]!r} is a routed expert's on a mesh of its own in "
            f"{unnamed_expert_layout(unnamed[0])}, which DTensor optimizer state cannot name by its global "
            f"index; use SequentialMLP experts (Megatron-LM: leave out --moe-grouped-gemm), or "
            f"megatron_eopt.checkpointing.save_checkpoint (our trainer's --save).")
    return {param.fqn: param.stored_name for param in params}


def renamed(flat: dict, names: Mapping[str, str]) -> dict:
    """A flat state dict (wrappers/flat_state.py) with each parameter's name replaced by `names`'s
    (a name not in it stays): the state, the main weights and the groups' parameter lists."""
    if all(old == new for old, new in names.items()):
        return flat
    rename = lambda name: names.get(name, name)  # noqa: E731
    groups = {key: {**group, **{field: [rename(name) for name in group[field]]
                                for field in ("params", "param_fqns") if field in group}}
              for key, group in flat.get("param_groups", {}).items()}
    result = {**flat, "param_groups": groups, "state": {rename(name): v for name, v in flat.get("state", {}).items()}}
    if flat.get("main_params"):
        result["main_params"] = {rename(name): main for name, main in flat["main_params"].items()}
    return result


def row_sharded(local: torch.Tensor, param: DTensor, row_offset: int) -> DTensor:
    """`local` (this rank's rows of a tensor with `param`'s rows) as a DTensor laid out like `param`,
    with its chunk for DCP: DCP's own offsets assume torch.chunk's split, Megatron-FSDP's is not.
    `row_offset`: its first row among its data-parallel ranks' rows."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    dim = sharded_dim(param)  # 0, or 1 for experts placed Shard(1): rows of every expert
    shape = list(local.shape)
    shape[dim] = param.shape[dim]  # the parameter's, or its rows' statistics
    shape = torch.Size(shape)
    if param.device_mesh.ndim > 1:  # TP parts joined, along columns too
        _check_shaped_like_shard(local, param)
        shape = param.shape
    stride = torch.empty(shape, device="meta").stride()
    tensor = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=shape,
                                stride=stride)
    chunk = ChunkStorageMetadata(offsets=torch.Size(_chunk_offsets(local, param, row_offset)), sizes=local.shape)
    # torch's DTensor hands DCP's planners these hooks of its local tensor when it has them. They are
    # objects of this module, not closures, so that torch.save pickles the state dict.
    tensor._local_tensor.__create_chunk_list__ = _ChunkList(chunk)
    tensor._local_tensor.__create_write_items__ = _WriteItems(chunk, local, shape)
    return tensor


class _ChunkList:
    """A row shard's chunk for DCP's load planner."""

    def __init__(self, chunk: Any) -> None:
        self.chunk = chunk

    def __call__(self) -> list:
        return [self.chunk]


class _WriteItems:
    """A row shard's write item for DCP's save planner; an empty shard writes nothing."""

    def __init__(self, chunk: Any, local: torch.Tensor, shape: torch.Size) -> None:
        from torch.distributed.checkpoint.metadata import TensorProperties

        self.chunk, self.shape, self.empty = chunk, shape, local.numel() == 0
        self.properties = TensorProperties.create_from_tensor(local)

    def __call__(self, fqn: str, _: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if self.empty:
            return []
        data = TensorWriteData(chunk=self.chunk, properties=self.properties, size=self.shape)
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, self.chunk.offsets), tensor_data=data)]


def _check_shaped_like_shard(local: torch.Tensor, param: DTensor) -> None:
    """On the 2-D (dp, tp) mesh the state takes the parameter's placements, which fit its shape only."""
    if local.shape != param.to_local().shape:
        raise ValueError(
            f"state {tuple(local.shape)} of a parameter {tuple(param.shape)} on the 2-D (dp, tp) mesh of TP x "
            f"Megatron-FSDP is not shaped like its shard {tuple(param.to_local().shape)}; DTensor optimizer state "
            f"holds per-row statistics at TP=1 only (--tensor-model-parallel-size 1 --expert-tensor-parallel-size 1)."
        )


def _chunk_offsets(local: torch.Tensor, param: DTensor, row_offset: int) -> list[int]:
    """Where `local` starts in the global tensor. On Megatron-FSDP's 2-D (dp, tp) mesh the global
    tensor is the TP ranks' equal parts joined along the dimension TP splits (`Shard(d)` on the tp
    dimension), and the data-parallel ranks split each part's rows: the TP rank's part comes
    first, as Megatron-FSDP's own chunk metadata has it (uneven_dtensor.py), so that megatron-core's
    checkpoint and ours name the same chunks."""
    offsets = [0] * local.dim()
    offsets[sharded_dim(param)] = row_offset  # the data-parallel ranks' rows (of every expert with Shard(1))
    mesh = param.device_mesh
    for mesh_dim in range(1, mesh.ndim):
        placement = param.placements[mesh_dim]
        if isinstance(placement, Shard):
            part = param.shape[placement.dim] // mesh.size(mesh_dim)
            offsets[placement.dim] += mesh.get_local_rank(mesh_dim) * part
    return offsets
