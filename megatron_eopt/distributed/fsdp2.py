"""Models sharded with torch FSDP2 (`fully_shard`) or Megatron-FSDP (`fully_shard_model`, ZeRO-3):
DTensor parameters on a 1-D mesh, Shard(0), shards of any sizes.

This module
- checks that layout, naming any parameter or placement it cannot handle;
- takes the data-parallel group from the parameters' mesh (with EP, the experts' from theirs), and
  each matrix's row split from the ranks' shards (an all_gather per mesh; megatron_fsdp_model.py);
- restores the routing facts `fully_shard` drops (`is_embedding_or_output_parameter`,
  `tensor_model_parallel`, `partition_dim`, `allreduce`) from module types and names;
- with TP (FSDP2 only) or EP, takes the TP or expert groups from `pg_collection` or parallel_state;
- gives each whole-matrix optimizer's matrix an owner rank by Newton-Schulz cost
  (ops/row_shards.py runs the exchange);
- wraps the inner optimizers to step each DTensor's local shard (`FullyShardedFP32Optimizer`),
  with the gradient norm and the inf/NaN check summed over the mesh, then the (expert) model-parallel group.
docs/fsdp2.md and docs/megatron-fsdp.md describe the behaviour.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from megatron_eopt.checkpointing.fsdp_dtensor import (
    FSDP_DTENSOR,
    SHARDING_TYPE_KEY,
    asks_for_fsdp_dtensor,
    dtensor_state_dict,
)
from megatron_eopt.runtime.process_groups import (
    ParallelGroups,
    ProcessGroup,
    TensorParallelSplit,
    group_ranks,
    group_size,
    initialized_parallel_state_groups,
    megatron_tensor_parallel_split,
    resolve_parallel_groups,
)
from megatron_eopt.ops.ownership import assign_owners
from megatron_eopt.runtime.once import warn_once
from megatron_eopt.distributed.megatron_fsdp_model import (
    MEGATRON_FSDP,
    TORCH_FSDP2,
    missing_grad,
    sharding_engine,
    tensor_parallel_refusal,
)
from megatron_eopt.ops.row_shards import RowShards, gathered_rows
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.params.groups import ParamRecord, named_trainable_parameters
from megatron_eopt.params.names import is_expert_name
from megatron_eopt.wrappers.fp32 import FP32Optimizer
from megatron_eopt.wrappers.mixed_precision import HALF_DTYPES, MixedPrecisionOptimizer

# megatron-core's language models name their LM head `output_layer` (GPTModel, MambaModel); its
# weight is what megatron-core tags is_embedding_or_output_parameter besides the embedding.
OUTPUT_LAYER_NAMES = ("output_layer.weight", "*.output_layer.weight")
# Transformer Engine layers (megatron-core's TE specs): their tensor-parallel split is not read here.
TRANSFORMER_ENGINE_MODULES = ("transformer_engine", "megatron.core.extensions")
# The first torch whose FSDP2 averages gradients on CPU: 2.8 reduce-scatters them with ReduceOp.AVG,
# which gloo silently sums (torch issue #162338), so gradients come out world-size times too large.
FSDP2_AVERAGES_ON_CPU_SINCE = (2, 9)


@dataclass(frozen=True)
class ExpertSharding:
    """Expert parameters sharded over an expert-data-parallel mesh of their own (EP > 1): each
    EP rank holds its local experts and shards them over `group`; `fqns` names them."""

    group: ProcessGroup  # the experts' mesh's group: expert data parallel
    fqns: frozenset[str]
    # The caller's expert model-parallel group (tp x ep x pp), over which the experts' gradient
    # norm is summed after their mesh, as megatron-core sums it.
    model_parallel: Optional[ProcessGroup]


@dataclass(frozen=True)
class FullyShardedLayout:
    """A sharded model's data-parallel group and the row split of every trainable parameter."""

    group: ProcessGroup  # the dense parameters' mesh's group
    rows_by_rank: dict[str, tuple[int, ...]]  # fqn -> rows each rank of its mesh holds (dim 0), as gathered
    # fqn -> megatron-core partition_dim of the parameters its tensor-parallel layers split
    partition_dims: dict[str, int] = field(default_factory=dict)
    # The caller's groups when tensor parallelism has size > 1 (TP x FSDP2), else None.
    tensor_parallel: Optional[ParallelGroups] = None
    engine: str = TORCH_FSDP2  # or MEGATRON_FSDP
    experts: Optional[ExpertSharding] = None  # None: no expert parameter, or all on the dense mesh (EP=1)

    @property
    def expert_parallel_fqns(self) -> frozenset[str]:
        """The parameters stepped as megatron-core's expert-parallel ones (`allreduce=False`, which
        `fully_shard` drops)."""
        return frozenset() if self.experts is None else self.experts.fqns

    def group_of(self, is_expert: bool) -> ProcessGroup:
        """The data-parallel group the dense (or the expert) parameters' rows are split over."""
        return self.experts.group if is_expert and self.experts is not None else self.group

    def optimizer_class(self, mixed_precision: bool) -> type:
        """The wrapper that steps each child's local shards: with `mixed_precision` (OptimizerConfig.bf16)
        16-bit DTensor parameters through fp32 main shards, fp32 ones (the main weights) in place."""
        if self.engine == MEGATRON_FSDP:
            return MegatronFSDPMixedPrecisionOptimizer if mixed_precision else MegatronFSDPFP32Optimizer
        return FullyShardedMixedPrecisionOptimizer if mixed_precision else FullyShardedFP32Optimizer

    @property
    def tp_group(self) -> Optional[ProcessGroup]:
        return None if self.tensor_parallel is None else self.tensor_parallel.tp

    def parallel_groups(self) -> ParallelGroups:
        """Data parallel = the mesh's group; tensor (and model) parallel the caller's, if any."""
        given = self.tensor_parallel
        experts = {} if self.experts is None else dict(
            expt_tp=None, expt_mp=self.experts.model_parallel, expt_dp=self.experts.group)
        if given is None:
            return ParallelGroups.from_groups(tp=None, mp=None, dp_cp=self.group, tp_dp_cp=self.group, **experts)
        # Checkpoints need the group of all TP x DP ranks; only the caller can name it.
        known = {role: getattr(given, role) for role in ("tp_dp_cp", "job") if role in given.provided}
        return ParallelGroups.from_groups(tp=given.tp, mp=given.mp, dp_cp=self.group, **known)

    def with_tensor_parallel_facts(self, records: list[ParamRecord]) -> list[ParamRecord]:
        """`records` with the tensor-parallel attributes `fully_shard` dropped, from the layer types."""
        return [dataclasses.replace(r, tensor_model_parallel=r.fqn in self.partition_dims,
                                    partition_dim=self.partition_dims.get(r.fqn, -1)) for r in records]

    def row_shards(self, records: list[ParamRecord], layouts: dict[str, MatrixLayout],
                   is_expert: bool = False) -> dict[str, RowShards]:
        """fqn -> RowShards of the matrices in `records` (all dense, or all expert), owners among
        the ranks of their mesh (`group_of`), balanced by Newton-Schulz cost.

        `layouts` are of the matrices FSDP2 splits (a DTensor's shape is its global shape over the
        mesh): whole matrices, or this TP rank's shards of them. Every TP rank computes the same
        owners (same shapes, same order), so a matrix's owners form one TP group.
        """
        owners = assign_owners(records, {r.fqn for r in records}, group_size(self.group_of(is_expert)),
                               group_size(self.tp_group))
        return {r.fqn: RowShards(layouts[r.fqn], self.rows_by_rank[r.fqn], owners[r.fqn]) for r in records}


