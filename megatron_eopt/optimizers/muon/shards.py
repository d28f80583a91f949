"""Where each of Muon's matrices lives, checked at construction, and the orthogonalize function
of all of them that the step is given.

`ShardedMatrices` is the part of TensorParallelMuon and TensorParallelAdaptiveMuon that knows
where each matrix lives (TP shards with `layouts`, or FSDP2 row shards with `fsdp_shards`) and
which TP mode each takes. It gives the step (step.py) its `orthogonalize_all_fn`: the method for
TP shards or the one for FSDP2 row shards, which read these facts when called.
"""

import logging
import typing
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from emerging_optimizers import mixin as eo_mixin
from emerging_optimizers import utils as eo_utils

from megatron_eopt.ops.gram_newton_schulz_package import PACKAGE_PATH
from megatron_eopt.ops.muon_cost import AUTO, HardwareProfile, choose_tp_modes, resolve_profile
from megatron_eopt.ops.newton_schulz import TP_MODES, NewtonSchulzSettings, block_paths, orthogonalize_updates
from megatron_eopt.ops.placed_matrices import PlacedMatrix, map_placed
from megatron_eopt.ops.row_shards import RowShards, matrix_row_shards, orthogonalize_row_shards
from megatron_eopt.ops.splits import (MatrixLayout, as_matrix, as_tensor, is_single_transposed, local_batch_layout,
                                      stored_shape)
from megatron_eopt.optimizers.muon.megatron_core_args import IsQkvFn, megatron_core_layouts, tp_group_of
from megatron_eopt.optimizers.muon.step import OrthogonalizeTogether
from megatron_eopt.params.names import is_expert_name, named_params
from megatron_eopt.runtime.once import first_time, warn_once
from megatron_eopt.runtime.process_groups import group_rank, group_size


def check_muon_arguments(tp_mode: str, lr: float, momentum: float, weight_decay: float,
                         weight_decay_method: str, fp32_matmul_prec: str, expert_tp_mode: Optional[str] = None) -> None:
    """Argument checks shared by the tensor-parallel Muon optimizers."""
    for name, value in (("tp_mode", tp_mode), ("expert_tp_mode", expert_tp_mode or tp_mode)):
        if value not in (*TP_MODES, AUTO):
            raise ValueError(f"{name} must be one of {', '.join(map(repr, (*TP_MODES, AUTO)))}; got {value!r}.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1); got {momentum}.")
    if lr < 0.0 or weight_decay < 0.0:
        raise ValueError(f"lr and weight_decay must be >= 0; got lr={lr}, weight_decay={weight_decay}.")
    # emerging_optimizers only looks at these in the first step; check them now.
    for name, value, valid in (("weight_decay_method", weight_decay_method, typing.get_args(eo_mixin.WeightDecayT)),
                               ("fp32_matmul_prec", fp32_matmul_prec, typing.get_args(eo_utils.FP32MatmulPrecT))):
        if value not in valid:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, valid))}; got {value!r}.")


def layouts_by_param(param_groups: list[dict], layouts: Mapping[str, MatrixLayout],
                     row_shards: Optional[Mapping[str, RowShards]] = None) -> dict[int, MatrixLayout]:
    """One layout per parameter (by id), checked at construction rather than in the first step.

    Param groups name their parameters in 'param_fqns'; a parameter without a layout is a
    whole, unfused matrix. With FSDP2 (`row_shards`), a batch of matrices' layout is in its row
    shards, which `row_shards_by_param` checks.
    """
    by_param = {}
    for param, name in named_params(param_groups):
        shards = (row_shards or {}).get(name)
        if shards is not None and shards.layout.batch is not None:
            continue
        layout = layouts.get(name)
        if param.dim() != 2 and (layout is None or layout.batch is None):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(param.shape)}; Muon updates 2-D matrices, and N-D "
                f"tensors whose layout makes them a batch of matrices (MoE experts, docs/fsdp2.md). Route "
                f"it to the scalar optimizer (muon_scalar_optimizer) instead."
            )
        layout = layout or MatrixLayout(name=name, local_shape=tuple(param.shape))
        if _view_shape(param, layout) != layout.local_shape:
            raise ValueError(
                f"parameter {name!r}: layout shape {layout.local_shape} differs from the "
                f"parameter's {tuple(param.shape)}."
            )
        by_param[id(param)] = layout
    return by_param


