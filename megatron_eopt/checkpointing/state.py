"""The entries of a checkpoint: model parameters and optimizer state by parameter name.

`<fqn>` is the parameter's name in the PP=1, EP=1 model (global_names.py); layout.py adds the
`#part<i>` and `@tp<r>of<n>` suffixes.
    model/<fqn>                  the model parameter, global shape, model dtype
    main/<fqn>                   its fp32 main copy (mixed precision only)
    state/<child>/<fqn>/<name>   optimizer state `name` of the parameter
    groups/<child>               hyperparameters of every param group, by group key (JSON)
    grad_scaler/<child>          the loss scaler's state (JSON)
`<child>` names a chained optimizer (e.g. `muon/dense`); expert children are stored under the
dense names. Only the rank that holds a state writes it; replicas are written once. An FSDP2
model's ranks write their rows as pieces of the global tensor.
"""

import io
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from megatron_eopt.checkpointing.global_names import (
    global_buffer_names,
    global_parameter_names,
    stored_child_name,
    stored_group_key,
)
from megatron_eopt.checkpointable.optimizer_change import Owner
from megatron_eopt.checkpointing.layout import (
    PART_MARK,
    TP_MARK,
    MeshCache,
    Placement,
    TensorParallelRows,
    global_pieces,
    local_tensor,
    placement_of,
    row_placement,
)
from megatron_eopt.checkpointing.storage import CheckpointError, all_gather_objects
from megatron_eopt.placement.fully_sharded_layout import rows_by_rank_per_mesh, tensor_parallel_partition_dims
from megatron_eopt.runtime.process_groups import ParallelGroups, ProcessGroup, group_rank, group_ranks, group_size
from megatron_eopt.params.groups import chunk_model_config, named_trainable_parameters
from megatron_eopt.checkpointable.child import CheckpointableChild
from megatron_eopt.wrappers.fp32 import FP32Optimizer


@dataclass(frozen=True)
class ModelParam:
    """One model parameter (or persistent buffer, which is replicated and never stepped) as the
    checkpoint sees it."""

    fqn: str  # its name here (named_trainable_parameters), which the optimizer's records use
    param: torch.Tensor
    placement: Placement
    stored_name: str  # its name in the checkpoint: the PP=1/EP=1 name


def model_params(model_chunks: list[torch.nn.Module], groups: ParallelGroups) -> list[ModelParam]:
    """Every parameter of the model (frozen ones too) with its tensor-parallel or FSDP2 placement,
    then every persistent buffer (whole on every rank)."""
    named = named_trainable_parameters(model_chunks, trainable_only=False)
    _refuse_two_dimensional_meshes(named)
    has_experts = any(not getattr(p, "allreduce", True) for _, _, p in named)
    stored_names = global_parameter_names(model_chunks)
    why = "a checkpoint (which stores tensor-parallel shards in their global shape)"
    dense_tp = groups.require("tp", why)
    expert_tp = groups.require("expt_tp", why) if has_experts else None
    tp_rows_of = _tensor_parallel_rows(model_chunks, named, groups, dense_tp)
    rows_of = _rows_by_rank(named)
    result = []
    for fqn, name, param in named:
        if isinstance(param, DTensor):  # torch FSDP2 or Megatron-FSDP: its rows of the global tensor
            placement = row_placement(fqn, param, _gated_parts(model_chunks, fqn, name), rows_of[fqn],
                                      tp_rows_of.get(fqn))
        else:
            tp_group = expert_tp if not getattr(param, "allreduce", True) else dense_tp
            placement = placement_of(param, tp_group)
        result.append(ModelParam(fqn, param, placement, stored_names[fqn]))
    for fqn, (buffer, stored_name) in global_buffer_names(model_chunks).items():
        result.append(ModelParam(fqn, buffer, Placement(), stored_name))
    return result


