"""Mixture of experts: megatron-core's MoELayer on CPU as on CUDA, layout-independent experts, flags.

The model (used by scripts/gpt_model.py's `gpt_layer_spec`): megatron-core's `MoELayer` with
`SequentialMLP` experts and its allgather token dispatcher. Three substitutions, each a subclass
that changes one thing:

- `ExpertSeededSequentialMLP` (CPU and CUDA, with CPU initialisation): megatron draws each
  rank's local experts one after another from torch's default generator, so at EP=2 rank 1's
  experts 2 and 3 would get the numbers EP=1 gives experts 0 and 1, and every later layer would
  be shifted too. Here each MoE layer takes one number from the generator, and expert g (global
  index) is drawn from a generator seeded with that number + g, outside the main stream: the
  same experts, and the same dense weights after them, at every expert-parallel size.
- CPU only, `CPUTopKRouter`: megatron's `TopKRouter.gating` moves its weight to
  `torch.cuda.current_device()`; this one computes the same logits where the weight is.
  Router options that allocate CUDA buffers (expert bias, global aux loss, quantile
  balancing) are refused.
- CPU only, `CPUMoELayer` with `CPUAllGatherTokenDispatcher`: megatron's allgather dispatcher
  gathers tokens over the expert x tensor-parallel group into a CUDA buffer; this one gathers
  (and reduce-scatters back) with plain torch.distributed calls, gloo included. The alltoall
  dispatcher creates a `torch.cuda.Stream` and is refused on CPU with a one-line error.

Tensor parallelism (`--tensor-model-parallel-size` > 1) needs `--sequence-parallel`, as
megatron-core's MoELayer does: the router sees this rank's part of the sequence, and the
dispatcher gathers the tokens of the whole expert-TP x EP group (megatron's `tp_ep` group; the
expert tensor-parallel size is the TP size, megatron's default). Each expert's linears are split
over the expert-TP group (`expt_tp`) without communication of their own (megatron's
`explicit_expert_comm`): each rank's output is a partial sum, which the dispatcher's
reduce-scatter adds up with the other experts' outputs. The router's weight is replicated over
TP and tagged `sequence_parallel` by megatron, so the trainer sums its gradient over TP with
the layer norms' (scripts/sequence_parallel.py); the aux loss of each rank covers its tokens
(megatron reduces the token counts over TP), and those gradients add up in the same sum.

The aux loss (`--moe-aux-loss-coeff`): megatron's router attaches it to the routing
probabilities with `MoEAuxLossAutoScaler`, whose backward multiplies its gradient by a
process-wide scale. Megatron-LM sets that scale to loss scale / micro-batches each step, as this
trainer scales the language-model loss: `start_step` does the same.

The trainer's flags (`add_moe_args`, `check_moe_flags`) keep Megatron-LM's names and defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_default_pg_collection,
    router_gating_linear,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

from arguments import refuse_flags_without

DISPATCHERS = ("allgather", "alltoall")  # megatron-core's "flex" needs DeepEP

# ------------------------------------------------------------------------------------------------
# Model modules
# ------------------------------------------------------------------------------------------------


class ExpertSeededSequentialMLP(SequentialMLP):
    """megatron's SequentialMLP whose expert g is initialised from its own seed (module docstring).

    With GPU initialisation (`use_cpu_initialization=False`) megatron's expert-parallel CUDA RNG
    tracker decides, and this class builds exactly what SequentialMLP builds.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: MLPSubmodules,
                 pg_collection: Any = None, name: Optional[str] = None) -> None:
        if not config.use_cpu_initialization:
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
            return
        layer_seed = int(torch.randint(2**62, ()))  # one draw per layer, whatever the EP size
        super().__init__(0, config, submodules, pg_collection=pg_collection, name=name)
        first = get_pg_rank(pg_collection.ep) * num_local_experts  # as MoELayer's local_expert_indices
        for local in range(num_local_experts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(layer_seed + first + local)
                self.local_experts.append(MLP(
                    self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size, is_expert=True,
                    tp_group=pg_collection.expt_tp,
                    name=None if name is None else f"{name}.local_experts.{local}"))
        self.num_local_experts = num_local_experts


class CPUTopKRouter(TopKRouter):
    """megatron's TopKRouter with the gating computed on the weight's own device."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, is_mtp_layer: bool = False) -> None:
        _refuse_cuda_router_options(config)
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, dtype)


def _refuse_cuda_router_options(config: TransformerConfig) -> None:
    """TopKRouter.__init__ allocates these options' buffers with torch.cuda.current_device()."""
    types = config.moe_router_load_balancing_type
    types = set(types) if isinstance(types, list) else {types}
    refused = {"moe_router_enable_expert_bias=True": config.moe_router_enable_expert_bias,
               "moe_router_load_balancing_type='global_aux_loss'": "global_aux_loss" in types,
               "moe_router_load_balancing_type='quantile_balancing'": "quantile_balancing" in types}
    for option, used in refused.items():
        if used:
            raise ValueError(f"CPUTopKRouter does not support {option} (megatron-core allocates its buffers on CUDA).")


class CPUMoELayer(MoELayer):
    """megatron's MoELayer with the CPU-capable allgather dispatcher."""

    def __init__(self, config: TransformerConfig, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, pg_collection: Any = None, is_mtp_layer: bool = False,
                 name: Optional[str] = None) -> None:
        if config.moe_token_dispatcher_type != "allgather":
            raise ValueError(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} needs CUDA "
                             f"(megatron-core's dispatcher creates CUDA streams); use 'allgather' on CPU.")
        pg_collection = get_default_pg_collection() if pg_collection is None else pg_collection
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        self.token_dispatcher = CPUAllGatherTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection)


class CPUAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher with its two collectives in plain torch.distributed calls.

    Every rank of the expert x tensor-parallel group gets every rank's tokens, routing map and
    probabilities; each computes its local experts' outputs for all of them (with expert TP: its
    shard's partial sums), and the sum over the group, cut back to each rank's own tokens, is the
    layer's output (megatron's reduce-scatter). Backward, the gathered rows' gradients, partial
    on each rank, are summed onto the rank that owns the rows.
    """

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.tp_ep_group.size() > 1:
            with torch.no_grad():
                self.routing_map = _all_gather_rows(self.routing_map, self.tp_ep_group)
            probs = _GatherRows.apply(probs, self.tp_ep_group)
            hidden_states = _GatherRows.apply(hidden_states, self.tp_ep_group)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tp_ep_group.size() > 1:
            dtype = hidden_states.dtype  # summed in the probabilities' dtype, as megatron does
            hidden_states = _ReduceScatterRows.apply(hidden_states.to(self.local_probs.dtype), self.tp_ep_group)
            hidden_states = hidden_states.to(dtype)
        return hidden_states


def _all_gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `tensor` stacked along dim 0 in group-rank order (bool through uint8: gloo)."""
    source = tensor.contiguous().to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
    parts = [torch.empty_like(source) for _ in range(group.size())]
    dist.all_gather(parts, source, group=group)
    return torch.cat(parts).to(tensor.dtype)


def _sum_own_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group of `tensor`, this rank's 1/size of the rows. An all-reduce and a
    slice, not a reduce-scatter, which gloo does not have."""
    total = tensor.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(group.size())[group.rank()].contiguous()


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather_rows(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank's rows were used by every rank: their gradients add up on the owner.
        return _sum_own_rows(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _sum_own_rows(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad, ctx.group), None


def moe_layer_builder(builder: Any, use_cuda: bool) -> functools.partial:
    """megatron's MoE layer builder (a partial of MoELayer) with the substitutions above."""
    if not isinstance(builder, functools.partial) or not isinstance(builder.keywords.get("submodules"), MoESubmodules):
        raise TypeError(f"expected megatron-core's MoE layer builder, a functools.partial of MoELayer with "
                        f"MoESubmodules; got {builder!r}")
    submodules: MoESubmodules = builder.keywords["submodules"]
    experts = submodules.experts
    if isinstance(experts, functools.partial) and experts.func is SequentialMLP:
        experts = functools.partial(ExpertSeededSequentialMLP, *experts.args, **experts.keywords)
    if use_cuda:  # megatron-core's own layer, router and dispatcher
        return functools.partial(builder.func, *builder.args,
                                 **{**builder.keywords, "submodules": _replace(submodules, experts=experts)})
    return functools.partial(CPUMoELayer, *builder.args, **{
        **builder.keywords, "submodules": _replace(submodules, experts=experts, router=CPUTopKRouter)})