def fully_sharded_layout(chunks: list[torch.nn.Module], pg_collection: Any = None) -> Optional[FullyShardedLayout]:
    """The layout of a model sharded with torch FSDP2's `fully_shard` or Megatron-FSDP; None when no
    parameter is a DTensor. Gathers every rank's shard sizes over the parameters' mesh (a collective).

    The tensor-parallel group, if any, is `pg_collection`'s, else megatron-core parallel_state's
    when it is initialized; so is the expert model-parallel group when routed experts
    (`*.experts.*`) sit on a mesh of their own. Raises (naming the parameter) for a mix of DTensor
    and plain trainable parameters, a placement other than Shard(0) on a 1-D mesh, dense (or
    expert) parameters on different meshes, an expert mesh that does not fit the caller's
    expert-parallel groups, tensor-parallel layers that do not fit the TP group, and tensor
    parallelism with Megatron-FSDP or with experts.
    """
    engine = sharding_engine(chunks)  # first: Megatron-FSDP's other strategies keep plain parameters
    named = named_trainable_parameters(chunks)
    sharded = [(fqn, p) for fqn, _, p in named if isinstance(p, DTensor)]
    if not sharded:
        return None
    plain = [fqn for fqn, _, p in named if not isinstance(p, DTensor)]
    if plain:
        raise TypeError(
            f"parameter {plain[0]!r} is a plain tensor, but parameter {sharded[0][0]!r} is a DTensor "
            f"({engine}): a model's trainable parameters must be all DTensors or all plain tensors. "
            f"fully_shard the module holding {plain[0]!r} too (e.g. fully_shard the root module), or "
            f"freeze it (requires_grad=False)."
        )
    for fqn, param in sharded:
        check_row_placement(fqn, param, engine)
    dense, expert = split_by_mesh(sharded)
    group = _common_group(dense)
    if engine == TORCH_FSDP2:
        check_fsdp2_averages(sharded[0][1].device)
    splits, engine_layers = _tensor_parallel_splits(chunks)
    if engine == MEGATRON_FSDP:
        _refuse_tensor_parallel(pg_collection, splits, sharded[0][0])
        tensor_parallel = None
    else:
        tensor_parallel = _tensor_parallel_groups(pg_collection, group, splits, engine_layers)
    experts = _expert_sharding(pg_collection, expert, group, tensor_parallel) if expert else None
    return FullyShardedLayout(group, rows_by_rank_per_mesh(dense + expert),
                              {fqn: split.partition_dim for fqn, split in splits.items()}, tensor_parallel, engine,
                              experts)


