"""TensorParallelMuon: emerging_optimizers' Muon for tensor-parallel shards and fused weights.

Update of each 2-D parameter p with gradient g, momentum beta, lr, weight decay wd:
    p <- p * (1 - lr * wd)                                  (decoupled weight decay)
    m <- beta * m + (1 - beta) * g                          (EMA momentum)
    u <- lerp(g, m, beta) if nesterov else m
    O <- for each block B of u (q/k/v of linear_qkv, gate/up of a gated linear_fc1, else u):
         NewtonSchulz(B) * scale(global shape of B) * extra_scale_factor
    p <- p - lr * O
scale: spectral sqrt(max(m, n)), shape_scaling sqrt(max(1, m/n)), unit_rms_norm sqrt(m/n),
always from the global (unsharded) block shape except in tp_mode='blockwise'. How the shards
of a block meet is `tp_mode` (see ops/newton_schulz.py), which also batches equal-shape
blocks into one Newton-Schulz call. On CPU, run with fp32_matmul_prec='highest': bf16 matrix
products are emulated on CPUs without bf16 instructions (about 50x slower than fp32 on the
AVX2 machine of README's Performance section).

torch FSDP2 (`fsdp_shards`): the parameters are this rank's row shards (Shard(0)) of whole
matrices over `fsdp_group` (of this TP rank's shards of them with a `tp_group` too); momentum
stays a shard, and each matrix's Newton-Schulz runs once, on its owner rank (with TP: on one
owner of its TP group, or spread over it in tp_mode 'distributed'; ops/row_shards.py).
"""

import dataclasses
import inspect
import typing
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from emerging_optimizers import mixin as eo_mixin
from emerging_optimizers import utils as eo_utils
from emerging_optimizers.orthogonalized_optimizers.muon import Muon

from megatron_eopt.ops.newton_schulz import TP_MODES, NewtonSchulzSettings, orthogonalize_updates
from megatron_eopt.ops.row_shards import RowShards, orthogonalize_row_shards
from megatron_eopt.ops.splits import MatrixLayout

def check_muon_arguments(tp_mode: str, lr: float, momentum: float, weight_decay: float,
                         weight_decay_method: str, fp32_matmul_prec: str) -> None:
    """Argument checks shared by the tensor-parallel Muon optimizers."""
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp_mode must be one of {', '.join(map(repr, TP_MODES))}; got {tp_mode!r}.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1); got {momentum}.")
    if lr < 0.0 or weight_decay < 0.0:
        raise ValueError(f"lr and weight_decay must be >= 0; got lr={lr}, weight_decay={weight_decay}.")
    # emerging_optimizers only looks at these in the first step; check them now.
    for name, value, valid in (("weight_decay_method", weight_decay_method, typing.get_args(eo_mixin.WeightDecayT)),
                               ("fp32_matmul_prec", fp32_matmul_prec, typing.get_args(eo_utils.FP32MatmulPrecT))):
        if value not in valid:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, valid))}; got {value!r}.")


def layouts_by_param(param_groups: list[dict], layouts: Mapping[str, MatrixLayout]) -> dict[int, MatrixLayout]:
    """One layout per parameter (by id), checked at construction rather than in the first step.

    Param groups name their parameters in 'param_fqns'; a parameter without a layout is a
    whole, unfused matrix.
    """
    by_param = {}
    for group in param_groups:
        names = group.get("param_fqns") or [f"<param {i}>" for i in range(len(group["params"]))]
        for param, name in zip(group["params"], names):
            if param.dim() != 2:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(param.shape)}; Muon updates 2-D matrices "
                    f"only. Route it to the scalar optimizer (muon_scalar_optimizer) instead."
                )
            layout = layouts.get(name) or MatrixLayout(name=name, local_shape=tuple(param.shape))
            if layout.local_shape != tuple(param.shape):
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
    rank = 0 if fsdp_group is None else dist.get_rank(fsdp_group)
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
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


def _check_row_shard(name: str, param: torch.Tensor, shards: RowShards, rank: int, tp_size: int) -> None:
    expected = (shards.rows_by_rank[rank], shards.layout.local_shape[1])
    if tuple(param.shape) != expected:
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


_WARNED_ONCE: set[str] = set()  # warnings this process has given


