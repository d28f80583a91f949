"""Where a DTensor-sharded model's parameters lie (torch FSDP2's `fully_shard`, Megatron-FSDP): the
data-parallel group of their mesh (with EP, the routed experts' own mesh and its expert groups), each
parameter's row split on every rank of its mesh, and the tensor-parallel partition dims that
`fully_shard` drops, read from megatron-core's layer types.

The optimizer (distributed/fsdp2.py) and the checkpoints (checkpointing/) both read it. It checks
the layout as it reads it: Shard(0) on 1-D meshes (Shard(1) for 3-D experts of a known container:
the rows of every expert), or Megatron-FSDP's 2-D (dp, tp) mesh for what
(expert) TP splits, whose matrices are each TP rank's part (ops/splits.tensor_parallel_rank_shape);
the experts' mesh against the expert groups; tensor-parallel layers that fit the TP group.
Other Shard/_StridedShard/Replicate placements on any mesh (torchtitan's TP x FSDP2) are `placed`:
ops/placed_matrices.py steps them (docs/fsdp2.md, docs/megatron-fsdp.md).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_eopt.ops.ownership import assign_owners
from megatron_eopt.ops.placed_matrices import PlacedMatrix
from megatron_eopt.ops.row_shards import RowShards, gathered_rows, sharded_dim
from megatron_eopt.ops.splits import MatrixBatch, MatrixLayout
from megatron_eopt.params.fused_layouts import expert_batch_blocks
from megatron_eopt.params.expert_names import expert_global_names
from megatron_eopt.params.groups import ParamRecord, batch_sites, named_trainable_parameters
from megatron_eopt.params.names import is_expert_name
from megatron_eopt.placement.megatron_fsdp_model import (
    MEGATRON_FSDP,
    TORCH_FSDP2,
    sharding_engine,
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
    # fqn -> its name in DTensor optimizer state, by global expert index; None: its layout has none
    # (params/expert_names.py).
    global_names: dict[str, Optional[str]] = field(default_factory=dict)
    # The caller's expert tensor-parallel group when it has size > 1 (Megatron-FSDP's 2-D expert
    # mesh), else None.
    tensor_parallel: Optional[ProcessGroup] = None


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
    # Experts tensors [E, out, in] sharded Shard(1): every rank holds rows of every expert, and
    # their `rows_by_rank` are the rows of each expert.
    per_matrix_rows: frozenset[str] = frozenset()
    # Parameters of placements the row-shard exchange does not take (torchtitan's TP x FSDP2):
    # stepped on the placed path (ops/placed_matrices.py); their `rows_by_rank` are not read.
    placed: frozenset[str] = frozenset()
    # The dense mesh's dimensions whose ranks hold disjoint parts beside the first (torchtitan's tp
    # dimension): the gradient norm sums over them too. Empty where the caller's model-parallel
    # group covers them (megatron-core TP), or the mesh is 1-D.
    other_mesh_groups: tuple = ()

    @property
    def expert_parallel_fqns(self) -> frozenset[str]:
        """The parameters stepped as megatron-core's expert-parallel ones (`allreduce=False`, which
        `fully_shard` drops)."""
        return frozenset() if self.experts is None else self.experts.fqns

    def group_of(self, is_expert: bool) -> ProcessGroup:
        """The data-parallel group the dense (or the expert) parameters' rows are split over."""
        return self.experts.group if is_expert and self.experts is not None else self.group

    @property
    def tp_group(self) -> Optional[ProcessGroup]:
        return None if self.tensor_parallel is None else self.tensor_parallel.tp

    def tp_group_of(self, is_expert: bool) -> Optional[ProcessGroup]:
        """The tensor-parallel group of the dense (or the expert) parameters, None at size 1."""
        return self.experts.tensor_parallel if is_expert and self.experts is not None else self.tp_group

    def parallel_groups(self) -> ParallelGroups:
        """Data parallel = the mesh's group; tensor (and model) parallel the caller's, if any."""
        given = self.tensor_parallel
        experts = {} if self.experts is None else dict(
            expt_tp=self.experts.tensor_parallel, expt_mp=self.experts.model_parallel, expt_dp=self.experts.group)
        if given is None:
            return ParallelGroups.from_groups(tp=None, mp=None, dp_cp=self.group, tp_dp_cp=self.group, **experts)
        # Checkpoints need the group of all TP x DP ranks; only the caller can name it.
        known = {role: getattr(given, role) for role in ("tp_dp_cp", "job") if role in given.provided}
        return ParallelGroups.from_groups(tp=given.tp, mp=given.mp, dp_cp=self.group, **known)

    def norm_groups(self, is_expert: bool, model_parallel: Optional[ProcessGroup]) -> tuple[Optional[ProcessGroup], ...]:
        """The groups a child's squared gradient norm is summed over, one after the other: its mesh's
        (disjoint row shards), then `model_parallel` (a TP-replicated parameter counts on TP rank 0
        only). On Megatron-FSDP megatron-core's DistributedOptimizer sums it in one reduction over all
        its ranks, in another order than two; so does ours where the caller gave the group of all TP
        x DP ranks (`tp_dp_cp`) and it is exactly the ranks of those two (no pipeline parallelism)."""
        mesh = self.group_of(is_expert)
        whole = self.parallel_groups().tp_dp_cp if self.engine == MEGATRON_FSDP else None
        if whole is None or group_size(whole) != group_size(mesh) * group_size(model_parallel) \
                or not set(group_ranks(mesh)) | set(group_ranks(model_parallel)) <= set(group_ranks(whole)):
            # the placed path's other mesh dimensions (torchtitan's TP) sum as part of the mesh
            return mesh, *(() if is_expert else self.other_mesh_groups), model_parallel
        return (whole,)

    def with_layout_facts(self, records: list[ParamRecord]) -> list[ParamRecord]:
        """`records` with the tensor-parallel attributes `fully_shard` dropped, from the layer types,
        and the global names of the experts on their own mesh ("" where their layout has none)."""
        names = {} if self.experts is None else self.experts.global_names
        return [dataclasses.replace(r, tensor_model_parallel=r.fqn in self.partition_dims,
                                    partition_dim=self.partition_dims.get(r.fqn, -1),
                                    stored_name=(names[r.fqn] or "") if r.fqn in names else r.stored_name)
                for r in records]

    def row_shards(self, records: list[ParamRecord], layouts: dict[str, MatrixLayout],
                   is_expert: bool = False) -> dict[str, Union[RowShards, PlacedMatrix]]:
        """fqn -> RowShards of the matrices in `records` (all dense, or all expert), owners among
        the ranks of their mesh (`group_of`), balanced by Newton-Schulz cost; a PlacedMatrix for
        each parameter on the placed path.

        `layouts` are of the matrices FSDP2 splits (a DTensor's shape is its global shape over the
        mesh): whole matrices, or this TP rank's shards of them. Every TP rank computes the same
        owners (same shapes, same order), so a matrix's owners form one TP group.
        """
        placed = {r.fqn: PlacedMatrix.of(r.param, layouts[r.fqn]) for r in records if r.fqn in self.placed}
        rows = [r for r in records if r.fqn not in self.placed]
        owners = assign_owners(rows, {r.fqn for r in rows}, group_size(self.group_of(is_expert)),
                               group_size(self.tp_group_of(is_expert)))
        return {**{r.fqn: RowShards(layouts[r.fqn], self.rows_by_rank[r.fqn], owners[r.fqn], per_matrix_rows=True)
                   if r.fqn in self.per_matrix_rows else
                   RowShards(layouts[r.fqn], _view_rows(layouts[r.fqn], self.rows_by_rank[r.fqn]), owners[r.fqn])
                   for r in rows}, **placed}