def row_shards_by_param(param_groups: list[dict], fsdp_shards: Optional[Mapping[str, RowShards]],
                        fsdp_group: Optional[dist.ProcessGroup], tp_group: Optional[dist.ProcessGroup],
                        layouts: Optional[Mapping[str, MatrixLayout]]) -> Optional[dict[int, RowShards]]:
    """id(param) -> RowShards for an FSDP2 run (None otherwise), checked at construction.

    With a `tp_group` of size > 1 (TP x FSDP2), each RowShards' layout is of this TP rank's
    shard, which FSDP2 splits by rows; its `tp_size` must be the group's.
    """
    if fsdp_shards is None:
        return None
    if layouts:
        raise ValueError(
            "fsdp_shards (torch FSDP2) and layouts were both given; with FSDP2 each matrix's layout "
            "(of this TP rank's shard) belongs inside its RowShards, and layouts must be empty."
        )
    rank = group_rank(fsdp_group)
    tp_size = group_size(tp_group)
    by_param = {}
    for group in param_groups:
        for param, name in zip(group["params"], group.get("param_fqns") or ()):
            shards = fsdp_shards.get(name)
            if shards is None:
                raise ValueError(f"parameter {name!r} has no entry in fsdp_shards; every parameter needs one.")
            _check_row_shard(name, param, shards, rank, tp_size)
            by_param[id(param)] = shards
    missing = sum(len(g["params"]) for g in param_groups) - len(by_param)
    if missing:
        raise ValueError(f"{missing} parameters have no 'param_fqns' name; fsdp_shards needs them named.")
    return by_param


def _view_shape(param: torch.Tensor, layout: MatrixLayout) -> tuple[int, ...]:
    """The shape of the matrix Muon sees of `param` (a batch's 2-D view of this rank's matrices)."""
    if layout.batch is None:
        return tuple(param.shape)
    if layout.batch.single:  # one matrix stored transposed: whole here
        return layout.batch.matrix_shape if tuple(param.shape) == layout.batch.shape else tuple(param.shape)
    if param.dim() != len(layout.batch.shape) or tuple(param.shape[1:]) != layout.batch.shape[1:]:
        return tuple(param.shape)  # no view fits: the caller names the mismatch
    return layout.batch.with_leading(param.shape[0]).matrix_shape


def _check_row_shard(name: str, param: torch.Tensor, shards: Union[RowShards, PlacedMatrix], rank: int,
                     tp_size: int) -> None:
    if isinstance(shards, PlacedMatrix):
        if tuple(param.shape) != tuple(shards.local_shape):
            raise ValueError(f"parameter {name!r}: this rank holds a {tuple(param.shape)} part, but its placements "
                             f"{shards.placements} give {tuple(shards.local_shape)}.")
        return
    expected = (shards.rows_by_rank[rank], stored_shape(shards.layout)[1])
    view = _view_shape(param, shards.layout)
    if shards.per_matrix_rows:  # [E, rows of each expert, in]
        expected, view = (*shards.layout.batch.shape[:1], *expected), tuple(param.shape)
    elif is_single_transposed(shards.layout):  # its stored rows, [in_i, out]
        view = tuple(param.shape)
    if view != expected:
        raise ValueError(
            f"parameter {name!r}: this rank ({rank}) holds a {tuple(param.shape)} shard, but its "
            f"row split {shards.rows_by_rank} of {shards.layout.local_shape} gives {expected}."
        )
    if shards.layout.partition_dim >= 0 and shards.layout.tp_size != tp_size:
        # Otherwise the global shape, and so the Muon scale, would be wrong.
        raise ValueError(
            f"parameter {name!r}: its layout is split over tp_size={shards.layout.tp_size} TP ranks, but "
            f"tp_group has {tp_size}; pass the parameters' tensor-parallel group."
        )


