"""TensorParallelAdaptiveMuon: emerging_optimizers' AdaptiveMuon for TP shards and fused weights.

Update of each 2-D parameter p with gradient g (momentum beta, second-moment beta2, eps):
    p <- p * (1 - lr * wd);  m <- beta * m + (1 - beta) * g;  u <- lerp(g, m, beta) if nesterov else m
    O <- NewtonSchulz(B) for each block B of u (q/k/v of linear_qkv, gate/up of a gated linear_fc1)
    N <- O normalized by its second moment: adamuon elementwise (v of O^2), normuon per row or
         column (then rescaled to ||O||_F), namo by ||g||_F^2
    p <- p - lr * N * scale(global rows, cols) * extra_scale_factor
Everything is of the whole parameter, so tp_mode 'duplicated', 'distributed' and 'sharded' give
the TP=1 update to fp32 round-off: means and norms over a sharded dimension are summed over the
TP group (at most two all-reduces per step). 'blockwise' treats each shard as a whole parameter.
With FSDP2 (`fsdp_shards`) each matrix is orthogonalized once, on its owner (ops/row_shards.py),
and the statistics are summed over `fsdp_group` too. docs/tp-muon.md gives the formulas.
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon, Moment2MethodT

from megatron_eopt.ops.collectives import all_reduce_sum_coalesced
from megatron_eopt.ops.gram_newton_schulz_package import package_for
from megatron_eopt.ops.muon_cost import HardwareProfile
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.ops.placed_matrices import PlacedMatrix
from megatron_eopt.ops.row_shards import RowShards
from megatron_eopt.ops.splits import MatrixLayout, is_single_transposed
from megatron_eopt.optimizers.muon.megatron_core_args import IsQkvFn, weight_decay_method_of
from megatron_eopt.optimizers.muon.shards import ShardedMatrices, check_muon_arguments
from megatron_eopt.optimizers.muon.step import momentum_updates
from megatron_eopt.optimizers.muon.tensor_parallel_muon import muon_use_syrk
from megatron_eopt.runtime.process_groups import group_size

MOMENT2_METHODS: tuple[str, ...] = typing.get_args(Moment2MethodT)


@dataclass(frozen=True)
class _GlobalView:
    """The matrix whose statistics AdaptiveMuon takes, seen from one rank's shard."""

    shape: tuple[int, int]  # global shape [out, in]; the local one in blockwise mode or without TP
    sharded_dim: int  # the dimension split over the TP group (sums over it all-reduce); -1: none
    rows_split: bool = False  # FSDP2: the (stored) rows are split over fsdp_group too
    transposed: bool = False  # stored [in, out] (a Conv1D): dimensions below are of the storage

    @property
    def stored_shape(self) -> tuple[int, int]:
        return (self.shape[1], self.shape[0]) if self.transposed else self.shape

    @property
    def mean_dim(self) -> int:
        """normuon's averaged dimension of the stored tensor: AdaptiveMuon's rule, applied to the
        global [out, in] shape."""
        dim = 1 if self.shape[0] >= self.shape[1] else 0
        return 1 - dim if self.transposed else dim

    def split_over_tp(self, dim: Optional[int] = None) -> bool:
        """Whether a sum over `dim` (None: over the whole matrix) needs the TP group."""
        return self.sharded_dim >= 0 and dim in (None, self.sharded_dim)

    def split_over_fsdp(self, dim: Optional[int] = None) -> bool:
        """Whether a sum over `dim` (None: over the whole matrix) needs the FSDP2 group."""
        return self.rows_split and dim in (None, 0)


@dataclass
class _Pending:
    """One parameter's step between momentum and weight update."""

    group: dict
    param: torch.Tensor
    grad: torch.Tensor  # after weight decay (namo's ||g||)
    update: torch.Tensor  # momentum or Nesterov update, before orthogonalization
    view: _GlobalView