def _view_rows(layout: MatrixLayout, rows_by_rank: tuple[int, ...]) -> tuple[int, ...]:
    """Rows each rank holds of the matrix Muon sees: of a batch of matrices (experts, split by
    their leading dimension), its 2-D view's rows; of one matrix stored transposed, its stored rows
    (its owner transposes it whole)."""
    if layout.batch is None or layout.batch.single:
        return rows_by_rank
    per_index = layout.local_shape[0] // layout.batch.shape[0]
    return tuple(rows * per_index for rows in rows_by_rank)


def fully_sharded_layout(chunks: list[torch.nn.Module], pg_collection: Any = None) -> Optional[FullyShardedLayout]:
    """The layout of a model sharded with torch FSDP2's `fully_shard` or Megatron-FSDP; None when no
    parameter is a DTensor. Gathers every rank's shard sizes over the parameters' data-parallel
    group (a collective).

    The tensor-parallel group, if any, is `pg_collection`'s, else megatron-core parallel_state's
    when it is initialized; so is the expert model-parallel group when routed experts
    (`*.experts.*`) sit on a mesh of their own. Raises (naming the parameter) for a mix of DTensor
    and plain trainable parameters, a placement other than Shard(0) on a 1-D mesh (Shard(1) for
    [E, out, in] experts of a known container; or, with
    Megatron-FSDP, its (dp, tp) mesh), dense (or expert) parameters over different data-parallel
    groups, an expert mesh that does not fit the caller's expert-parallel groups, tensor-parallel
    layers that do not fit the TP group, and tensor parallelism with experts.
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
    batches = _shard_one_batches(chunks, sharded, engine)
    placed = frozenset(fqn for fqn, param in sharded if not check_row_placement(fqn, param, engine, batches.get(fqn)))
    dense, expert = split_by_mesh(sharded)
    group = _common_group(dense)
    if placed:
        _check_one_mesh(dense)
    if engine == TORCH_FSDP2:
        check_fsdp2_averages(sharded[0][1].device)
    splits, engine_layers = _tensor_parallel_splits(chunks)
    expert_fqns = {fqn for fqn, _ in expert}
    dense_splits = {fqn: split for fqn, split in splits.items() if fqn not in expert_fqns}
    tensor_parallel = _tensor_parallel_groups(pg_collection, group, dense_splits, engine_layers, engine)
    _check_tensor_parallel_mesh([(fqn, p) for fqn, p in dense if fqn not in placed], dense_splits,
                                None if tensor_parallel is None else tensor_parallel.tp)
    experts = _expert_sharding(chunks, pg_collection, expert, group, tensor_parallel, engine,
                               {fqn: split for fqn, split in splits.items() if fqn in expert_fqns}) if expert else None
    mesh = dense[0][1].device_mesh
    other_mesh_groups = tuple(mesh.get_group(d) for d in range(1, mesh.ndim)) if tensor_parallel is None else ()
    return FullyShardedLayout(group, rows_by_rank_per_mesh(dense + expert),
                              {fqn: split.partition_dim for fqn, split in splits.items()}, tensor_parallel, engine,
                              experts, frozenset(batches), placed, other_mesh_groups)


def _shard_one_batches(chunks: list[torch.nn.Module], sharded: list[tuple[str, DTensor]],
                       engine: str) -> dict[str, MatrixBatch]:
    """fqn -> the batch of matrices of each experts tensor of a known experts container that torch
    FSDP2 places Shard(1) on a 1-D mesh (torchtitan's `shard_placement_fn` when the FSDP degree
    exceeds the experts); the only placement besides Shard(0) that `check_row_placement` may accept."""
    candidates = {id(p): (fqn, p) for fqn, p in sharded
                  if p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(1),) and p.dim() >= 3}
    if not candidates or engine != TORCH_FSDP2:
        return {}
    batches = {}
    for param_id, (owner, attribute) in batch_sites(chunks).items():
        fqn, param = candidates.get(param_id, ("", None))
        blocks = None if param is None else expert_batch_blocks(owner, attribute, fqn, param)
        if blocks is not None:
            batches[fqn] = blocks.batch
    return batches


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
    ranks = group_ranks(row_group(dense[0][1]))
    if all(group_ranks(row_group(p)) == ranks for _, p in expert):
        return dense + expert, []
    return dense, expert


def row_group(param: DTensor) -> ProcessGroup:
    """The data-parallel group that splits `param`'s rows: its mesh's first dimension (a 1-D
    mesh's one; Megatron-FSDP's (dp, tp) mesh's dp)."""
    return param.device_mesh.get_group(0)


def rows_by_rank_per_mesh(sharded: list[tuple[str, DTensor]]) -> dict[str, tuple[int, ...]]:
    """fqn -> rows each rank of its parameter's data-parallel group holds (`row_group`): one
    all_gather per group, the groups in the order of their first parameter (the same on every
    rank of a group)."""
    by_group: dict[tuple[int, ...], list[tuple[str, DTensor]]] = {}
    for fqn, param in sharded:
        by_group.setdefault(tuple(group_ranks(row_group(param))), []).append((fqn, param))
    rows_of = {}
    for members in by_group.values():
        rows = gathered_rows([p.to_local().shape[sharded_dim(p)] for _, p in members], row_group(members[0][1]),
                             members[0][1].device)
        rows_of.update({fqn: r for (fqn, _), r in zip(members, rows)})
    return rows_of


def _expert_sharding(chunks: list[torch.nn.Module], pg_collection: Any, expert: list[tuple[str, DTensor]],
                     dp_group: ProcessGroup, tensor_parallel: Optional[ParallelGroups], engine: str,
                     splits: dict[str, TensorParallelSplit]) -> ExpertSharding:
    """The experts' mesh group, checked against the caller's expert groups (no collective), and
    their global names. Expert tensor parallelism (Megatron-FSDP's 2-D expert mesh) is over the
    caller's expert TP group. Experts with dense TP are refused: untested, as megatron-core's MoE
    needs sequence parallelism at TP > 1, which its CPU layers lack (docs/megatron-fsdp.md)."""
    first = expert[0][0]
    if tensor_parallel is not None:
        instead = ("use tensor_model_parallel_size=1 with experts (--expert-tensor-parallel-size splits the "
                   "experts alone)" if engine == MEGATRON_FSDP else f"use tensor_model_parallel_size=1 with experts")
        raise ValueError(
            f"parameter {first!r}: expert parallelism with TP x {engine} is not supported; {instead} on {engine}."
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
    if group_size(expert_tp) > 1 and engine != MEGATRON_FSDP:
        raise ValueError(f"parameter {first!r}: expert tensor parallelism (size {group_size(expert_tp)}) with "
                         f"{engine} is not supported; use expert_tensor_parallel_size=1, or Megatron-FSDP.")
    _check_layers_fit(splits, expert_tp)
    _check_tensor_parallel_mesh(expert, splits, expert_tp)
    _check_expert_grid(first, expert_group, expert_mp, dp_group)
    fqns = [fqn for fqn, _ in expert]
    return ExpertSharding(expert_group, frozenset(fqns), expert_mp, expert_global_names(chunks, fqns), expert_tp)


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


def _tensor_parallel_groups(pg_collection: Any, dp_group: ProcessGroup, splits: dict[str, TensorParallelSplit],
                            engine_layers: list[str], engine: str) -> Optional[ParallelGroups]:
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
            f"with {engine} reads the split of megatron-core's own layers only (the local spec: "
            f"ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)."
        )
    _check_layers_fit(splits, tp_group)
    _check_crosses_mesh(tp_group, dp_group, engine)
    return given


def _check_layers_fit(splits: dict[str, TensorParallelSplit], tp_group: ProcessGroup) -> None:
    """Each TP layer was built over `tp_group`: its size, its ranks."""
    ranks = group_ranks(tp_group)
    for fqn, split in splits.items():
        # The size first: a layer built at another TP size may hold a group destroyed since.
        layer_ranks = group_ranks(split.group) if split.group is not None and split.tp_size == len(ranks) else None
        if split.tp_size != len(ranks) or (layer_ranks is not None and layer_ranks != ranks):
            raise ValueError(
                f"parameter {fqn!r}: its megatron-core layer is split over {split.tp_size} TP ranks "
                f"{layer_ranks}, but the tensor-parallel group given has ranks {ranks}; pass the group the "
                f"model was built with (pg_collection.tp, or parallel_state's)."
            )


def _check_crosses_mesh(tp_group: ProcessGroup, dp_group: ProcessGroup, engine: str) -> None:
    """TP x FSDP is a grid: the TP group and the mesh's data-parallel group share this rank only."""
    common = sorted(set(group_ranks(tp_group)) & set(group_ranks(dp_group)))
    if common != [dist.get_rank()]:
        how = ("fully_shard each TP rank's model over its own data-parallel group (e.g. "
               "DeviceMesh.from_group(parallel_state.get_data_parallel_group(), ...))" if engine == TORCH_FSDP2 else
               "give Megatron-FSDP a (dp, tp) mesh of parallel_state's data-parallel and tensor-parallel groups")
        raise ValueError(
            f"the tensor-parallel group {group_ranks(tp_group)} and the {engine} mesh's data-parallel group "
            f"{group_ranks(dp_group)} share ranks {common}; they must share this rank ({dist.get_rank()}) "
            f"only. {how}."
        )


def _check_tensor_parallel_mesh(sharded: list[tuple[str, DTensor]], splits: dict[str, TensorParallelSplit],
                                tp_group: Optional[ProcessGroup]) -> None:
    """Megatron-FSDP's 2-D (dp, tp) mesh holds the parameters TP splits, its tp dimension over the
    caller's (expert) TP group; its other parameters sit on the 1-D dp mesh (no collective)."""
    tp_ranks = group_ranks(tp_group)
    for fqn, param in sharded:
        if param.device_mesh.ndim != 2:
            continue
        mesh_tp_ranks = group_ranks(param.device_mesh.get_group(1))
        if fqn not in splits or mesh_tp_ranks != tp_ranks:
            why = ("its layer is not a megatron-core tensor-parallel layer" if fqn not in splits
                   else f"the tensor-parallel group given has ranks {tp_ranks}")
            raise ValueError(
                f"parameter {fqn!r} is on a 2-D mesh whose second (tensor-parallel) dimension has ranks "
                f"{mesh_tp_ranks}, but {why}; wrap the model with Megatron-FSDP over the (dp, tp) mesh of "
                f"the groups it was built with."
            )


def check_row_placement(fqn: str, param: DTensor, engine: str = TORCH_FSDP2,
                        batch: Optional[MatrixBatch] = None) -> bool:
    """Whether the row-shard exchange takes `param` (True), or the placed path (False, torch FSDP2
    only: ops/placed_matrices.py gathers each matrix over its mesh); ValueError for neither.

    The row-shard exchange takes FSDP2's default layout, Shard(0) on a 1-D mesh, and Megatron-FSDP's
    with tensor parallelism: (Shard(0), Shard(d) or Replicate()) on its 2-D (dp, tp) mesh, the rows
    of each TP rank's part split over dp (ops/splits.tensor_parallel_rank_shape). With `batch` (an
    experts tensor of a known container, `_shard_one_batches`), also Shard(1) on a 1-D mesh: the
    rows of every expert split, for [E, out, in] storage with contiguous gate/up blocks. The placed
    path takes Shard, _StridedShard and Replicate on any mesh (torchtitan's TP x FSDP2)."""
    placements = tuple(param.placements)
    if batch is not None and param.device_mesh.ndim == 1 and placements == (Shard(1),) \
            and param.dim() == 3 and not batch.transposed and batch.interleaved_parts == 1:
        return True
    if engine == MEGATRON_FSDP and param.device_mesh.ndim == 2 and placements[0] == Shard(0) \
            and placements[1] in (Replicate(), *(Shard(d) for d in range(param.dim()))):
        return True
    if param.device_mesh.ndim == 1 and placements == (Shard(0),) and param.dim() >= 1:
        return True
    taken = all(isinstance(p, (Shard, _StridedShard, Replicate)) for p in placements)
    if engine == TORCH_FSDP2 and taken and param.dim() >= 1:
        return False
    raise ValueError(
        f"parameter {fqn!r}: DTensor placement {placements} on a {param.device_mesh.ndim}-D mesh "
        f"(shape {tuple(param.shape)}) is not supported; "
        + ("megatron_eopt takes Shard, _StridedShard and Replicate placements on any mesh (a Partial parameter "
           "has no value until it is reduced: place it Replicate() or Shard(d))." if engine == TORCH_FSDP2 else
           "Megatron-FSDP's are Shard(0) on its 1-D mesh and (Shard(0), Shard(d) or Replicate()) on its (dp, tp) "
           "mesh.")
    )


def _common_group(sharded: list[tuple[str, DTensor]]) -> ProcessGroup:
    """The one data-parallel mesh of `sharded` (the dense parameters, or the experts): each one's
    mesh, or its (dp, tp) mesh's dp dimension (Megatron-FSDP with TP), is the same."""
    first_fqn, first = sharded[0]
    for fqn, param in sharded[1:]:
        if _row_mesh(param) != _row_mesh(first):
            raise ValueError(
                f"parameters {first_fqn!r} and {fqn!r} are on different DeviceMeshes ({first.device_mesh} "
                f"and {param.device_mesh}); fully_shard every module over one mesh (the routed experts, "
                f"'*.experts.*', may have a mesh of their own: the expert data-parallel group's)."
            )
    return row_group(first)


def _check_one_mesh(dense: list[tuple[str, DTensor]]) -> None:
    """With the placed path the gradient norm sums over every dimension of the dense mesh, which
    counts each part once only if every dense parameter lies on that one mesh."""
    first_fqn, first = dense[0]
    for fqn, param in dense[1:]:
        if param.device_mesh != first.device_mesh:
            raise ValueError(
                f"parameters {first_fqn!r} and {fqn!r} are on different DeviceMeshes ({first.device_mesh} and "
                f"{param.device_mesh}); with placements beside Shard(0) (tensor parallelism) every dense parameter "
                f"must lie on one mesh (place the others Replicate() on its tensor-parallel dimension).")


def _row_mesh(param: DTensor) -> Any:
    mesh = param.device_mesh
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[0]]


def check_fsdp2_averages(device: torch.device, torch_version: str = torch.__version__) -> None:
    """Refuse a torch whose FSDP2 sums the gradients of CPU (gloo) parameters instead of averaging them."""
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    if device.type == "cpu" and release < FSDP2_AVERAGES_ON_CPU_SINCE:
        raise RuntimeError(
            f"torch {torch_version}'s FSDP2 sums gradients over gloo instead of averaging them (torch issue "
            f"#162338), so CPU training with it would be silently wrong: use torch>=2.9 (pyproject.toml's floor)."
        )