def split_by_mesh(sharded: list[tuple[str, DTensor]]) -> tuple[list[tuple[str, DTensor]], list[tuple[str, DTensor]]]:
    """(dense, expert): routed experts' parameters go to `expert` when they sit on a mesh other
    than the first dense parameter's (expert parallelism shards them over their own
    expert-data-parallel group); on the same mesh (EP=1) they are dense, as megatron-core has them."""
    dense = [(fqn, p) for fqn, p in sharded if not is_expert_name(fqn)]
    expert = [(fqn, p) for fqn, p in sharded if is_expert_name(fqn)]
    if not dense:
        raise ValueError(
            f"every trainable parameter is a routed expert's (e.g. {expert[0][0]!r}); a model sharded with "
            f"experts needs its dense parameters (router, attention, norms) in the same model chunks."
        )
    mesh = dense[0][1].device_mesh
    if all(p.device_mesh == mesh for _, p in expert):
        return dense + expert, []
    return dense, expert


def rows_by_rank_per_mesh(sharded: list[tuple[str, DTensor]]) -> dict[str, tuple[int, ...]]:
    """fqn -> rows each rank of its parameter's mesh holds: one all_gather per mesh, over its group,
    the meshes in the order of their first parameter (the same on every rank of a mesh)."""
    by_mesh: dict[Any, list[tuple[str, DTensor]]] = {}
    for fqn, param in sharded:
        by_mesh.setdefault(param.device_mesh, []).append((fqn, param))
    rows_of = {}
    for mesh, members in by_mesh.items():
        rows = gathered_rows([p.to_local().shape[0] for _, p in members], mesh.get_group(), members[0][1].device)
        rows_of.update({fqn: r for (fqn, _), r in zip(members, rows)})
    return rows_of