def orthogonalize_sharded(optimizer: Any, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """The orthogonalized `updates` of `params` over the optimizer's shards: FSDP2 row shards
    (each matrix to its owner and back, TP shards of it in its tp_mode with TP as well) or TP
    shards (its tp_mode). TensorParallelMuon's and
    TensorParallelAdaptiveMuon's `_orthogonalize_all`."""
    if optimizer._row_shards_of is not None:
        shards = [optimizer._row_shards_of[id(p)] for p in params]
        return orthogonalize_row_shards(updates, shards, optimizer.fsdp_group, optimizer.settings,
                                        optimizer.tp_mode, optimizer.tp_group)
    layouts = [optimizer._layout_of[id(p)] for p in params]
    return orthogonalize_updates(updates, layouts, optimizer.tp_mode, optimizer.tp_group, optimizer.settings)


def momentum_updates(optimizer: Any) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """emerging_optimizers' OrthogonalizedOptimizer step up to orthogonalization, for every
    parameter with a gradient: weight decay, the momentum update, and the update to orthogonalize
    (the momentum, or Nesterov's). Returns (group, param, update) in parameter order."""
    pending = []
    for group in optimizer.param_groups:
        optimizer._init_group(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            momentum = optimizer.state[p]["momentum_buffer"]
            optimizer._apply_weight_decay_inplace(p, p.grad, group["lr"], group["weight_decay"])
            momentum.lerp_(p.grad, 1 - group["momentum"])
            update = p.grad.lerp(momentum, group["momentum"]) if optimizer.nesterov else momentum
            pending.append((group, p, update))
    return pending


def step_orthogonalizing_together(optimizer: Any) -> None:
    """emerging_optimizers' OrthogonalizedOptimizer step, with one `_orthogonalize_all(params,
    updates)` call for all parameters instead of `orthogonalize` per parameter (so that the
    shards move in one exchange); weight decay, momentum and weight update are its own."""
    pending = momentum_updates(optimizer)
    with eo_utils.fp32_matmul_precision(optimizer.fp32_matmul_prec):
        orthogonal = optimizer._orthogonalize_all([p for _, p, _ in pending], [u for _, _, u in pending])
    for (group, p, _), update in zip(pending, orthogonal):
        optimizer.pre_weight_update_fn_inplace(p, update)
        p.add_(update, alpha=-group["lr"])
        optimizer.post_weight_update_fn_inplace(p)


def warn_if_blockwise_splits(tp_mode: str, tp_group: Optional[dist.ProcessGroup],
                             layouts: list[MatrixLayout]) -> None:
    """Warn once per process when tp_mode='blockwise' orthogonalizes tensor-parallel shards.

    Then the update depends on the TP degree. It is megatron-core's default, so a megatron-core
    OptimizerConfig passed as it is brings it along; the value is kept, and this says so.
    """
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    sharded = [layout.name for layout in layouts if layout.partition_dim >= 0]
    if tp_mode != "blockwise" or tp_size == 1 or not sharded or "blockwise" in _WARNED_ONCE:
        return
    _WARNED_ONCE.add("blockwise")
    warnings.warn(
        f"muon_tp_mode='blockwise' orthogonalizes each tensor-parallel shard on its own: "
        f"parameter {sharded[0]!r} is split over {tp_size} TP ranks, so Muon's update depends on "
        f"the TP degree. 'blockwise' is megatron-core's OptimizerConfig default (megatron_eopt's "
        f"is 'duplicated'); set muon_tp_mode='duplicated', 'distributed' or 'sharded' for the "
        f"TP=1 update.",
        UserWarning,
        stacklevel=3,
    )


def backend_use_syrk(optimizer: Muon) -> bool:
    """Whether emerging_optimizers' `Muon.__init__` kept `use_syrk` on for `optimizer`.

    It turns a requested SYRK kernel off where it is not supported (no Triton >= 3.4, or a GPU
    it has not validated; it logs why) and keeps that decision only in the closure of its
    orthogonalize function, so it is read from there. Fails loudly if that ever moves.
    """
    decided = inspect.getclosurevars(optimizer.scaled_orthogonalize_fn).nonlocals
    if not isinstance(decided.get("use_syrk"), bool):
        raise RuntimeError(
            "cannot read emerging_optimizers' Muon use_syrk decision (its orthogonalize function "
            "no longer holds 'use_syrk'); this megatron_eopt needs updating for the installed "
            "emerging_optimizers. Set muon_use_syrk=False meanwhile."
        )
    return decided["use_syrk"]


def muon_use_syrk(requested: bool) -> bool:
    """emerging_optimizers' Muon decision on `use_syrk=requested` on this machine."""
    if not requested:
        return False
    probe = Muon([torch.nn.Parameter(torch.zeros(2, 2))], use_syrk=True)
    return backend_use_syrk(probe)


# The Muon scale that matches AdamW's update RMS (Moonlight): 0.2 * sqrt(max(m, n)).
ADAMW_RMS_MATCHING_EXTRA_SCALE = 0.2


class TensorParallelMuon(Muon):
    """Muon whose parameters may be TP shards (see the module docstring for the update).

    Args beyond emerging_optimizers' Muon:
        tp_mode: 'blockwise', 'duplicated', 'distributed' or 'sharded'.
        tp_group: the tensor-parallel group of these parameters (None: size 1).
        layouts: fqn -> MatrixLayout for parameters that are shards or fused; param groups
            name their parameters in 'param_fqns'. A parameter without a layout is a whole,
            unfused matrix.
        fsdp_group: the data-parallel group over which FSDP2 splits the matrices by rows.
        fsdp_shards: fqn -> RowShards (layout of the matrix FSDP2 splits, rows per rank, owner)
            of every parameter, each a row shard; given, `layouts` must be empty (a `tp_group`
            makes each matrix this TP rank's shard, whose layout says so).
    `use_syrk` is a request: `self.use_syrk` is what emerging_optimizers' Muon decided for this
    machine (off without Triton >= 3.4 or on an unvalidated GPU), and what the step uses.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.01,
        *,
        nesterov: bool = False,
        weight_decay_method: str = "decoupled",
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        use_syrk: bool = False,
        tp_mode: str = "duplicated",
        tp_group: Optional[dist.ProcessGroup] = None,
        layouts: Optional[Mapping[str, MatrixLayout]] = None,
        fsdp_group: Optional[dist.ProcessGroup] = None,
        fsdp_shards: Optional[Mapping[str, RowShards]] = None,
    ) -> None:
        check_muon_arguments(tp_mode, lr, momentum, weight_decay, weight_decay_method, fp32_matmul_prec)
        # Checked here, before the backend checks them with its own messages.
        settings = NewtonSchulzSettings(num_ns_steps, coefficient_type, scale_mode, extra_scale_factor)
        super().__init__(
            params, lr, momentum, weight_decay, nesterov=nesterov, weight_decay_method=weight_decay_method,
            fp32_matmul_prec=fp32_matmul_prec, coefficient_type=coefficient_type, num_ns_steps=num_ns_steps,
            scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, use_syrk=use_syrk,
        )
        # The backend may have turned use_syrk off (unsupported here): follow its decision.
        self.use_syrk = backend_use_syrk(self) if use_syrk else False
        self.settings = dataclasses.replace(settings, use_syrk=self.use_syrk)
        self.tp_mode = tp_mode
        self.tp_group = tp_group
        self._layout_of = layouts_by_param(self.param_groups, dict(layouts or {}))
        self.fsdp_group = fsdp_group
        self._row_shards_of = row_shards_by_param(self.param_groups, fsdp_shards, fsdp_group, tp_group, layouts)
        warn_if_blockwise_splits(tp_mode, tp_group, matrix_layouts_of(self._layout_of, self._row_shards_of))

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The scaled orthogonalized update of one parameter (emerging_optimizers' hook)."""
        return self._orthogonalize_all([p], [grad])[0]

    _orthogonalize_all = orthogonalize_sharded  # scaled: its NewtonSchulzSettings carry the Muon scale

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        """Muon's step with every parameter's orthogonalization done together.

        Together, so that tp_mode='sharded' moves all shards with one exchange; the weight decay,
        momentum and weight update are Muon's own (emerging_optimizers).
        """
        if closure is not None:
            raise ValueError("closure is not supported")
        step_orthogonalizing_together(self)
