"""The built-in entries: adam and sgd, and our decisions per emerging_optimizers name.

'muon' and 'adaptive_muon' are megatron_eopt's TensorParallelMuon and TensorParallelAdaptiveMuon
(the same update at every TP degree); mop, polargrad and scion gain tensor parallelism through
`with_tensor_parallelism`. State is created eagerly, so a checkpoint loads into a fresh optimizer
and every rank has the same keys: PSGD-Pro and the oblique optimizers have no step-free
`_init_group`, so their entries create what their first step would (zero moments, identity
Kronecker factors); MuonHyperball also records the weight norm its step stores.
tests/unit/library/test_registry.py checks each against the state of a stepped optimizer. torch's
AdamW/SGD (adam, sgd) keep lazy state; `init_torch_state` creates it for checkpoint loading.
"""

from typing import Any, Callable, Mapping, Optional

import torch

from megatron_eopt.config.newton_schulz import coefficients_and_steps
from megatron_eopt.registry.entries import EmergingOptimizerEntry
from megatron_eopt.registry.kwargs import init_state_step_free


def build_adam(param_groups: list[dict], config: Any) -> torch.optim.Optimizer:
    adam_class = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    return adam_class(
        param_groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


def build_sgd(param_groups: list[dict], config: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        param_groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay
    )


def _adam_style_kwargs(config: Any) -> dict[str, Any]:
    return {"betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_eps}


def _lion_kwargs(config: Any) -> dict[str, Any]:
    return {"betas": (config.lion_beta1, config.lion_beta2)}


# Eager state for classes without a step-free `_init_group`: the state their first step creates.
def _init_psgd_state(optimizer: torch.optim.Optimizer) -> None:
    from emerging_optimizers.psgd import psgd

    for param, state in _params_without_state(optimizer):
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param)
        state["Q"], state["L"] = psgd._init_psgd_kron_states(param, precond_init_scale=optimizer.precond_init_scale)


def _init_muon_hyperball_state(optimizer: torch.optim.Optimizer) -> None:
    # 'hyperball_R' is the weight norm each step records before its update; recorded now too, so
    # a fresh optimizer has the keys a stepped one has.
    init_state_step_free(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            radius = optimizer.hyperball_radius
            optimizer.state[param].setdefault("hyperball_R", radius if radius is not None else param.norm().item())


def _init_oblique_sgd_state(optimizer: torch.optim.Optimizer) -> None:
    for param, state in _params_without_state(optimizer):
        state["momentum_buffer"] = torch.zeros_like(param)


def _init_oblique_adam_state(optimizer: torch.optim.Optimizer) -> None:
    for param, state in _params_without_state(optimizer):
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)


def init_torch_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero state for torch's Adam/AdamW/SGD, which create it only at their first step.

    Loading a sharded checkpoint needs the state's tensors to exist as targets; other classes
    (the emerging optimizers) create theirs at construction (`init_state_fn`).
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state = {"step": torch.zeros((), dtype=torch.float32),
                         "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param)
                optimizer.state[param] = state
            elif isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
                optimizer.state[param] = {"momentum_buffer": torch.zeros_like(param)}


def _params_without_state(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [(p, optimizer.state[p]) for p in params if not optimizer.state[p]]



def _muon_kwargs(config: Any) -> dict[str, Any]:
    """`muon_match_adamw_rms` multiplies the extra scale by 0.2 (Moonlight's AdamW-RMS rule); the
    AOL preconditioner brings Turbo-Muon's coefficients and steps (config/newton_schulz.py)."""
    from megatron_eopt.optimizers.muon.tensor_parallel_muon import ADAMW_RMS_MATCHING_EXTRA_SCALE

    factor = ADAMW_RMS_MATCHING_EXTRA_SCALE if getattr(config, "muon_match_adamw_rms", False) else 1.0
    kwargs: dict[str, Any] = {"extra_scale_factor": config.muon_extra_scale_factor * factor}
    coefficient_type, steps = coefficients_and_steps(config)
    for argument, value, field_value in (("coefficient_type", coefficient_type, config.muon_coefficient_type),
                                         ("num_ns_steps", steps, config.muon_num_ns_steps)):
        if value != field_value:  # Turbo-Muon's in place of megatron-core's default
            kwargs[argument] = value
    return kwargs


def _muon_entry(optimizer_cls: type) -> EmergingOptimizerEntry:
    from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

    return EmergingOptimizerEntry(
        TensorParallelMuon, routing="hidden_matrices", config_prefixes=("muon",),
        config_to_kwargs=_muon_kwargs,
        description=f"megatron_eopt TensorParallelMuon ({optimizer_cls.__name__} over TP shards)",
    )


def _adaptive_muon_entry(optimizer_cls: type) -> EmergingOptimizerEntry:
    from megatron_eopt.optimizers.muon.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon

    return EmergingOptimizerEntry(
        TensorParallelAdaptiveMuon, routing="hidden_matrices", config_prefixes=("muon",),
        config_to_kwargs=_muon_kwargs,
        description=f"megatron_eopt TensorParallelAdaptiveMuon ({optimizer_cls.__name__} over TP shards)",
    )


_SINKHORN_REQUIREMENT = (
    "sinkhorn_muon steps only non-negative, Sinkhorn-normalized matrices (rows summing to "
    "max(1, n/m), columns to max(1, m/n)): initialise such parameters with emerging_optimizers' "
    "SinkhornMapper, and tag every other 2-D parameter use_muon=False so that the scalar optimizer "
    "steps it. A normally initialised model (e.g. a GPT) does not fit; use 'muon' there."
)


def _sinkhorn_param_problem(param: torch.Tensor, kwargs: Mapping[str, Any]) -> Optional[str]:
    """SinkhornMuon's precondition (its constructor checks it, without naming the parameter).

    It keeps each matrix Sinkhorn-normalized (non-negative; rows sum to max(1, n/m), columns
    to max(1, m/n)), so it suits matrices made that way at initialisation (e.g. mixing
    matrices initialised with emerging_optimizers.utils.sinkhorn_mapper.SinkhornMapper), not
    normally initialised weights.
    """
    if param.dim() != 2:
        return None  # the 2-D check names it separately
    with torch.no_grad():
        rows, cols = param.shape
        minimum = param.min().item()
        if minimum < 0:
            return f"it has negative entries (min {minimum:.4g}). {_SINKHORN_REQUIREMENT}"
        tolerance = kwargs.get("doubly_stochastic_tolerance", 0.1)
        row_error = (param.sum(dim=1) - max(1.0, cols / rows)).abs().max().item()
        col_error = (param.sum(dim=0) - max(1.0, rows / cols)).abs().max().item()
    if max(row_error, col_error) > tolerance:
        return (
            f"its row/column sums deviate from the Sinkhorn targets by {max(row_error, col_error):.4g} "
            f"(tolerance {tolerance}). {_SINKHORN_REQUIREMENT}"
        )
    return None


def _whole_matrix_entry(optimizer_cls: type) -> EmergingOptimizerEntry:
    """An orthogonalized optimizer whose only whole-matrix step is `orthogonalize`, made TP-aware."""
    from megatron_eopt.optimizers.tensor_parallel_whole_matrix import with_tensor_parallelism

    return EmergingOptimizerEntry(
        with_tensor_parallelism(optimizer_cls), qkv_split=False,
        description=f"emerging_optimizers {optimizer_cls.__name__} over TP shards or FSDP2 row shards "
                    f"(whole matrix gathered)",
    )


def _entry_maker(**settings: Any) -> Callable[[type], EmergingOptimizerEntry]:
    return lambda optimizer_cls: EmergingOptimizerEntry(optimizer_cls, **settings)


# Muon subclasses read the muon_* fields too; the other orthogonalized optimizers (mop,
# polargrad, scion, spel) keep their own defaults (mop's nuclear-norm scale, for one) apart from
# lr, weight decay and the Newton-Schulz fields set in the config (registry/kwargs.py). mop, polargrad and scion gain tensor parallelism and FSDP2 (their update
# is a function of the whole momentum matrix only); spel projects the weights after each update, so
# it has none. REKLS is a SOAP variant: soap_* fields apply.
CURATED: dict[str, Callable[[type], EmergingOptimizerEntry]] = {
    "muon": _muon_entry,
    "adaptive_muon": _adaptive_muon_entry,
    "mop": _whole_matrix_entry,
    "polargrad": _whole_matrix_entry,
    "scion": _whole_matrix_entry,
    "muon_hyperball": _entry_maker(
        routing="hidden_matrices", config_prefixes=("muon",), init_state_fn=_init_muon_hyperball_state
    ),
    "sinkhorn_muon": _entry_maker(
        routing="hidden_matrices", config_prefixes=("muon",), param_check=_sinkhorn_param_problem
    ),
    "soap": _entry_maker(routing="hidden_matrices", config_to_kwargs=_adam_style_kwargs),
    "rekls": _entry_maker(routing="hidden_matrices", config_to_kwargs=_adam_style_kwargs, config_prefixes=("soap",)),
    "psgd_pro": _entry_maker(routing="hidden_matrices", init_state_fn=_init_psgd_state),
    "oblique_sgd": _entry_maker(routing="hidden_matrices", init_state_fn=_init_oblique_sgd_state),
    "oblique_adam": _entry_maker(
        routing="hidden_matrices", init_state_fn=_init_oblique_adam_state, config_to_kwargs=_adam_style_kwargs
    ),
    "lion": _entry_maker(routing="all", config_to_kwargs=_lion_kwargs),
    "laprop": _entry_maker(routing="all", config_to_kwargs=_adam_style_kwargs),
}


def emerging_entry(name: str, optimizer_cls: type) -> EmergingOptimizerEntry:
    """Our entry for emerging_optimizers' optimizer `name`: curated, else default settings."""
    make = CURATED.get(name)
    if make is not None:
        return make(optimizer_cls)
    return EmergingOptimizerEntry(optimizer_cls, description=f"emerging_optimizers {optimizer_cls.__name__}")