def matrix_layouts_of(layout_of: Mapping[int, MatrixLayout],
                      row_shards_of: Optional[Mapping[int, RowShards]]) -> list[MatrixLayout]:
    """The layouts of the matrices orthogonalized: those in the row shards with FSDP2."""
    source = layout_of if row_shards_of is None else {k: s.layout for k, s in row_shards_of.items()}
    return list(source.values())


def warn_if_blockwise_splits(tp_group: Optional[dist.ProcessGroup], blockwise: list[MatrixLayout]) -> None:
    """Warn once per process when tp_mode='blockwise' orthogonalizes tensor-parallel shards
    (`blockwise`: the layouts in that mode).

    Then the update depends on the TP degree. It is megatron-core's default, so a megatron-core
    OptimizerConfig passed as it is brings it along; the value is kept, and this says so.
    """
    tp_size = group_size(tp_group)
    sharded = [layout.name for layout in blockwise if layout.partition_dim >= 0]
    if tp_size == 1 or not sharded:
        return
    warn_once(
        "blockwise",
        f"muon_tp_mode='blockwise' orthogonalizes each tensor-parallel shard on its own: "
        f"parameter {sharded[0]!r} is split over {tp_size} TP ranks, so Muon's update depends on "
        f"the TP degree. 'blockwise' is megatron-core's OptimizerConfig default (megatron_eopt's "
        f"is 'duplicated'); set muon_tp_mode='duplicated', 'distributed' or 'sharded' for the "
        f"TP=1 update.",
        stacklevel=4,
    )


logger = logging.getLogger(__name__)


def log_newton_schulz_paths(paths: Mapping[str, tuple[str, ...]], precision: str) -> None:
    """One info line per process: how many blocks take Gram Newton-Schulz (ours or, PACKAGE_PATH,
    the gram-newton-schulz package's), and which."""
    gram = sorted({name for name, kinds in paths.items() if set(kinds) - {"standard"}})
    standard = sorted({name for name, kinds in paths.items() if "standard" in kinds})
    if not paths or not first_time("gram_newton_schulz_paths"):
        return
    count = sum(kinds.count("gram") + kinds.count(PACKAGE_PATH) for kinds in paths.values())
    package = sum(kinds.count(PACKAGE_PATH) for kinds in paths.values())
    total = sum(len(kinds) for kinds in paths.values())
    logger.info(
        "Gram Newton-Schulz (fp32_matmul_prec=%r): %d of %d blocks take the Gram path (e.g. %s), %d of them "
        "through the gram-newton-schulz package; the standard path: %s. The optimizer's newton_schulz_paths "
        "lists every parameter.",
        precision, count, total, ", ".join(gram[:3]) or "none", package, ", ".join(standard[:3]) or "none",
    )