def _expert_sharding(pg_collection: Any, expert: list[tuple[str, DTensor]], dp_group: ProcessGroup,
                     tensor_parallel: Optional[ParallelGroups]) -> ExpertSharding:
    """The experts' mesh group, checked against the caller's expert groups (no collective)."""
    first = expert[0][0]
    if tensor_parallel is not None:
        raise ValueError(
            f"parameter {first!r}: expert parallelism with TP x torch FSDP2 is not supported; use "
            f"tensor_model_parallel_size=1 with experts on torch FSDP2."
        )
    expert_group = _common_group(expert)
    given = resolve_parallel_groups(pg_collection) if pg_collection is not None else initialized_parallel_state_groups()
    if given is None:
        raise ValueError(
            f"parameter {first!r} is a routed expert's on a mesh of its own (expert parallelism), but no expert "
            f"process groups were given: pass pg_collection with its 'tp_ep_pp' (expert model-parallel) group, "
            f"or keep megatron-core's parallel_state initialized while building the optimizer."
        )
    why = "expert parameters on their own mesh (the experts' gradient norm over expert parallel ranks)"
    expert_tp, expert_mp = given.require("expt_tp", why), given.require("expt_mp", why)
    if group_size(expert_tp) > 1:
        raise ValueError(f"parameter {first!r}: expert tensor parallelism (size {group_size(expert_tp)}) with "
                         f"torch FSDP2 is not supported; use expert_tensor_parallel_size=1.")
    _check_expert_grid(first, expert_group, expert_mp, dp_group)
    return ExpertSharding(expert_group, frozenset(fqn for fqn, _ in expert), expert_mp)


def _check_expert_grid(fqn: str, expert_group: ProcessGroup, expert_mp: Optional[ProcessGroup],
                       dp_group: ProcessGroup) -> None:
    """Expert data parallel x expert parallel is the dense data-parallel group: the experts' mesh
    and the expert model-parallel group share this rank only, and their sizes multiply to it."""
    expert_ranks, ep_ranks = group_ranks(expert_group), group_ranks(expert_mp)
    common = sorted(set(expert_ranks) & set(ep_ranks))
    if common != [dist.get_rank()] or len(expert_ranks) * len(ep_ranks) != group_size(dp_group) \
            or not set(expert_ranks) <= set(group_ranks(dp_group)):
        raise ValueError(
            f"parameter {fqn!r}: the experts' mesh has ranks {expert_ranks}, the expert model-parallel group "
            f"{ep_ranks} and the dense mesh {group_ranks(dp_group)}; the experts' mesh must be this rank's expert "
            f"data-parallel group (e.g. DeviceMesh.from_group(parallel_state.get_expert_data_parallel_group(), ...)), "
            f"which shares this rank ({dist.get_rank()}) only with the expert model-parallel group, and the two "
            f"must multiply to the dense mesh."
        )


def _tensor_parallel_splits(chunks: list[torch.nn.Module]) -> tuple[dict[str, TensorParallelSplit], list[str]]:
    """(fqn -> split of every parameter a megatron-core TP layer splits, fqns held by Transformer
    Engine layers), from the module holding each parameter; frozen ones too (checkpoints store them)."""
    fqn_of = {id(p): fqn for fqn, _, p in named_trainable_parameters(chunks, trainable_only=False)}
    splits, engine_layers = {}, []
    for chunk in chunks:
        for module in chunk.modules():
            for name, param in module.named_parameters(recurse=False):
                fqn = fqn_of.pop(id(param), None)  # pop: a tied parameter counts once
                if fqn is None:
                    continue
                split = megatron_tensor_parallel_split(module, name)
                if split is not None:
                    splits[fqn] = split
                if type(module).__module__.startswith(TRANSFORMER_ENGINE_MODULES):
                    engine_layers.append(fqn)
    return splits, engine_layers