def _replace(submodules: MoESubmodules, **changes: Any) -> MoESubmodules:
    return dataclasses.replace(submodules, **changes)


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def start_step(loss_scale: torch.Tensor, num_micro_batches: int) -> None:
    """Before a step's first forward: the aux-loss gradient scale and a fresh metrics tracker.

    Each micro-batch's language-model loss is multiplied by loss_scale / micro-batches, so the
    aux loss is too (Megatron-LM's `set_loss_scale(loss_scale / num_microbatches)`). The scale is
    a process-wide tensor that megatron updates in place: it is set anew here, on the loss
    scale's device. megatron's router records aux-loss values in a process-wide tracker that
    Megatron-LM reports and clears every step (`step_moe_losses` reads it); a tracker left from
    an earlier model (another layer count) would fail, so it is made anew.
    """
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MoEAuxLossAutoScaler.set_loss_scale((loss_scale.detach().float() / num_micro_batches).reshape(()))
    destroy_moe_metrics_tracker()


# What Megatron-LM logs for the load-balancing type this trainer offers ("aux_loss").
LOGGED_MOE_LOSSES = ("load_balancing_loss",)


def step_moe_losses(num_micro_batches: int, num_layers: int, device: torch.device) -> dict[str, float]:
    """The step's MoE losses as Megatron-LM logs them (`load_balancing_loss`; 0 without an aux
    loss, as there). megatron's router adds each micro-batch's unscaled load-balancing loss to its
    layer's slot in a process-wide tracker; Megatron-LM's report sums the slots over the pipeline
    (each stage holds its layers), then over the group the router named (its tokens' share: TP),
    averages over data parallelism, and gives the mean over micro-batches and layers. The same
    here, with sums divided by the group size where megatron averages (gloo has no
    ReduceOp.AVG). Every rank calls it after the step (before the next `start_step`)."""
    from megatron.core import parallel_state

    tracker = get_moe_metrics_tracker()
    losses = {}
    for name in LOGGED_MOE_LOSSES:
        tracker.ensure_initialized(name, num_layers, device=device)  # a stage whose layers recorded nothing
        entry = tracker.metrics[name]
        values = entry.values.clone()
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        if entry.reduce_group is not None:
            dist.all_reduce(values, group=entry.reduce_group)
        averaged_over = [entry.avg_group] if entry.avg_group is not None else []
        if entry.needs_dp_avg:
            averaged_over.append(parallel_state.get_data_parallel_group())
        for group in averaged_over:
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)
        losses[name] = values.sum().item() / (num_micro_batches * num_layers)
    return losses


# ------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    moe = parser.add_argument_group(title="moe")
    moe.add_argument("--num-experts", type=int, default=None,
                     help="experts per MoE layer (every layer; megatron-core's MoELayer, SequentialMLP "
                          "experts); default: dense MLPs")
    moe.add_argument("--moe-router-topk", type=int, default=None, help="experts per token (default 2)")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1,
                     help="ranks the experts of a layer are split over, out of the data-parallel ranks")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                     help="weight of the load-balancing aux loss (default 0)")
    moe.add_argument("--moe-token-dispatcher-type", default=None, choices=DISPATCHERS,
                     help="default allgather; alltoall needs CUDA")
    moe.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                     help="only the tensor-parallel size here (Megatron-LM's default): the experts' "
                          "linears are split over the TP ranks like the dense ones")
    moe.add_argument("--moe-router-load-balancing-type", nargs="+", default=None,
                     help="only aux_loss here (Megatron-LM's default: GShard's load-balancing loss, weighted "
                          "by --moe-aux-loss-coeff)")