class ShardedMatrices(OrthogonalizeTogether):
    """Layouts and shards of TensorParallelMuon's and TensorParallelAdaptiveMuon's parameters.

    The subclass sets `self.settings` (NewtonSchulzSettings: scaled or raw) and calls
    `_set_up_shards` after its parent's `__init__`, which makes `self.param_groups`.
    """

    settings: NewtonSchulzSettings

    def _megatron_core_shards(self, pg_collection: Any, split_qkv: bool, is_qkv_fn: Optional[IsQkvFn],
                              qkv_split_shapes: Optional[list[int]], tp_group: Optional[dist.ProcessGroup],
                              layouts: Optional[Mapping[str, MatrixLayout]],
                              ) -> tuple[Optional[dist.ProcessGroup], Optional[Mapping[str, MatrixLayout]]]:
        """(tp_group, layouts) with megatron-core's arguments applied (megatron_core_args.py);
        a layout given in `layouts` wins. Kept as attributes under megatron-core's names."""
        self.pg_collection, self.split_qkv = pg_collection, split_qkv
        self.is_qkv_fn, self.qkv_split_shapes = is_qkv_fn, qkv_split_shapes
        if pg_collection is None and not split_qkv:
            return tp_group, layouts
        tp_group = tp_group_of(pg_collection, tp_group, self.param_groups)
        derived = megatron_core_layouts(self.param_groups, tp_group, split_qkv, is_qkv_fn, qkv_split_shapes)
        return tp_group, {**derived, **dict(layouts or {})}

    def _set_up_shards(self, tp_mode: str, tp_group: Optional[dist.ProcessGroup],
                       layouts: Optional[Mapping[str, MatrixLayout]], fsdp_group: Optional[dist.ProcessGroup],
                       fsdp_shards: Optional[Mapping[str, RowShards]],
                       hardware_profile: Union[None, str, HardwareProfile] = None,
                       expert_tp_mode: Optional[str] = None) -> None:
        """Check every parameter against its layout (or row shards) now rather than in `step`,
        and resolve each matrix's TP mode (`tp_modes`; 'auto' asks ops/muon_cost.py)."""
        self.tp_mode = tp_mode
        self.expert_tp_mode = expert_tp_mode or tp_mode
        self.tp_group = tp_group
        self._layout_of = layouts_by_param(self.param_groups, dict(layouts or {}), fsdp_shards)
        self.fsdp_group = fsdp_group
        self._row_shards_of = row_shards_by_param(self.param_groups, fsdp_shards, fsdp_group, tp_group, layouts)
        matrix_layouts = matrix_layouts_of(self._layout_of, self._row_shards_of)
        tp_size = group_size(tp_group)
        # Decided from the config alone, so all TP ranks calibrate (a collective) or none does.
        uses_auto = AUTO in (self.tp_mode, self.expert_tp_mode)
        self.tp_profile = self._tp_profile(tp_size, hardware_profile) if uses_auto else None
        # fqn -> mode, for every matrix this optimizer was told of (the layer-wise optimizer's
        # unowned ones too): shapes decide 'auto', so every rank agrees.
        known = {layout.name: layout for layout in (*dict(layouts or {}).values(), *matrix_layouts)}
        self.tp_modes = self._resolve_tp_modes(list(known.values()), tp_size)
        warn_if_blockwise_splits(tp_group, [lay for lay in matrix_layouts if self.tp_modes[lay.name] == "blockwise"])
        # fqn -> 'gram' or 'standard' per block (q/k/v, gate/up), as the step runs them.
        self.newton_schulz_paths = {layout.name: block_paths(layout, self.tp_modes[layout.name], tp_size,
                                                             self.settings, self.fp32_matmul_prec)
                                    for layout in matrix_layouts}
        if self.settings.gram:
            log_newton_schulz_paths(self.newton_schulz_paths, self.fp32_matmul_prec)
        if self.settings.package is not None:  # its CUDA kernels imported now, not in the first step
            for device in {p.device for group in self.param_groups for p in group["params"]}:
                self.settings.package.prepare(device)
        self.orthogonalize_all_fn = (self._orthogonalize_tp_shards if self._row_shards_of is None
                                     else self._orthogonalize_fsdp_shards)

    def _resolve_tp_modes(self, layouts: list[MatrixLayout], tp_size: int) -> dict[str, str]:
        """Routed experts' matrices take `expert_tp_mode`, the others `tp_mode`; 'auto' plans
        the matrices set to it together."""
        by_mode: dict[str, list[MatrixLayout]] = {}
        for layout in layouts:
            by_mode.setdefault(self.expert_tp_mode if is_expert_name(layout.name) else self.tp_mode, []).append(layout)
        modes: dict[str, str] = {}
        for mode, members in by_mode.items():
            modes.update(choose_tp_modes(mode, members, tp_size, self.tp_profile, self.settings, self.fp32_matmul_prec))
        return modes

    def _tp_profile(self, tp_size: int, hardware_profile: Union[None, str, HardwareProfile]) -> Optional[HardwareProfile]:
        """The hardware profile 'auto' chooses with (None at TP=1); calibrated on the parameters'
        device over the TP group unless `hardware_profile` names or is one."""
        if tp_size == 1:
            return None
        device = next((p.device for group in self.param_groups for p in group["params"]), None)
        return resolve_profile(hardware_profile, device, self.tp_group)

    def _orthogonalize_tp_shards(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """The orthogonalized `updates` of `params`: TP shards (or whole matrices), each in its tp_mode."""
        layouts = [self._layout_of[id(p)] for p in params]
        modes = [self.tp_modes[layout.name] for layout in layouts]
        matrices = [as_matrix(u, layout) for u, layout in zip(updates, layouts)]
        results = orthogonalize_updates(matrices, layouts, modes, self.tp_group, self.settings)
        return [as_tensor(r, layout) for r, layout in zip(results, layouts)]

    def _orthogonalize_fsdp_shards(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of the orthogonalized `updates` of `params`, FSDP2 row shards: each matrix
        to its owner and back, its TP shards (with TP as well) in its tp_mode. Experts split by
        their leading dimension stay on their rank; experts split by the rows of each go one
        expert per owner, in the same exchange, as does a matrix stored transposed (its stored rows)."""
        shards = [self._row_shards_of[id(p)] for p in params]
        modes = [self.tp_modes[s.layout.name] for s in shards]
        placed = [i for i, s in enumerate(shards) if isinstance(s, PlacedMatrix)]
        held = [i not in placed and s.layout.batch is not None and not (s.per_matrix_rows or s.layout.batch.single)
                for i, s in enumerate(shards)]
        batches = [i for i, whole in enumerate(held) if whole]
        others = [i for i, whole in enumerate(held) if not whole and i not in placed]
        # Experts split by the rows of each (Shard(1)): each expert is a matrix of the exchange.
        matrices = [matrix_row_shards(shards[i]) if shards[i].per_matrix_rows else [shards[i]] for i in others]
        rows = [list(updates[i].unbind(0)) if shards[i].per_matrix_rows else [updates[i]] for i in others]
        exchanged = iter(orthogonalize_row_shards(
            [u for part in rows for u in part], [m for part in matrices for m in part], self.fsdp_group,
            self.settings, [modes[i] for i, part in zip(others, matrices) for _ in part], self.tp_group))
        results: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for i, part in zip(others, matrices):
            done = [next(exchanged) for _ in part]
            results[i] = torch.stack(done) if shards[i].per_matrix_rows else done[0]
        for i, result in zip(batches, self._orthogonalize_held_matrices([updates[i] for i in batches],
                                                                        [shards[i].layout for i in batches])):
            results[i] = result
        for i, result in zip(placed, self._orthogonalize_placed([updates[i] for i in placed],
                                                                [shards[i] for i in placed])):
            results[i] = result
        return results

    def _orthogonalize_placed(self, updates: list[torch.Tensor], placed: list[PlacedMatrix]) -> list[torch.Tensor]:
        """This rank's parts of the orthogonalized updates of parameters on the placed path
        (ops/placed_matrices.py): each gathered whole over its mesh, orthogonalized on every rank."""
        def orthogonalize(wholes: list[torch.Tensor]) -> list[torch.Tensor]:
            layouts = [p.layout for p in placed]
            done = orthogonalize_updates([as_matrix(w, layout) for w, layout in zip(wholes, layouts)], layouts,
                                         "duplicated", None, self.settings)
            return [as_tensor(result, layout) for result, layout in zip(done, layouts)]

        return map_placed(updates, placed, orthogonalize)

    def _orthogonalize_held_matrices(self, updates: list[torch.Tensor],
                                     layouts: list[MatrixLayout]) -> list[torch.Tensor]:
        """Batches of matrices (experts) split over FSDP2 ranks by their leading dimension: each
        rank holds whole matrices and orthogonalizes its own, equal shapes in one batched call,
        with nothing sent."""
        local = [local_batch_layout(layout, tuple(u.shape)) for u, layout in zip(updates, layouts)]
        held = [k for k, layout in enumerate(local) if layout.num_row_groups > 0]  # a rank may hold none
        results = [torch.zeros_like(u) for u in updates]
        done = orthogonalize_updates([as_matrix(updates[k], local[k]) for k in held], [local[k] for k in held],
                                     "duplicated", None, self.settings) if held else []
        for k, result in zip(held, done):
            results[k] = as_tensor(result, local[k])
        return results