def tensor_parallel_partition_dims(chunks: list[torch.nn.Module]) -> dict[str, int]:
    """fqn -> megatron-core partition_dim of each parameter a megatron-core TP layer splits."""
    return {fqn: split.partition_dim for fqn, split in _tensor_parallel_splits(chunks)[0].items()}


def _refuse_tensor_parallel(pg_collection: Any, splits: dict[str, TensorParallelSplit], first_fqn: str) -> None:
    """TP x Megatron-FSDP is refused: a TP group of size > 1 given, or layers built for TP > 1."""
    given = resolve_parallel_groups(pg_collection) if pg_collection is not None else initialized_parallel_state_groups()
    built = [fqn for fqn, split in splits.items() if split.tp_size > 1]
    if built or group_size(None if given is None else given.tp) > 1:
        raise ValueError(tensor_parallel_refusal(built[0] if built else first_fqn))


def _tensor_parallel_groups(pg_collection: Any, dp_group: ProcessGroup, splits: dict[str, TensorParallelSplit],
                            engine_layers: list[str]) -> Optional[ParallelGroups]:
    """The caller's groups when their TP group has size > 1, checked against the layers; else None."""
    given = resolve_parallel_groups(pg_collection) if pg_collection is not None else initialized_parallel_state_groups()
    tp_group = None if given is None else given.tp
    if tp_group is None:
        built = {fqn: s.tp_size for fqn, s in splits.items() if s.tp_size > 1}
        if built:
            fqn, size = next(iter(built.items()))
            raise ValueError(
                f"parameter {fqn!r} belongs to a megatron-core tensor-parallel layer built for {size} TP "
                f"ranks, but no tensor-parallel group was given: pass pg_collection with its 'tp' and 'mp' "
                f"groups, or keep megatron-core's parallel_state initialized while building the optimizer."
            )
        return None
    if engine_layers:
        raise ValueError(
            f"parameter {engine_layers[0]!r} belongs to a Transformer Engine layer; tensor parallelism "
            f"with torch FSDP2 reads the split of megatron-core's own layers only (the local spec: "
            f"ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)."
        )
    _check_layers_fit(splits, tp_group)
    _check_crosses_mesh(tp_group, dp_group)
    return given


def _check_layers_fit(splits: dict[str, TensorParallelSplit], tp_group: ProcessGroup) -> None:
    """Each TP layer was built over `tp_group`: its size, its ranks."""
    ranks = group_ranks(tp_group)
    for fqn, split in splits.items():
        layer_ranks = group_ranks(split.group) if split.group is not None else None
        if split.tp_size != len(ranks) or (layer_ranks is not None and layer_ranks != ranks):
            raise ValueError(
                f"parameter {fqn!r}: its megatron-core layer is split over {split.tp_size} TP ranks "
                f"{layer_ranks}, but the tensor-parallel group given has ranks {ranks}; pass the group the "
                f"model was built with (pg_collection.tp, or parallel_state's)."
            )


def _check_crosses_mesh(tp_group: ProcessGroup, dp_group: ProcessGroup) -> None:
    """TP x FSDP2 is a grid: the TP group and the mesh's data-parallel group share this rank only."""
    common = sorted(set(group_ranks(tp_group)) & set(group_ranks(dp_group)))
    if common != [dist.get_rank()]:
        raise ValueError(
            f"the tensor-parallel group {group_ranks(tp_group)} and the FSDP2 mesh's data-parallel group "
            f"{group_ranks(dp_group)} share ranks {common}; they must share this rank ({dist.get_rank()}) "
            f"only. fully_shard each TP rank's model over its own data-parallel group (e.g. "
            f"DeviceMesh.from_group(parallel_state.get_data_parallel_group(), ...))."
        )


