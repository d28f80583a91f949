"""TensorParallelMuon: emerging_optimizers' Muon for tensor-parallel shards and fused weights.

Update of each 2-D parameter p with gradient g, momentum beta, lr, weight decay wd:
    p <- p * (1 - lr * wd)                                  (decoupled weight decay)
    m <- beta * m + (1 - beta) * g                          (EMA momentum)
    u <- lerp(g, m, beta) if nesterov else m
    O <- for each block B of u (q/k/v of linear_qkv, gate/up of a gated linear_fc1, else u):
         NewtonSchulz(B) * scale(global shape of B) * extra_scale_factor
    p <- p - lr * O
scale: spectral sqrt(max(m, n)), shape_scaling sqrt(max(1, m/n)), unit_rms_norm sqrt(m/n), from
the global block shape except in tp_mode='blockwise'. How the shards of a block meet is
`tp_mode` (ops/newton_schulz.py), which also batches equal-shape blocks. With FSDP2
(`fsdp_shards`) momentum stays a row shard and each matrix's Newton-Schulz runs once, on its
owner (ops/row_shards.py). docs/tp-muon.md describes the modes.
"""

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.muon import Muon

from megatron_eopt.ops.gram_newton_schulz_package import package_for
from megatron_eopt.ops.muon_cost import HardwareProfile
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.ops.row_shards import RowShards
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.megatron_core_args import IsQkvFn, weight_decay_method_of
from megatron_eopt.optimizers.muon.shards import ShardedMatrices, check_muon_arguments


def backend_use_syrk(scaled_orthogonalize_fn: Callable) -> bool:
    """Whether emerging_optimizers' `Muon.__init__` kept `use_syrk` on, given the Muon's
    `scaled_orthogonalize_fn`.

    It turns a requested SYRK kernel off where it is not supported (no Triton >= 3.4, or a GPU
    it has not validated; it logs why) and keeps that decision only in the closure of its
    orthogonalize function, so it is read from there. Fails loudly if that ever moves.
    """
    decided = inspect.getclosurevars(scaled_orthogonalize_fn).nonlocals
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
    return backend_use_syrk(probe.scaled_orthogonalize_fn)


# The Muon scale that matches AdamW's update RMS (Moonlight): 0.2 * sqrt(max(m, n)).
ADAMW_RMS_MATCHING_EXTRA_SCALE = 0.2


class TensorParallelMuon(ShardedMatrices, Muon):
    """Muon whose parameters may be TP shards (see the module docstring for the update).

    The arguments up to `tp_mode` are megatron-core's TensorParallelMuon's, in its order and with
    its defaults (megatron_core_args.py says how `pg_collection`, `split_qkv`,
    `is_qkv_fn`, `qkv_split_shapes` and `use_decoupled_weight_decay` act). Keyword-only, ours:
        weight_decay_method: emerging_optimizers' name ('decoupled', 'l2', ...); None: from
            use_decoupled_weight_decay.
        tp_mode: 'blockwise', 'duplicated', 'distributed', 'sharded' or 'auto' (per matrix, the
            exact mode that ops/muon_cost.py predicts cheapest; `self.tp_modes` says which).
        tp_hardware_profile: what 'auto' predicts with: a HardwareProfile, a name ('h100', 'cpu'),
            or None: rates calibrated on the parameters' device over `tp_group` (cached).
        expert_tp_mode: the mode of routed experts' matrices ('.experts.' in the name); None: tp_mode.
        tp_group: the tensor-parallel group of these parameters (None: size 1).
        layouts: fqn -> MatrixLayout for parameters that are shards or fused; param groups
            name their parameters in 'param_fqns'. A parameter without a layout is a whole,
            unfused matrix.
        fsdp_group: the data-parallel group over which FSDP2 splits the matrices by rows.
        fsdp_shards: fqn -> RowShards (layout of the matrix FSDP2 splits, rows per rank, owner)
            of every parameter, each a row shard; given, `layouts` must be empty (a `tp_group`
            makes each matrix this TP rank's shard, whose layout says so).
    gram_newton_schulz: Gram Newton-Schulz on the blocks where it costs fewer FLOPs
        (`self.newton_schulz_paths` says which; ops/gram_newton_schulz.py).
    gram_newton_schulz_package: those blocks, where whole on this rank, run through the
        gram-newton-schulz package (float16; needs fp32_matmul_prec='medium';
        ops/gram_newton_schulz_package.py).
    aol_preconditioner: Turbo-Muon: every Newton-Schulz starts from the AOL-preconditioned matrix
        (ops/aol.py); Turbo-Muon runs it with quintic x 4 (OptimizerConfig's default then).
    `use_syrk` is a request: `self.use_syrk` is what emerging_optimizers' Muon decided for this
    machine (off without Triton >= 3.4 or on an unvalidated GPU), and what the step uses.
    """

    # MoE experts stored as one N-D tensor, by their layout's batch (docs/fsdp2.md).
    orthogonalizes_matrix_batches = True

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
        # Checked here, before the backend checks them with its own messages.
        settings = NewtonSchulzSettings(num_ns_steps, coefficient_type, scale_mode, extra_scale_factor,
                                        use_syrk=use_syrk, gram=gram_newton_schulz, aol=aol_preconditioner)
        package = package_for(gram_newton_schulz, gram_newton_schulz_package, fp32_matmul_prec, coefficient_type,
                              num_ns_steps)
        super().__init__(
            params, lr, momentum, weight_decay, nesterov=nesterov, weight_decay_method=weight_decay_method,
            fp32_matmul_prec=fp32_matmul_prec, coefficient_type=coefficient_type, num_ns_steps=num_ns_steps,
            scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, use_syrk=use_syrk,
        )
        # The backend may have turned use_syrk off (unsupported here): follow its decision.
        self.use_syrk = backend_use_syrk(self.scaled_orthogonalize_fn) if use_syrk else False
        # Scaled: the Muon scale is applied with Newton-Schulz (by `orthogonalize`).
        self.settings = dataclasses.replace(settings, use_syrk=self.use_syrk, package=package)
        tp_group, layouts = self._megatron_core_shards(pg_collection, split_qkv, is_qkv_fn, qkv_split_shapes,
                                                       tp_group, layouts)
        self._set_up_shards(tp_mode, tp_group, layouts, fsdp_group, fsdp_shards, tp_hardware_profile, expert_tp_mode)