def _refuse_two_dimensional_meshes(named: list) -> None:
    """Megatron-FSDP with (expert) TP puts the parameters TP splits on a 2-D (dp, tp) mesh, shaped as
    all TP parts joined; the placements here are of 1-D meshes (each TP rank's part its own DTensor)."""
    for fqn, _, param in named:
        if isinstance(param, DTensor) and param.device_mesh.ndim > 1:
            raise ValueError(
                f"parameter {fqn!r}: checkpoints of parameters on a 2-D mesh (TP x Megatron-FSDP, torchtitan's TP) "
                f"are not supported by save_checkpoint; checkpoint Megatron-FSDP at TP=1 and expert TP=1, use TP x "
                f"torch FSDP2 or TP with megatron-core's DDP, or save the optimizer's state_dict() with torch DCP "
                f"(torchtitan's checkpointer)."
            )


def _rows_by_rank(named: list) -> dict[str, tuple[int, ...]]:
    """fqn -> rows each rank of its mesh holds, for every DTensor parameter: one all_gather over each
    mesh's group (the engines' splits differ: Megatron-FSDP's follows its buckets; experts may
    have a mesh of their own)."""
    return rows_by_rank_per_mesh([(fqn, p) for fqn, _, p in named if isinstance(p, DTensor)])


def _tensor_parallel_rows(model_chunks: list[torch.nn.Module], named: list, groups: ParallelGroups,
                          tp_group: Optional[ProcessGroup]) -> dict[str, TensorParallelRows]:
    """fqn -> where its TP shard sits, for the FSDP2 parameters a TP layer splits (TP x FSDP2).

    Collective over the TP group when it has more than one rank and the model is FSDP2's: each
    TP rank's data-parallel ranks are gathered once, so every rank knows every piece's owner.
    """
    meshes = [p.device_mesh for _, _, p in named if isinstance(p, DTensor)]
    if not meshes or group_size(tp_group) == 1:
        return {}
    dp_ranks = tuple(group_ranks(meshes[0].get_group()))
    ranks = tuple(tuple(r) for r in all_gather_objects(dp_ranks, tp_group))
    group = checkpoint_group(groups)
    return {fqn: TensorParallelRows(dim, group_rank(tp_group), ranks, group)
            for fqn, dim in tensor_parallel_partition_dims(model_chunks).items()}


def _gated_parts(model_chunks: list[torch.nn.Module], fqn: str, name: str) -> int:
    """megatron-core's partition_stride of a parameter whose attributes torch FSDP2 dropped: 2 for a
    gated linear unit's linear_fc1 ([gate; up], stored as two tensors), else 1. As param_groups reads
    the SwiGLU split: from the name and the owning chunk's TransformerConfig."""
    if not name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return 1
    chunk = model_chunks[0] if len(model_chunks) == 1 else model_chunks[int(fqn.split(".", 1)[0][len("model_chunk"):])]
    return 2 if getattr(chunk_model_config(chunk), "gated_linear_unit", False) else 1


def pipeline_size(groups: ParallelGroups) -> int:
    why = "a checkpoint (which records its pipeline-parallel size)"
    return group_size(groups.require("mp", why)) // group_size(groups.require("tp", why))


def checkpoint_group(groups: ParallelGroups) -> Optional[ProcessGroup]:
    """The ranks that write and read a checkpoint together: all of this job's.

    torch.distributed.checkpoint coordinates over one group; it is the caller's (never torch's
    WORLD, which may hold other jobs). Without pipeline parallelism that is tensor x data x
    context parallel (`tp_dp_cp`; expert parallelism re-divides the same ranks); with it, every
    stage too: the `job` group.
    """
    why = "a checkpoint (written and read by all the ranks of this job together)"
    stage = groups.require("tp_dp_cp", why)
    expected = group_size(groups.require("tp", why)) * group_size(groups.require("dp_cp", why))
    if group_size(stage) != expected:
        raise ValueError(
            f"the 'tp_dp_cp' process group has {group_size(stage)} ranks, but tensor parallel x "
            f"data parallel ('tp' x 'dp_cp') is {expected}; it must hold every rank of one "
            f"pipeline stage (tensor x data x context parallel) and no other."
        )
    stages = pipeline_size(groups)
    if stages == 1:
        return stage
    job = groups.require("job", f"a checkpoint with pipeline parallelism (size {stages}), written by every "
                                f"stage together,")
    if group_size(job) != expected * stages:
        raise ValueError(
            f"the 'job' process group has {group_size(job)} ranks, but the {stages} pipeline stages "
            f"of {expected} ranks each are {expected * stages}; it must hold every rank of this job and no other."
        )
    return job