def check_row_placement(fqn: str, param: DTensor, engine: str = TORCH_FSDP2) -> None:
    """FSDP2's default layout, the only one handled: Shard(0) on a 1-D mesh."""
    placements = tuple(param.placements)
    if engine == MEGATRON_FSDP and param.device_mesh.ndim != 1:
        raise ValueError(tensor_parallel_refusal(fqn))
    if param.device_mesh.ndim != 1 or placements != (Shard(0),) or param.dim() < 1:
        raise ValueError(
            f"parameter {fqn!r}: DTensor placement {placements} on a {param.device_mesh.ndim}-D mesh "
            f"(shape {tuple(param.shape)}) is not supported; megatron_eopt handles torch FSDP2's default, "
            f"Shard(0) on a 1-D mesh (fully_shard without a custom shard_placement_fn)."
        )


def _common_group(sharded: list[tuple[str, DTensor]]) -> ProcessGroup:
    """The one mesh's group of `sharded` (the dense parameters, or the experts)."""
    first_fqn, first = sharded[0]
    for fqn, param in sharded[1:]:
        if param.device_mesh != first.device_mesh:
            raise ValueError(
                f"parameters {first_fqn!r} and {fqn!r} are on different DeviceMeshes ({first.device_mesh} "
                f"and {param.device_mesh}); fully_shard every module over one mesh (the routed experts, "
                f"'*.experts.*', may have a mesh of their own: the expert data-parallel group's)."
            )
    return first.device_mesh.get_group()


def check_fsdp2_averages(device: torch.device, torch_version: str = torch.__version__) -> None:
    """Refuse a torch whose FSDP2 sums the gradients of CPU (gloo) parameters instead of averaging them."""
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    if device.type == "cpu" and release < FSDP2_AVERAGES_ON_CPU_SINCE:
        raise RuntimeError(
            f"torch {torch_version}'s FSDP2 sums gradients over gloo instead of averaging them (torch issue "
            f"#162338), so CPU training with it would be silently wrong: use torch>=2.9 (pyproject.toml's floor)."
        )


def check_fully_sharded_config(config: Any, engine: str = TORCH_FSDP2) -> None:
    """Refuse settings the sharded path does not implement, before anything is built."""
    refused = [
        ("use_layer_wise_distributed_optimizer", config.use_layer_wise_distributed_optimizer,
         f"{engine} already shards the state; set use_distributed_optimizer=False"),
        ("fp16", config.fp16, f"fp16 loss scaling is not implemented for {engine}; train in bf16 (--bf16)"),
    ]
    for field, value, how in refused:
        if value:
            raise ValueError(f"{field}=True is not supported for a {engine} (DTensor) model: {how}.")
    if config.decoupled_lr is not None and engine == TORCH_FSDP2:
        raise ValueError(
            "decoupled_lr is set, but torch FSDP2 drops megatron-core's is_embedding_or_output_parameter "
            "attribute that the standard override matches on; pass config_overrides with a name key "
            "(e.g. ParamKey(name=('embedding.word_embeddings.weight', 'output_layer.weight'))) and leave "
            "decoupled_lr unset."
        )


