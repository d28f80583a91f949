"""The process groups the optimizer needs, from whichever source the trainer has.

Sources: megatron-core's `ProcessGroupCollection` (read by attribute name), megatron-core's
global `parallel_state`, a torch `DeviceMesh`, or explicit groups. A field is `None` when
that dimension has size 1 (no communication). A group that is needed but missing is an error
that says how to provide it; nothing ever falls back to the WORLD group.
"""

import sys
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups by role; `None` means size 1.

    tp: tensor-parallel group of dense parameters.       expt_tp: of expert parameters.
    mp: model-parallel group (tp x pp), over which the gradient norm of dense parameters is
        summed.                                          expt_mp: the same for experts (tp x ep x pp).
    dp_cp: data-parallel group including context-parallel ranks.  expt_dp: of experts.
    tp_dp_cp: tensor x data x context parallel: all the ranks of one pipeline stage, so, without
        pipeline parallelism, all the ranks of this job (which need not be torch's WORLD: several
        jobs may share one). Checkpoints are written and read together over it.
    job: all the ranks of this job, every pipeline stage; checkpoints with pipeline parallelism
        are written and read together over it.
    """

    tp: Optional[ProcessGroup] = None
    mp: Optional[ProcessGroup] = None
    dp_cp: Optional[ProcessGroup] = None
    expt_tp: Optional[ProcessGroup] = None
    expt_mp: Optional[ProcessGroup] = None
    expt_dp: Optional[ProcessGroup] = None
    tp_dp_cp: Optional[ProcessGroup] = None
    job: Optional[ProcessGroup] = None
    # Which fields were given explicitly; a missing expert group is only an error if there are
    # expert parameters, which the factory knows and this record does not.
    provided: frozenset = frozenset()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "provided" and value is not None and not isinstance(value, ProcessGroup):
                raise TypeError(
                    f"ParallelGroups.{f.name} must be a torch.distributed.ProcessGroup or None; "
                    f"got {type(value).__name__}."
                )

    @classmethod
    def single_process(cls) -> "ParallelGroups":
        """Every dimension of size 1 (no torch.distributed needed)."""
        return cls(provided=frozenset(_ROLES))

    @classmethod
    def from_groups(cls, **groups: Optional[ProcessGroup]) -> "ParallelGroups":
        """Explicit groups by role name (tp, mp, dp_cp, expt_tp, expt_mp, expt_dp, tp_dp_cp, job)."""
        unknown = sorted(set(groups) - set(_ROLES))
        if unknown:
            raise ValueError(f"unknown process-group roles {unknown}; allowed: {list(_ROLES)}.")
        normalized = {role: _trivial_to_none(group) for role, group in groups.items()}
        return cls(**normalized, provided=frozenset(groups))

    @classmethod
    def from_pg_collection(cls, pg_collection: Any) -> "ParallelGroups":
        """From megatron-core's `ProcessGroupCollection` (or any object with the same names)."""
        found = {}
        for role, attribute in _PG_COLLECTION_NAMES.items():
            group = _get_attribute(pg_collection, attribute)
            if group is not None:
                found[role] = group
        missing = [_PG_COLLECTION_NAMES[role] for role in ("tp", "mp") if role not in found]
        if missing:
            raise ValueError(
                f"pg_collection has no {' or '.join(repr(m) for m in missing)} process group. "
                f"The optimizer needs the tensor-parallel group ('tp') and the model-parallel "
                f"group ('mp'); build the collection with "
                f"ProcessGroupCollection.use_mpu_process_groups() or set those attributes."
            )
        return cls.from_groups(**found)

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        """From megatron-core's global `parallel_state` (after `initialize_model_parallel`)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise ValueError(
                "megatron-core parallel_state is not initialized; call "
                "parallel_state.initialize_model_parallel(...) first or pass pg_collection."
            )
        return cls.from_groups(
            tp=ps.get_tensor_model_parallel_group(),
            mp=ps.get_model_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            expt_tp=ps.get_expert_tensor_parallel_group(),
            expt_mp=ps.get_expert_tensor_model_pipeline_parallel_group(),
            expt_dp=ps.get_expert_data_parallel_group(),
            tp_dp_cp=ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
            # megatron-core's initialize_model_parallel divides torch's WORLD among its groups,
            # so a job described by parallel_state is WORLD.
            job=dist.group.WORLD,
        )

    @classmethod
    def from_device_mesh(
        cls, mesh: Any, tp_dim: Optional[str] = "tp", dp_dim: Optional[str] = "dp"
    ) -> "ParallelGroups":
        """From a torch `DeviceMesh` with a tensor-parallel and a data-parallel dimension.

        Pipeline parallelism is not expressed by such a mesh, so the model-parallel group is the
        tensor-parallel group. A named dimension that the mesh lacks is an error. The group of all
        the mesh's ranks (`tp_dp_cp`, for checkpoints) is known only for a 1-D mesh; for a 2-D
        one pass it with `from_groups`.
        """
        names = tuple(mesh.mesh_dim_names or ())
        for dim in (tp_dim, dp_dim):
            if dim is not None and dim not in names:
                raise ValueError(
                    f"DeviceMesh has no dimension {dim!r}; its dimensions are {names}. Pass "
                    f"tp_dim/dp_dim naming existing dimensions (or None for size 1)."
                )
        tp = mesh.get_group(tp_dim) if tp_dim is not None else None
        dp = mesh.get_group(dp_dim) if dp_dim is not None else None
        whole = {"tp_dp_cp": mesh.get_group()} if mesh.ndim == 1 else {}
        return cls.from_groups(tp=tp, mp=tp, dp_cp=dp, **whole)

    def spanning_groups(self) -> tuple[ProcessGroup, ...]:
        """Groups whose successive gathers reach every rank of the job, without a job-wide group.

        Model parallel (the ranks whose parameters differ: pipeline stages) then data parallel
        (replicas), dense then expert: those given, of size > 1, in one order on every rank.
        Gathering over mp, then over dp_cp what mp gave, covers the grid mp x dp_cp.
        """
        roles = ("mp", "dp_cp", "expt_mp", "expt_dp")
        return tuple(getattr(self, role) for role in roles if getattr(self, role) is not None)

    def require(self, role: str, why: str) -> Optional[ProcessGroup]:
        """The group for `role`, or an error if it was never given (None given means size 1)."""
        if role not in self.provided:
            raise ValueError(
                f"{why} needs the {role!r} process group, which was not provided. Pass it in "
                f"pg_collection (megatron-core name {_PG_COLLECTION_NAMES[role]!r})."
            )
        return getattr(self, role)


_PG_COLLECTION_NAMES = {
    "tp": "tp",
    "mp": "mp",
    "dp_cp": "dp_cp",
    "expt_tp": "expt_tp",
    "expt_mp": "tp_ep_pp",
    "expt_dp": "expt_dp",
    "tp_dp_cp": "tp_dp_cp",
    # Not a megatron-core ProcessGroupCollection field: set `pg_collection.job` for checkpoints
    # with pipeline parallelism.
    "job": "job",
}
_ROLES = tuple(_PG_COLLECTION_NAMES)


def _get_attribute(obj: Any, name: str) -> Optional[ProcessGroup]:
    # megatron-core's ProcessGroupCollection raises from __getattr__ for unset groups.
    try:
        return getattr(obj, name, None)
    except (AttributeError, ValueError, RuntimeError):
        return None


def _trivial_to_none(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    if group is None:
        return None
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"expected a torch.distributed.ProcessGroup; got {type(group).__name__}.")
    return group if group_size(group) > 1 else None


def resolve_parallel_groups(pg_collection: Any = None) -> ParallelGroups:
    """The groups for `get_megatron_optimizer(pg_collection=...)`.

    `None` means: a single process when torch.distributed is not initialized (or has one
    rank), else megatron-core's global parallel_state, which must then be initialized.
    """
    if isinstance(pg_collection, ParallelGroups):
        return pg_collection
    if pg_collection is not None:
        return ParallelGroups.from_pg_collection(pg_collection)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ParallelGroups.single_process()
    try:
        return ParallelGroups.from_parallel_state()
    except ValueError:
        raise ValueError(
            f"torch.distributed runs {dist.get_world_size()} ranks but no process groups were "
            f"given: pass pg_collection (megatron-core ProcessGroupCollection, or "
            f"megatron_eopt.ParallelGroups) or initialize megatron-core parallel_state."
        ) from None


def initialized_parallel_state_groups() -> Optional[ParallelGroups]:
    """megatron-core's parallel_state groups when it is initialized in this process, else None
    (never importing megatron-core for the question)."""
    if "megatron.core.parallel_state" not in sys.modules:
        return None
    from megatron.core import parallel_state as ps

    return ParallelGroups.from_parallel_state() if ps.model_parallel_is_initialized() else None


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a megatron-core tensor-parallel layer splits one of its parameters."""

    partition_dim: int  # megatron-core's: 0 column-parallel rows, 1 row-parallel columns
    tp_size: int  # ranks the layer was built for (its full size over its shard's)
    group: Optional[ProcessGroup]  # the layer's own tensor-parallel group