def stored_model_names(params: list[ModelParam], group: Optional[ProcessGroup]) -> set[str]:
    """The stored names of the whole model: every stage's and expert rank's (collective over `group`)."""
    return set().union(*all_gather_objects(sorted({p.stored_name for p in params}), group))


def stored_names_by_fqn(params: list[ModelParam]) -> dict[str, str]:
    return {p.fqn: p.stored_name for p in params}


def optimizer_children(optimizer: Any) -> list[CheckpointableChild]:
    """The wrapped optimizers whose state a checkpoint holds."""
    if optimizer is None:
        return []
    if isinstance(optimizer, FP32Optimizer):
        return [optimizer]
    children = getattr(optimizer, "chained_optimizers", None)
    if children is None or not all(isinstance(c, FP32Optimizer) for c in children):
        raise TypeError(
            f"checkpoints hold optimizers returned by get_megatron_optimizer (ChainedOptimizer, "
            f"LayerWiseDistributedOptimizer, FP32Optimizer, MixedPrecisionOptimizer); got "
            f"{type(optimizer).__name__}."
        )
    return list(children)


def global_group_structure(children: list[CheckpointableChild], group: Optional[ProcessGroup],
                           stored: dict[str, str]) -> dict[str, dict[str, Any]]:
    """{child: {'torch_class', 'groups': {group_key: [stored name, ...]}}} over the ranks of `group` (collective).

    Each layer-wise rank's children list only the parameters it owns, each stage its own: the
    union is the model's. `stored`: {fqn: stored name} (stored_names_by_fqn).
    """
    merged: dict[str, dict[str, Any]] = {}
    for structure in all_gather_objects(_local_group_structure(children, stored), group):
        for name, child in structure:
            entry = merged.setdefault(stored_child_name(name), {"torch_class": child["torch_class"], "groups": {}})
            for key, fqns in child["groups"].items():
                key = stored_group_key(key)
                entry["groups"][key] = sorted(set(entry["groups"].get(key, [])) | set(fqns))
    return merged