class FullyShardedFP32Optimizer(FP32Optimizer):
    """FP32Optimizer over the local shards of fp32 DTensor parameters.

    Its main parameters are plain tensors aliasing each DTensor's local shard (no copy), so the
    inner optimizer steps and keeps state per shard; their gradients are the local shards of the
    DTensor gradients. The aliases are refreshed every step, since FSDP2 may re-create a shard's
    storage (its lazy init re-pads shards after `load_state_dict(assign=True)`).
    """

    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if not isinstance(param, DTensor) or param.dtype != torch.float32:
            raise TypeError(
                f"{type(self).__name__} steps float32 DTensor parameters (torch FSDP2, Megatron-FSDP); got "
                f"{type(param).__name__} of {param.dtype}. For bf16 DTensor parameters set OptimizerConfig.bf16=True "
                f"(Megatron-LM: --bf16): they are then stepped through fp32 main shards."
            )
        with torch.no_grad():
            return torch.nn.Parameter(param.to_local(), requires_grad=False)

    def state_dict(self, is_loading: bool = False) -> dict:
        """torch's convention for sharded state (its own optimizers' under FSDP2): state holding this
        rank's rows of its parameter is a DTensor laid out like the parameter, uneven and empty
        shards included, a whole-matrix statistic a replicated one, so torch DCP saves each row once
        and loads at another FSDP size; scalars (the step) stay plain. Complete before the first
        step; `is_loading`: new tensors to load into. Collectives over the parameters' mesh
        (checkpointing/fsdp_dtensor.dtensor_state_dict)."""
        self._refuse_tensor_parallel("state_dict()")
        self._refuse_expert_parallel("state_dict()")
        return dtensor_state_dict(self, is_loading)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's fsdp_dtensor layout, which Megatron-LM saves and loads with torch DCP
        (checkpointing/fsdp_dtensor.py); its ShardedTensor formats (torch_dist) are refused."""
        if not asks_for_fsdp_dtensor(metadata):
            raise ValueError(
                f"sharded_state_dict() of a DTensor-sharded model (torch FSDP2, Megatron-FSDP) gives megatron-core's "
                f"fsdp_dtensor layout only: pass metadata={{'{SHARDING_TYPE_KEY}': '{FSDP_DTENSOR}'}} and save it with "
                f"torch.distributed.checkpoint (Megatron-LM's --ckpt-format fsdp_dtensor), or use save_checkpoint."
            )
        self._refuse_tensor_parallel("the fsdp_dtensor layout")
        self._refuse_expert_parallel("the fsdp_dtensor layout")
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)

    def _refuse_tensor_parallel(self, what: str) -> None:
        """DTensor state is keyed by parameter name, which the TP ranks of TP x torch FSDP2 share."""
        if group_size(self.tp_group) > 1:
            raise ValueError(
                f"{what} of TP x torch FSDP2 is not supported: its DTensor state is keyed by parameter name, "
                f"which the TP ranks share; use megatron_eopt.checkpointing.save_checkpoint."
            )

    def _refuse_expert_parallel(self, what: str) -> None:
        """DTensor state is keyed by parameter name, and the EP ranks name their local experts alike."""
        expert = next((r.fqn for r in self.records if r.is_expert_parallel), None)
        if expert is not None:
            raise ValueError(
                f"{what} of expert parameters on their own mesh (expert parallelism on torch FSDP2 or Megatron-FSDP) "
                f"is not supported: its DTensor state is keyed by parameter name, and the EP ranks name their local "
                f"experts alike (e.g. {expert!r}); use megatron_eopt.checkpointing.save_checkpoint, which stores "
                f"global expert names."
            )

    def _prepare_main_grads(self) -> None:
        with torch.no_grad():
            for param, main, record in zip(self.model_params, self.main_params, self.records):
                main.data = param.to_local()
                main.grad = self._shard_grad(param, record.fqn)

    def _shard_grad(self, param: DTensor, fqn: str) -> Optional[torch.Tensor]:
        """This rank's rows of `param`'s gradient in fp32 (None: the parameter is not stepped).
        Megatron-FSDP puts it in `decoupled_grad` for a precision-aware optimizer (Megatron-LM's
        --use-precision-aware-optimizer), in its gradient buffer's dtype (bf16 by default there)."""
        grad = param.grad if param.grad is not None else getattr(param, "decoupled_grad", None)
        local = self._missing_grad(fqn, param.to_local()) if grad is None else _local_grad(fqn, grad)
        return None if local is None else local.float()

    # Megatron-FSDP gives an empty shard no gradient (megatron_fsdp_model.missing_grad); FSDP2 gives
    # every rank a gradient or none, and a parameter without one is not stepped.
    empty_shards_lack_grads = False

    def _missing_grad(self, fqn: str, shard: torch.Tensor) -> Optional[torch.Tensor]:
        return missing_grad(fqn, shard) if self.empty_shards_lack_grads else None


