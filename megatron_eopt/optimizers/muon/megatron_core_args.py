"""megatron-core's TensorParallelMuon arguments, turned into the ones our optimizers take.

megatron-core's `TensorParallelMuon(..., use_decoupled_weight_decay, split_qkv, is_qkv_fn,
qkv_split_shapes, ..., pg_collection, tp_mode)`:
- `use_decoupled_weight_decay`: weight_decay_method 'decoupled' (True) or 'l2' (False);
- `pg_collection`: the TP group is its `tp` (its `expt_tp` for parameters tagged `expert_tp`),
  and each parameter's megatron-core attribute `partition_dim` (0, 1; -1 or absent: not split)
  says which dimension that group splits;
- `split_qkv`: a parameter for which `is_qkv_fn(p)` holds is orthogonalized as separate q, k, v
  (, gate) matrices: its rows are query groups of `p.qkv_split_shapes` (else `qkv_split_shapes`)
  rows each, and block j of every group makes matrix j.
Here these become `weight_decay_method`, `tp_group` and one MatrixLayout per parameter.
"""

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.params.names import named_params
from megatron_eopt.runtime.process_groups import group_size

IsQkvFn = Callable[[torch.Tensor], bool]


def weight_decay_method_of(use_decoupled_weight_decay: bool, weight_decay_method: Optional[str]) -> str:
    """megatron-core's `use_decoupled_weight_decay`, unless `weight_decay_method` (ours) is given."""
    if weight_decay_method is None:
        return "decoupled" if use_decoupled_weight_decay else "l2"
    if not use_decoupled_weight_decay and weight_decay_method != "l2":
        raise ValueError(
            f"use_decoupled_weight_decay=False means weight_decay_method='l2'; got weight_decay_method="
            f"{weight_decay_method!r} as well. Pass one of the two."
        )
    return weight_decay_method


def tp_group_of(pg_collection: Any, tp_group: Optional[dist.ProcessGroup],
                param_groups: Sequence[Mapping[str, Any]]) -> Optional[dist.ProcessGroup]:
    """The TP group: `tp_group`, or from `pg_collection` as megatron-core picks it."""
    if pg_collection is None:
        return tp_group
    if tp_group is not None:
        raise ValueError("pass the tensor-parallel group once: pg_collection (megatron-core's) or tp_group, not both.")
    for name in ("gtp_remat", "expt_gtp_remat"):
        group = getattr(pg_collection, name, None)
        if group is not None and group_size(group) > 1:
            raise ValueError(f"pg_collection.{name} has {group_size(group)} ranks; generalized tensor "
                             f"parallelism (GTP remat) is not supported by megatron_eopt's Muon: use size 1.")
    kinds = sorted({"expt_tp" if getattr(p, "expert_tp", False) else "tp" for p, _ in named_params(param_groups)})
    for kind in kinds:
        if not hasattr(pg_collection, kind):
            raise ValueError(f"pg_collection has no {kind!r} group; pass megatron-core's ProcessGroupCollection "
                             f"with a '{kind}' group (or tp_group).")
    groups = [getattr(pg_collection, kind) for kind in kinds]
    if len(groups) == 2 and groups[0] is not groups[1] and group_size(groups[0]) * group_size(groups[1]) > 1:
        raise ValueError("these parameters mix expert (expert_tp=True) and dense ones, whose TP groups differ "
                         "(pg_collection.expt_tp, pg_collection.tp); give each kind its own optimizer.")
    return next((g for g in groups if group_size(g) > 1), groups[0] if groups else getattr(pg_collection, "tp", None))


def megatron_core_layouts(param_groups: Sequence[Mapping[str, Any]], tp_group: Optional[dist.ProcessGroup],
                          split_qkv: bool, is_qkv_fn: Optional[IsQkvFn],
                          qkv_split_shapes: Optional[Sequence[int]]) -> dict[str, MatrixLayout]:
    """name -> MatrixLayout of every parameter, from its `partition_dim` and the QKV split."""
    if split_qkv and not callable(is_qkv_fn):
        raise ValueError(f"split_qkv=True needs is_qkv_fn, a function telling fused QKV weights apart "
                         f"(e.g. lambda p: getattr(p, 'is_qkv', False)); got {is_qkv_fn!r}.")
    tp_size = group_size(tp_group)
    layouts = {}
    for param, name in named_params(param_groups):
        if param.dim() != 2:
            continue  # the 2-D check names it
        partition_dim = getattr(param, "partition_dim", -1)
        partition_dim = partition_dim if partition_dim in (0, 1) and tp_size > 1 else -1
        num_row_groups, row_blocks = 1, ()
        if split_qkv and is_qkv_fn(param):
            shapes = getattr(param, "qkv_split_shapes", None) or qkv_split_shapes
            if not shapes or any(int(s) <= 0 for s in shapes):
                raise ValueError(f"parameter {name!r} is a QKV weight to split (split_qkv=True) but has no "
                                 f"qkv_split_shapes (rows of q, k, v per query group); got {shapes!r}.")
            row_blocks = tuple(int(s) for s in shapes)
            num_row_groups = max(1, param.shape[0] // sum(row_blocks))  # MatrixLayout checks the rest
        layouts[name] = MatrixLayout(name, tuple(param.shape), partition_dim, tp_size if partition_dim >= 0 else 1,
                                     num_row_groups, row_blocks)
    return layouts