def check_moe_flags(args: argparse.Namespace, tp: int, dp: int, use_cuda: bool) -> int:
    """Check the MoE flags against each other and the layout; fills their defaults. Returns EP."""
    if args.num_experts == 0:  # Megatron-LM's spelling of a dense model
        args.num_experts = None
    if args.num_experts is None:
        _refuse_without_experts(args)
    elif args.num_experts < 0:
        raise ValueError(f"--num-experts must be >= 1 (or 0 for dense MLPs); got {args.num_experts}.")
    # Megatron-LM's defaults, filled in only now so that the check above sees what was given.
    args.moe_router_topk = 2 if args.moe_router_topk is None else args.moe_router_topk
    args.moe_aux_loss_coeff = 0.0 if args.moe_aux_loss_coeff is None else args.moe_aux_loss_coeff
    args.moe_token_dispatcher_type = args.moe_token_dispatcher_type or "allgather"
    if args.num_experts is not None:
        _check_expert_flags(args, tp, dp, use_cuda)
    return args.expert_model_parallel_size


def _refuse_without_experts(args: argparse.Namespace) -> None:
    given = [flag for flag, value in (("--moe-router-topk", args.moe_router_topk),
                                      ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff),
                                      ("--moe-router-load-balancing-type", args.moe_router_load_balancing_type),
                                      ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type))
             if value is not None]
    if args.expert_model_parallel_size != 1:
        given.append(f"--expert-model-parallel-size {args.expert_model_parallel_size}")
    if args.expert_tensor_parallel_size is not None:
        given.append(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}")
    refuse_flags_without(given, "--num-experts (a mixture-of-experts model)")


def _check_expert_flags(args: argparse.Namespace, tp: int, dp: int, use_cuda: bool) -> None:
    experts, ep, topk = args.num_experts, args.expert_model_parallel_size, args.moe_router_topk
    if ep < 1 or experts % ep or dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} must be >= 1 and divide --num-experts {experts} "
                         f"and the data-parallel size {dp}.")
    if not 2 <= topk <= experts:
        raise ValueError(f"--moe-router-topk must be in [2, --num-experts {experts}]; got {topk} (top-1 needs "
                         f"Megatron-LM's --moe-router-pre-softmax, which this trainer does not have).")
    if args.expert_tensor_parallel_size not in (None, tp):
        raise ValueError(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: only the tensor-parallel "
                         f"size ({tp}) is offered by this trainer (experts split over TP like the dense layers).")
    balancing = args.moe_router_load_balancing_type or ["aux_loss"]
    if balancing != ["aux_loss"]:
        raise ValueError(f"--moe-router-load-balancing-type {' '.join(balancing)}: only aux_loss is offered by this "
                         f"trainer (the load-balancing loss weighted by --moe-aux-loss-coeff).")
    coeff = args.moe_aux_loss_coeff
    if not (math.isfinite(coeff) and coeff >= 0.0):
        raise ValueError(f"--moe-aux-loss-coeff must be a finite number >= 0; got {coeff}.")
    if args.moe_token_dispatcher_type == "alltoall" and not use_cuda:
        raise ValueError("--moe-token-dispatcher-type alltoall needs CUDA (megatron-core's all-to-all "
                         "dispatcher creates CUDA streams); use allgather on CPU.")
    if tp > 1 and not args.sequence_parallel:
        raise ValueError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                         f"(megatron-core's MoELayer refuses tensor parallelism without it).")
    if args.use_torch_fsdp2:
        raise ValueError("--use-torch-fsdp2 does not support --num-experts yet.")
    if not args.disable_bias_linear and not use_cuda:
        raise ValueError("--num-experts on CPU needs --disable-bias-linear: megatron-core's expert MLP adds its "
                         "bias in place to the output of its row-parallel linear, which autograd refuses there.")


def moe_settings(args: argparse.Namespace) -> dict[str, Any]:
    """GPTModelSettings fields of the checked MoE flags."""
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_token_dispatcher_type=args.moe_token_dispatcher_type)


def describe_moe(args: argparse.Namespace) -> str:
    """One line for the run's log."""
    ep = args.expert_model_parallel_size
    return (f"MoE: {args.num_experts} experts per layer, top-{args.moe_router_topk}, EP {ep} "
            f"({args.num_experts // ep} experts per rank), {args.moe_token_dispatcher_type} dispatcher, "
            f"aux loss coeff {args.moe_aux_loss_coeff:g}")