def megatron_tensor_parallel_split(module: torch.nn.Module, param_name: str) -> Optional[TensorParallelSplit]:
    """The split of `module`'s parameter `param_name` if a megatron-core tensor-parallel layer
    shards it (column-parallel weight and bias, row-parallel weight, vocab-parallel embedding);
    None for any other parameter (a row-parallel bias is whole on every TP rank).

    Read from the module type and sizes, because torch FSDP2's `fully_shard` drops megatron-core's
    parameter attributes (`tensor_model_parallel`, `partition_dim`).
    """
    if "megatron.core.tensor_parallel" not in sys.modules:
        return None  # no megatron-core layer can exist
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    group = getattr(module, "tp_group", None)
    if isinstance(module, ColumnParallelLinear) and param_name in ("weight", "bias"):
        return TensorParallelSplit(0, module.output_size // module.output_size_per_partition, group)
    if isinstance(module, RowParallelLinear) and param_name == "weight":
        return TensorParallelSplit(1, module.input_size // module.input_size_per_partition, group)
    if isinstance(module, VocabParallelEmbedding) and param_name == "weight":
        return TensorParallelSplit(0, module.num_embeddings // module.num_embeddings_per_partition, group)
    return None


def group_ranks(group: Optional[ProcessGroup]) -> list[int]:
    """Global ranks of `group`; this rank alone for None (size 1)."""
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def group_size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """In-place sum over `group`; a no-op for a size-1 (None) group."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
