"""Mixture of experts: megatron-core's MoELayer on CPU as on CUDA, with layout-independent experts.

`gpt_layer_spec` (training/model/layer_specs.py) builds megatron-core's `MoELayer` with `SequentialMLP`
experts. Three subclasses each change one thing:
- `ExpertSeededSequentialMLP`: expert g of a layer is drawn from a generator seeded with one
  number per layer plus g, so the experts are the same at every expert-parallel size.
- `CPUTopKRouter` (CPU only): megatron's router computes its logits and keeps its buffers on
  CUDA; this one does the same where its weight is. Quantile balancing is refused.
- `CPUMoELayer` with `CPUAllGatherTokenDispatcher` (CPU only): gathers and scatters tokens with
  plain torch.distributed calls, gloo included. The alltoall dispatcher is refused on CPU.

`start_step` sets megatron's aux-loss scale to loss scale / micro-batches, as Megatron-LM does.
`finish_router_step` does what megatron-core's `finalize_model_grads` does for routers: it moves
the expert biases from token counts summed over TP x DP, then resets the counts.
docs/trainer.md describes the flags.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_default_pg_collection,
    get_updated_expert_bias,
    router_gating_linear,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

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
    """megatron's TopKRouter with the gating computed on the weight's own device, and the buffers
    of the expert bias and the global aux loss allocated there (megatron allocates them with
    `torch.cuda.current_device()`; its routing reads them wherever they are)."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, is_mtp_layer: bool = False) -> None:
        if "quantile_balancing" in _balancing_types(config):
            raise ValueError("CPUTopKRouter does not support moe_router_load_balancing_type='quantile_balancing' "
                             "(megatron-core allocates its buffers on CUDA and updates them in its own "
                             "finalize_model_grads).")
        super().__init__(config=_without_cuda_buffers(config), pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.config, self.routing_type = config, config.moe_router_load_balancing_type
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self._register_buffers_on(self.weight.device)

    def _register_buffers_on(self, device: torch.device) -> None:
        """The buffers TopKRouter.__init__ registers for these options, as megatron makes them."""
        experts = self.config.num_moe_experts
        if self.enable_expert_bias:
            del self.local_tokens_per_expert, self.expert_bias  # the None TopKRouter set, seeing the option off
            self.register_buffer("local_tokens_per_expert", torch.zeros(experts, device=device), persistent=False)
            self.register_buffer("expert_bias", torch.zeros(experts, device=device))
        if self.get_aux_loss_coeff("global_aux_loss") > 0:
            del self.global_tokens_per_expert, self.ga_steps
            self.register_buffer("global_tokens_per_expert", torch.zeros(experts, device=device), persistent=False)
            self.register_buffer("ga_steps", torch.zeros((), device=device), persistent=False)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, dtype)


def _balancing_types(config: TransformerConfig) -> list[str]:
    types = config.moe_router_load_balancing_type
    return list(types) if isinstance(types, (list, tuple)) else [types]


def _without_cuda_buffers(config: TransformerConfig) -> TransformerConfig:
    """A shallow copy of `config` (no __post_init__ again) without the options whose buffers
    TopKRouter.__init__ would put on CUDA: the router registers them itself afterwards."""
    copy = _copy.copy(config)
    copy.moe_router_enable_expert_bias = False
    types = _balancing_types(config)
    if "global_aux_loss" in types:
        replaced = ["none" if kind == "global_aux_loss" else kind for kind in types]
        copy.moe_router_load_balancing_type = replaced if isinstance(config.moe_router_load_balancing_type, list) else "none"
    return copy


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

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # megatron's dispatcher keeps this forward's routing probabilities, and with them its
        # autograd graph, whose hooks (Megatron-FSDP's) reach the model: kept past the forward, they
        # would keep a dropped model and its process groups alive. Nothing reads them after here.
        self.local_probs = None
        return super().combine_postprocess(hidden_states)


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


def finish_router_step(chunks: list[torch.nn.Module]) -> None:
    """After a step's backward, what megatron-core's `finalize_model_grads` does for the routers:
    the expert biases move (aux-loss-free balancing, `get_updated_expert_bias`: each expert's
    bias up by the update rate if it got fewer tokens than the mean, down if more), then the
    step's token counts (expert bias, global aux loss) start again from zero.

    The counts are summed over the tensor x data-parallel group first (megatron's `tp_dp_cp`),
    which holds every token of the global batch once: sequence-parallel TP ranks count their
    part of each sequence, data-parallel ranks (expert-parallel ones among them) their samples.
    So the update is the one a single process makes over all micro-batches. Every rank of the
    group holds the same layers (one pipeline stage), hence calls the same reductions."""
    from megatron.core import parallel_state

    routers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
    biased = [router for router in routers
              if router.expert_bias is not None and router.training and not router.frozen_expert_bias]
    if biased:
        updated = get_updated_expert_bias(
            torch.stack([router.local_tokens_per_expert for router in biased]),
            torch.stack([router.expert_bias for router in biased]),
            biased[0].config.moe_router_bias_update_rate,
            tp_dp_cp_group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
        for router, bias in zip(biased, updated):
            router.expert_bias.copy_(bias)
    for router in routers:
        if router.local_tokens_per_expert is not None:
            router.local_tokens_per_expert.zero_()
        router.reset_global_aux_loss_tracker()


def step_moe_losses(names: list[str], num_micro_batches: int, num_layers: int, num_moe_layers: int,
                    device: torch.device) -> dict[str, float]:
    """The step's MoE losses `names` as Megatron-LM logs them (e.g. `load_balancing_loss`, 0
    without an aux loss, as there; `z_loss`). megatron's router adds each micro-batch's unscaled
    loss to its layer's slot in a process-wide tracker; Megatron-LM's report sums the slots over
    the pipeline (each stage holds its layers), then over the group the router named (its
    tokens' share: TP), averages over the groups it named and data parallelism, and gives the
    mean over micro-batches and MoE layers. The same here, with sums divided by the group size
    where megatron averages (gloo has no ReduceOp.AVG). Every rank calls it after the step
    (before the next `start_step`)."""
    from megatron.core import parallel_state

    tracker = get_moe_metrics_tracker()
    losses = {}
    for name in names:
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
        losses[name] = values.sum().item() / (num_micro_batches * num_moe_layers)
    return losses