def _local_group_structure(children: list[CheckpointableChild], stored: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    structure = []
    for child in children:
        fqn_of = child.fqn_of_main
        structure.append((child.name, {
            "torch_class": child.inner_class_name(),
            "groups": {g["group_key"]: [stored[fqn_of[id(p)]] for p in g["params"]] for g in child.param_groups},
        }))
    return structure


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------


def save_entries(params: list[ModelParam], children: list[CheckpointableChild], meshes: MeshCache,
                 snapshot: bool = False) -> dict[str, Any]:
    """Everything of the model and optimizer this rank writes: views of the live tensors, or with
    `snapshot` copies on the CPU (an asynchronous save writes them while training goes on)."""
    detached = _cpu_copy if snapshot else torch.Tensor.detach
    entries: dict[str, Any] = {}
    placement_of_param = {id(p.param): p.placement for p in params}
    stored = stored_names_by_fqn(params)
    for p in params:
        entries.update(global_pieces(f"model/{p.stored_name}", detached(local_tensor(p.param)), p.placement, meshes))
    for child in children:
        fp32_mains = child.fp32_main_params()  # remainders: rebuilt, so checkpoints stay interchangeable
        for param, fp32_main in zip(child.checkpoint_params(), fp32_mains):
            model_param = param.model
            placement = placement_of_param[id(model_param)]
            if has_main_copy(model_param, param.main):
                entries.update(global_pieces(f"main/{stored[param.fqn]}", detached(fp32_main), placement, meshes))
            for name, value in param.state.items():
                key = f"state/{stored_child_name(child.name)}/{stored[param.fqn]}/{name}"
                value = detached(value) if torch.is_tensor(value) else value
                entries.update(_state_entry(key, value, local_tensor(model_param), placement, meshes))
    entries.update(_hyperparameter_entries(children))
    return entries


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def has_main_copy(model_param: torch.Tensor, main_param: torch.Tensor) -> bool:
    """A separate fp32 main copy of a 16-bit parameter (mixed precision); the main parameters of fp32
    DTensor parameters (torch FSDP2, Megatron-FSDP) alias their local shards."""
    return main_param is not model_param and model_param.dtype != torch.float32


def _hyperparameter_entries(children: list[CheckpointableChild]) -> dict[str, str]:
    """groups/<child> and grad_scaler/<child>, an expert child's merged into its dense child's."""
    groups: dict[str, dict] = {}
    scalers: dict[str, Any] = {}
    # Dense children last: where a dense and an expert group share a stored key, the dense wins.
    for child in sorted(children, key=lambda c: stored_child_name(c.name) == c.name):
        name = stored_child_name(child.name)
        groups.setdefault(name, {}).update(_hyperparameters(child))
        scalers[name] = child.grad_scaler.state_dict() if child.grad_scaler is not None else None
    entries = {f"groups/{name}": json.dumps(value) for name, value in groups.items()}
    entries.update({f"grad_scaler/{name}": json.dumps(value) for name, value in scalers.items()})
    return entries


def _state_entry(key: str, value: Any, param: torch.Tensor, placement: Placement, meshes: MeshCache) -> dict[str, Any]:
    if torch.is_tensor(value):
        value = value.detach()
        if value.dim() == 0:  # a step count: the same on every shard
            return {key: value}
        if value.shape == param.shape:
            return global_pieces(key, value, placement, meshes)
    else:
        value = pack_object(value)
    if placement.is_row_sharded and torch.is_tensor(value):
        raise CheckpointError(
            f"optimizer state {key} of shape {tuple(value.shape)} is neither a scalar nor shaped like its "
            f"parameter's FSDP2 shard {tuple(param.shape)}; checkpoints of such state (e.g. adaptive_muon's "
            f"normuon second moment) are not supported for torch FSDP2 models yet. Use muon or an elementwise "
            f"optimizer, or the layer-wise distributed optimizer."
        )
    if placement.partition_dim >= 0:  # e.g. a preconditioner of a TP shard: valid at this TP only
        return {placement.tp_specific_key(key): value}
    return {key: value}


def pack_object(value: Any) -> bytes:
    """A non-tensor state value as one opaque entry (DCP would split lists of tensors into keys)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack_object(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _hyperparameters(child: CheckpointableChild) -> dict[str, dict[str, Any]]:
    """Each group's optimizer hyperparameters (lr, betas, ...) that JSON can hold."""
    return {
        stored_group_key(group["group_key"]): {k: group[k] for k in child.hyperparameter_names() if k in group and _is_plain(group[k])}
        for group in child.param_groups
    }


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


# ------------------------------------------------------------------------------------------------
# Loading: targets to read into, then the loaded values
# ------------------------------------------------------------------------------------------------


class CheckpointIndex:
    """The keys a checkpoint holds, from torch.distributed.checkpoint's metadata."""

    def __init__(self, metadata: Metadata, path: str) -> None:
        self.path = path
        self.tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        self.objects = {k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
        self.state_keys: dict[tuple[str, str], dict[str, list[str]]] = {}
        for key in list(self.tensors) + sorted(self.objects):
            parts = key.split("/")
            if parts[0] == "state":  # state/<child, may hold '/'>/<fqn>/<name>
                child, fqn, entry = "/".join(parts[1:-2]), parts[-2], parts[-1].split(PART_MARK)[0].split(TP_MARK)[0]
                self.state_keys.setdefault((child, fqn), {}).setdefault(entry, []).append(key)

    def has_tensor(self, key: str, placement: Placement) -> bool:
        return all(k in self.tensors for k in placement.keys(key))

    def model_fqns(self) -> set[str]:
        return {k.split("/", 1)[1].split(PART_MARK)[0] for k in self.tensors if k.startswith("model/")}


class LoadPlan:
    """Buffers for torch.distributed.checkpoint to read into, and how to collect them."""

    def __init__(self, index: CheckpointIndex, meshes: MeshCache) -> None:
        self.index, self.meshes = index, meshes
        self.targets: dict[str, Any] = {}
        self._resolvers: list[Callable[[], None]] = []

    def tensor(self, key: str, local_shape: torch.Size, placement: Placement, device: torch.device) -> torch.Tensor:
        """A buffer of `local_shape` that receives this rank's piece of stored tensor `key`."""
        stored = self.index.tensors[placement.keys(key)[0]]
        expected = placement.global_part_shape(local_shape)
        if tuple(stored.size) != expected:
            raise CheckpointError(
                f"{key} has global shape {tuple(stored.size)} in {self.index.path} but "
                f"{expected} here: the model changed (or its vocabulary padding did) since the save."
            )
        buffer = torch.empty(local_shape, dtype=stored.properties.dtype, device=device)
        self.targets.update(global_pieces(key, buffer, placement, self.meshes))
        return buffer

    def plain(self, key: str, device: torch.device) -> Callable[[], Any]:
        """A getter of the value stored under `key` as it is (an object or a whole tensor)."""
        if key in self.index.objects:
            self.targets[key] = None
            return lambda: self.targets[key]
        stored = self.index.tensors[key]
        buffer = torch.empty(stored.size, dtype=stored.properties.dtype, device=device)
        self.targets[key] = buffer
        return lambda: buffer


def plan_model(plan: LoadPlan, params: list[ModelParam], model_names: set[str]) -> dict[int, torch.Tensor]:
    """id(param) -> buffer with its value: the fp32 main copy when the checkpoint has one.

    `model_names`: the stored names of the whole model (stored_model_names), every stage's.
    """
    stored = plan.index.model_fqns()
    if model_names != stored:
        missing, extra = sorted(model_names - stored), sorted(stored - model_names)
        raise CheckpointError(
            f"the model differs from the one in {plan.index.path}: parameters missing in the "
            f"checkpoint {_few(missing)}, only in the checkpoint {_few(extra)}."
        )
    values = {}
    for p in params:
        main = f"main/{p.stored_name}"
        source = main if plan.index.has_tensor(main, p.placement) else f"model/{p.stored_name}"
        local = local_tensor(p.param)
        values[id(p.param)] = plan.tensor(source, local.shape, p.placement, local.device)
    return values


def plan_optimizer_state(plan: LoadPlan, child: CheckpointableChild, params: list[ModelParam],
                         saved_child: Optional[Mapping[str, str]] = None) -> Callable[[], dict]:
    """Targets for `child`'s state; returns a getter of {fqn: {name: value}} once loaded.
    `saved_child`: the child each stored name's state is read from (absent: none, it starts fresh:
    checkpointable/optimizer_change.py); None: this child's own name."""
    placement_of_param = {id(p.param): p.placement for p in params}
    stored = stored_names_by_fqn(params)
    getters: dict[str, dict[str, Callable[[], Any]]] = {}
    for param in child.checkpoint_params():
        child_name = stored_child_name(child.name) if saved_child is None else saved_child.get(stored[param.fqn])
        if child_name is None:
            continue
        placement = placement_of_param[id(param.model)]
        for name, keys in plan.index.state_keys.get((child_name, stored[param.fqn]), {}).items():
            key = f"state/{child_name}/{stored[param.fqn]}/{name}"
            getters.setdefault(param.fqn, {})[name] = _plan_state_value(plan, key, keys, local_tensor(param.model),
                                                                        placement)
    return lambda: {fqn: {name: get() for name, get in entry.items()} for fqn, entry in getters.items()}


def _plan_state_value(plan: LoadPlan, key: str, keys: list[str], param: torch.Tensor, placement: Placement) -> Callable[[], Any]:
    if any(TP_MARK in k for k in keys):
        wanted = placement.tp_specific_key(key)
        if wanted not in keys:
            raise CheckpointError(
                f"optimizer state {key} is not parameter-shaped and was saved at another "
                f"tensor-parallel layout ({', '.join(k.rsplit(TP_MARK, 1)[1] for k in keys)}); it cannot be "
                f"resharded to TP rank {wanted.rsplit(TP_MARK, 1)[1]}. Resume at the saved TP size, or "
                f"load the model only (load_optimizer=False, --no-load-optim)."
            )
        return _plain_state(plan, wanted, param.device)
    if plan.index.has_tensor(key, placement) and _parameter_shaped(plan, key, param, placement):
        buffer = plan.tensor(key, param.shape, placement, param.device)
        return lambda: buffer
    if placement.is_row_sharded and key in plan.index.tensors and plan.index.tensors[key].size:
        raise CheckpointError(
            f"optimizer state {key} has shape {tuple(plan.index.tensors[key].size)} in {plan.index.path}, neither "
            f"a scalar nor its parameter's shape; it cannot be split into this torch FSDP2 rank's rows. Load the "
            f"model only (load_optimizer=False, --no-load-optim)."
        )
    return _plain_state(plan, key, param.device)


def _plain_state(plan: LoadPlan, key: str, device: torch.device) -> Callable[[], Any]:
    get = plan.plain(key, device)
    return (lambda: unpack_object(get())) if key in plan.index.objects else get


def _parameter_shaped(plan: LoadPlan, key: str, param: torch.Tensor, placement: Placement) -> bool:
    stored = plan.index.tensors[placement.keys(key)[0]]
    return tuple(stored.size) == placement.global_part_shape(param.shape)


def loaded_optimizer_state(child: CheckpointableChild, state: dict, groups_json: str, scaler_json: str,
                           masters: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The child's state dict (wrappers/flat_state.py format) from what was loaded."""
    saved_groups = json.loads(groups_json)
    fqn_of = child.fqn_of_main
    param_groups = {}
    for group in child.param_groups:
        saved = saved_groups.get(stored_group_key(group["group_key"]), {})
        hyperparameters = {k: _like(v, group.get(k)) for k, v in saved.items()}
        param_groups[group["group_key"]] = {**hyperparameters, "params": [fqn_of[id(p)] for p in group["params"]]}
    main_params = {param.fqn: masters[id(param.model)]
                   for param in child.checkpoint_params() if has_main_copy(param.model, param.main)}
    return {
        "optimizer_class": child.inner_class_name(),
        "param_groups": param_groups,
        "state": state,
        "grad_scaler": json.loads(scaler_json),
        "main_params": main_params,
    }


def _like(saved: Any, live: Any) -> Any:
    """JSON turned tuples (betas) into lists; give them the live type back."""
    return tuple(saved) if isinstance(live, tuple) and isinstance(saved, list) else saved


def _few(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def optimizer_of_each_parameter(structure: Optional[dict]) -> dict[str, Owner]:
    """{stored name: its child and torch class} of a global_group_structure (a manifest's 'optimizers')."""
    return {name: Owner(child, entry["torch_class"]) for child, entry in (structure or {}).items()
            for names in entry["groups"].values() for name in names}


def check_structure(saved: Optional[dict], live: dict, path: str) -> None:
    """Refuse a checkpoint of another optimizer or another param-group structure, saying how."""
    remedy = "To go on with another optimizer or param-group layout, load the model only (load_optimizer=False, --no-load-optim)."
    if saved is None:
        raise CheckpointError(f"{path} holds no optimizer state. {remedy}")
    describe = lambda s: {name: child["torch_class"] for name, child in s.items()}  # noqa: E731
    if describe(saved) != describe(live):
        raise CheckpointError(
            f"{path} was written by optimizer(s) {describe(saved)}, this run uses {describe(live)}. {remedy}"
        )
    for name, child in live.items():
        saved_groups, live_groups = saved[name]["groups"], child["groups"]
        if set(saved_groups) != set(live_groups):
            raise CheckpointError(
                f"{path}: the param groups of {name!r} differ: only in the checkpoint "
                f"{sorted(set(saved_groups) - set(live_groups))}, only here "
                f"{sorted(set(live_groups) - set(saved_groups))}. The overrides or the routing "
                f"changed since the save. {remedy}"
            )
        for key, fqns in live_groups.items():
            if sorted(fqns) != sorted(saved_groups[key]):
                raise CheckpointError(
                    f"{path}: param group {key!r} of {name!r} holds other parameters than in the "
                    f"checkpoint (only there: {_few(sorted(set(saved_groups[key]) - set(fqns)))}, only here: "
                    f"{_few(sorted(set(fqns) - set(saved_groups[key])))}). {remedy}"
                )