class FullyShardedMixedPrecisionOptimizer(FullyShardedFP32Optimizer, MixedPrecisionOptimizer):
    """The local shards of bf16 (or fp16) DTensor parameters stepped through fp32 main shards, as
    megatron-core's Float16OptimizerWithFloat16Params steps the bf16 DTensors that Megatron-LM's
    `--use-torch-fsdp2 --bf16` hands it (fp32 copies of each rank's rows, rounded back after the
    step); fp32 DTensor parameters (Megatron-FSDP's main weights) are stepped in place. The fp32
    main weights are held as the precision-aware settings say (wrappers/main_param_storage.py), over
    each parameter's local shard.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._local_weights: dict[int, torch.nn.Parameter] = {}  # id(DTensor parameter) -> its local shard
        super().__init__(*args, **kwargs)
        if not self._half_pairs() and not self.storage.holds_fp32:
            warn_once("sharded fp32 main weights", f"{type(self).__name__}: store_param_remainders / "
                      f"main_params_dtype have no effect here: every DTensor parameter is fp32 (Megatron-FSDP's "
                      f"main weights, or FSDP2 shards computed in bf16 through its MixedPrecisionPolicy), so "
                      f"the parameters are the fp32 main weights.", stacklevel=3)

    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if isinstance(param, DTensor) and param.dtype in HALF_DTYPES:
            with torch.no_grad():
                return torch.nn.Parameter(param.to_local().float(), requires_grad=False)
        return super()._make_main_param(param)

    def _weights(self, model: torch.nn.Parameter) -> torch.Tensor:
        # One tensor per parameter, as the storages key their remainders by it, pointed at the local
        # shard anew each time: FSDP2 may re-create a shard's storage (see the class above).
        weights = self._local_weights.get(id(model))
        if weights is None:
            weights = self._local_weights[id(model)] = torch.nn.Parameter(model.to_local(), requires_grad=False)
        else:
            weights.data = model.to_local()
        return weights

    def _prepare_main_grads(self) -> None:
        with torch.no_grad():
            for param, main, record in zip(self.model_params, self.main_params, self.records):
                if param.dtype not in HALF_DTYPES:
                    main.data = param.to_local()
                main.grad = self._shard_grad(param, record.fqn)
                if param.dtype in HALF_DTYPES:
                    param.grad = None  # the fp32 copy replaces it; free the 16-bit one


class MegatronFSDPFP32Optimizer(FullyShardedFP32Optimizer):
    """FullyShardedFP32Optimizer for Megatron-FSDP, which gives an empty shard no gradient."""

    empty_shards_lack_grads = True


class MegatronFSDPMixedPrecisionOptimizer(FullyShardedMixedPrecisionOptimizer):
    """FullyShardedMixedPrecisionOptimizer for Megatron-FSDP, which gives an empty shard no gradient."""

    empty_shards_lack_grads = True


def _local_grad(fqn: str, grad: torch.Tensor) -> torch.Tensor:
    if not isinstance(grad, DTensor) or tuple(grad.placements) != (Shard(0),):
        placement = tuple(grad.placements) if isinstance(grad, DTensor) else "a plain tensor"
        raise ValueError(
            f"parameter {fqn!r}: its gradient is {placement}; a torch FSDP2 parameter's gradient must "
            f"be a DTensor with placement Shard(0), like the parameter (FSDP2's and Megatron-FSDP's reduce-scatter give one)."
        )
    return grad.to_local()