class TensorParallelAdaptiveMuon(ShardedMatrices, AdaptiveMuon):
    """AdaptiveMuon whose parameters may be TP shards (see the module docstring for the update).

    The arguments up to `eps` are megatron-core's TensorParallelAdaptiveMuon's, in its order and
    with its defaults (megatron-core's arguments act as in TensorParallelMuon). Keyword-only, ours:
        weight_decay_method: emerging_optimizers' name; None: from use_decoupled_weight_decay.
        tp_mode: 'blockwise', 'duplicated', 'distributed', 'sharded' or 'auto' (per matrix, the
            exact mode that ops/muon_cost.py predicts cheapest; `self.tp_modes` says which).
        tp_hardware_profile: what 'auto' predicts with: a HardwareProfile, a name ('h100', 'cpu'),
            or None: rates calibrated on the parameters' device over `tp_group` (cached).
        expert_tp_mode: the mode of routed experts' matrices ('.experts.' in the name); None: tp_mode.
        tp_group: the tensor-parallel group of these parameters (None: size 1).
        layouts: fqn -> MatrixLayout for parameters that are shards or fused; param groups
            name their parameters in 'param_fqns'. A parameter without a layout is a whole,
            unfused matrix.
        use_syrk: request emerging_optimizers' SYRK Newton-Schulz kernel (AdaptiveMuon itself
            never uses it); `self.use_syrk` is what emerging_optimizers' Muon decides for this
            machine (off without Triton >= 3.4 or on an unvalidated GPU), and what the step uses.
        gram_newton_schulz: Gram Newton-Schulz on the blocks where it costs fewer FLOPs
            (`self.newton_schulz_paths` says which; ops/gram_newton_schulz.py).
        gram_newton_schulz_package: those blocks, where whole on this rank, run through the
            gram-newton-schulz package (needs fp32_matmul_prec='medium').
        aol_preconditioner: Turbo-Muon: every Newton-Schulz starts from the AOL-preconditioned
            matrix (ops/aol.py); Turbo-Muon runs it with quintic x 4 (OptimizerConfig's default then).
        fsdp_group: the data-parallel group over which FSDP2 splits the matrices by rows.
        fsdp_shards: fqn -> RowShards (layout of the matrix FSDP2 splits, rows per rank, owner)
            of every parameter, each a row shard; given, `layouts` must be empty (a `tp_group`
            makes each matrix this TP rank's shard, whose layout says so).

    Checked here: tp_mode, lr, momentum, weight_decay, weight_decay_method, fp32_matmul_prec,
    coefficient_type, num_ns_steps, scale_mode, moment2_method, beta2, eps, that every
    parameter is 2-D and matches its layout's shape, and (outside blockwise mode) that every
    sharded layout's tp_size is the size of tp_group.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Optional[IsQkvFn] = None,
        qkv_split_shapes: Optional[list[int]] = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Any = None,
        tp_mode: str = "duplicated",
        moment2_method: str = "adamuon",
        beta2: float = 0.95,
        eps: float = 1e-8,
        *,
        weight_decay_method: Optional[str] = None,
        use_syrk: bool = False,
        gram_newton_schulz: bool = False,
        gram_newton_schulz_package: bool = False,
        aol_preconditioner: bool = False,
        tp_hardware_profile: Union[None, str, HardwareProfile] = None,
        expert_tp_mode: Optional[str] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        layouts: Optional[Mapping[str, MatrixLayout]] = None,
        fsdp_group: Optional[dist.ProcessGroup] = None,
        fsdp_shards: Optional[Mapping[str, RowShards]] = None,
    ) -> None:
        weight_decay_method = weight_decay_method_of(use_decoupled_weight_decay, weight_decay_method)
        check_muon_arguments(tp_mode, lr, momentum, weight_decay, weight_decay_method, fp32_matmul_prec,
                             expert_tp_mode)
        if moment2_method not in MOMENT2_METHODS:
            raise ValueError(
                f"moment2_method must be one of {', '.join(map(repr, MOMENT2_METHODS))}; got {moment2_method!r}."
            )
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1); got {beta2}.")
        if not eps > 0.0:
            raise ValueError(f"eps must be > 0 (it keeps all-zero rows and updates finite); got {eps}.")
        # Raw Newton-Schulz: the Muon scale comes after the second-moment normalization.
        self.use_syrk = muon_use_syrk(use_syrk)
        self.settings = NewtonSchulzSettings(
            num_ns_steps, coefficient_type, scale_mode, extra_scale_factor, use_syrk=self.use_syrk, scaled=False,
            gram=gram_newton_schulz, aol=aol_preconditioner,
            package=package_for(gram_newton_schulz, gram_newton_schulz_package, fp32_matmul_prec, coefficient_type,
                                num_ns_steps),
        )
        super().__init__(
            params, lr, momentum, weight_decay, nesterov=nesterov, weight_decay_method=weight_decay_method,
            fp32_matmul_prec=fp32_matmul_prec, coefficient_type=coefficient_type, num_ns_steps=num_ns_steps,
            scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, moment2_method=moment2_method,
            beta2=beta2, eps=eps,
        )
        tp_group, layouts = self._megatron_core_shards(pg_collection, split_qkv, is_qkv_fn, qkv_split_shapes,
                                                       tp_group, layouts)
        self._set_up_shards(tp_mode, tp_group, layouts, fsdp_group, fsdp_shards, tp_hardware_profile, expert_tp_mode)
        self._view_of = {key: self._global_view(layout) for key, layout in self._layout_of.items()}
        _refuse_placed(self._row_shards_of)
        if self._row_shards_of is not None:
            rows_split = group_size(fsdp_group) > 1
            self._view_of = {key: dataclasses.replace(self._global_view(shards.layout), rows_split=rows_split)
                             for key, shards in self._row_shards_of.items()}

    def _global_view(self, layout: MatrixLayout) -> _GlobalView:
        tp_size = group_size(self.tp_group)
        if self.tp_modes.get(layout.name, self.tp_mode) == "blockwise" or layout.partition_dim < 0:
            return _GlobalView(layout.local_shape, -1, transposed=is_single_transposed(layout))
        if layout.tp_size != tp_size:
            # Otherwise the global shape, and so the scale and the normuon mean, would be wrong.
            raise ValueError(
                f"parameter {layout.name!r}: its layout is sharded over tp_size={layout.tp_size} but "
                f"tp_group has {tp_size} rank(s); pass the parameters' TP group (or tp_mode='blockwise')."
            )
        shape = list(layout.local_shape)
        shape[layout.partition_dim] *= tp_size
        return _GlobalView((shape[0], shape[1]), layout.partition_dim if tp_size > 1 else -1)

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """AdaptiveMuon's lazy state, with normuon's buffer shaped by the global shape.

        The normuon buffer holds this rank's part of the global one: size 1 along the averaged
        dimension, which is chosen from the global shape (a shard may be wide where the whole
        matrix is tall).
        """
        for p in group["params"]:
            if (skip_non_grad_params and p.grad is None) or self.state[p]:
                continue
            if self.moment2_method == "adamuon":
                shape = list(p.shape)
            elif self.moment2_method == "normuon":
                shape = list(p.shape)
                shape[self._view_of[id(p)].mean_dim] = 1
            else:  # namo: one number, the same on every TP rank
                shape = [1]
            self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            self.state[p]["moment2_buffer"] = torch.zeros(shape, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        """AdaptiveMuon's step with every parameter's orthogonalization and statistics done together.

        Together, so that tp_mode='sharded' moves all shards with one exchange and the global
        means and norms take at most two all-reduces; weight decay, momentum, the Muon scale and
        the weight update are AdaptiveMuon's own (emerging_optimizers).
        """
        if closure is not None:
            raise ValueError("closure is not supported")
        pending = [_Pending(group, p, p.grad, update, self._view_of[id(p)])
                   for group, p, update in momentum_updates(self)]
        if not pending:
            return None
        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            orthogonal = self.orthogonalize_all_fn([item.param for item in pending], [item.update for item in pending])
        normalize = {"adamuon": self._adamuon, "normuon": self._normuon, "namo": self._namo}[self.moment2_method]
        for item, update in zip(pending, normalize(pending, orthogonal)):
            update = self._apply_muon_scale(update, *item.view.shape)
            self.pre_weight_update_fn_inplace(item.param, update)
            item.param.add_(update, alpha=-item.group["lr"])
            self.post_weight_update_fn_inplace(item.param)
        return None

    def _adamuon(self, pending: list[_Pending], orthogonal: list[torch.Tensor]) -> list[torch.Tensor]:
        # Elementwise: each shard's part of the global result needs nothing from other ranks.
        return [
            self._apply_moment2_normalization(o, self.state[item.param]["moment2_buffer"],
                                              item.group["beta2"], item.group["eps"])
            for item, o in zip(pending, orthogonal)
        ]

    def _normuon(self, pending: list[_Pending], orthogonal: list[torch.Tensor]) -> list[torch.Tensor]:
        # 1. Mean of O^2 along the global averaged dimension: partial sums meet when it is sharded.
        sums = [o.float().square().sum(dim=item.view.mean_dim, keepdim=True) for item, o in zip(pending, orthogonal)]
        self._sum_over_shards(pending, sums, [item.view.mean_dim for item in pending])
        normalized = []
        for item, o, total in zip(pending, orthogonal, sums):
            moment2 = self.state[item.param]["moment2_buffer"]
            count = item.view.stored_shape[item.view.mean_dim]
            moment2.lerp_((total / count).to(moment2.dtype), 1 - item.group["beta2"])
            normalized.append(o * moment2.clamp_min(item.group["eps"]).rsqrt())
        # 2. Keep the Frobenius norm of O: squared norms of the whole matrices.
        squares = [torch.stack([o.float().square().sum(), n.float().square().sum()])
                   for o, n in zip(orthogonal, normalized)]
        self._sum_over_shards(pending, squares)
        return [n * (sq[0].sqrt() / sq[1].sqrt().clamp_min(item.group["eps"])).to(n.dtype)
                for item, n, sq in zip(pending, normalized, squares)]

    def _namo(self, pending: list[_Pending], orthogonal: list[torch.Tensor]) -> list[torch.Tensor]:
        # ||g||^2 and ||u||^2 of the whole matrices; the scalar moment2 stays equal on all TP ranks.
        squares = [torch.stack([item.grad.float().square().sum(), item.update.float().square().sum()])
                   for item in pending]
        self._sum_over_shards(pending, squares)
        scaled = []
        for item, o, sq in zip(pending, orthogonal, squares):
            moment2 = self.state[item.param]["moment2_buffer"]
            moment2.lerp_(sq[0].to(moment2.dtype), 1 - item.group["beta2"])
            scaled.append(o * (sq[1].sqrt() / (moment2.sqrt() + item.group["eps"])).to(o.dtype))
        return scaled

    def _sum_over_shards(self, pending: list[_Pending], partials: list[torch.Tensor],
                         dims: Optional[list[int]] = None) -> None:
        """Sum each of `partials` (over dimension `dims[i]` of its matrix; None: over all of it)
        in place over the groups that split that dimension: FSDP2's (rows), then TP's."""
        dims = dims or [None] * len(pending)
        # Every rank has the same parameters in the same order, so the lists agree; empty on every
        # rank in blockwise mode or without sharding, and then nothing is communicated.
        all_reduce_sum_coalesced([t for item, t, d in zip(pending, partials, dims) if item.view.split_over_fsdp(d)],
                                 self.fsdp_group)
        all_reduce_sum_coalesced([t for item, t, d in zip(pending, partials, dims) if item.view.split_over_tp(d)],
                                 self.tp_group)


def _refuse_placed(row_shards_of: Optional[Mapping[int, Any]]) -> None:
    """Its second moment's statistics are of rows or columns of the whole matrix, which the placed
    path (ops/placed_matrices.py: torchtitan's tensor parallelism) does not compute."""
    placed = [s for s in (row_shards_of or {}).values() if isinstance(s, PlacedMatrix)]
    if placed:
        raise ValueError(
            f"parameter {placed[0].layout.name!r} is placed {placed[0].placements}; AdaptiveMuon (adaptive_muon) "
            f"steps DTensor parameters placed Shard(0) on a 1-D mesh only (FSDP2 without tensor parallelism). "
            f"Use muon, or tensor_parallel_degree=1.")
