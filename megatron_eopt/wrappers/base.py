"""The optimizer contract megatron-core trainers call, and the one step recipe behind it.

`step()` returns `(update_successful, grad_norm, num_zeros_in_grad)`:
1. every child copies its gradients to fp32 main gradients, unscales them and counts inf/NaN,
   then sums [non-finite, norm^2, zeros] over the ranks that hold disjoint parts;
2. inf/NaN anywhere: update the loss scale, return (False, None, None), change nothing else;
3. clip every child's gradients by the global norm (`clip_grad`, 0 = off), a separate group's
   (`grad_norm_group='mtp'`, grad_stats.py) by its own norm, which the global one leaves out;
4. a norm above `grad_norm_skip_threshold` returns (False, norm, zeros) without stepping;
5. every child steps and copies its main parameters back to the model.

With `config.timers` (megatron-core's `Timers`) the phases are timed under megatron-core's names,
with `barrier=config.barrier_with_L1_time`: 'optimizer-copy-to-main-grad' (1),
'optimizer-clip-main-grad' (3), 'optimizer-inner-step' and 'optimizer-copy-main-to-model-params'
(5), and 'params-all-gather' (the layer-wise broadcast).
"""

import contextlib
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from megatron_eopt.runtime.process_groups import group_rank
from megatron_eopt.wrappers.flat_state import match_param_groups
from megatron_eopt.wrappers.grad_stats import (
    NONFINITE,
    SEPARATE_GRAD_NORM_GROUPS,
    SUM_OF_SQUARES,
    ZEROS,
    LocalStats,
    check_grad_norm_group,
    grad_norm_group_of,
    group_index,
    reduced_stats,
    scale_grads,
)

StepResult = tuple[bool, Optional[float], Optional[int]]
# The children's statistics before they are summed -> the statistics to sum (e.g. the layer-wise
# optimizer's norms regrouped as megatron-core's ranks hold them: distributed/layer_wise_norm_order.py).
ArrangeStats = Callable[[list[LocalStats]], list[LocalStats]]


class MegatronOptimizer(ABC):
    """What every optimizer returned by `get_megatron_optimizer` provides."""

    config: Any

    @property
    @abstractmethod
    def param_groups(self) -> list[dict]: ...

    @param_groups.setter
    @abstractmethod
    def param_groups(self, value: list[dict]) -> None: ...

    @property
    @abstractmethod
    def state(self) -> Any: ...

    @abstractmethod
    def step(self) -> StepResult: ...

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """A 1-element tensor: the factor the trainer multiplies the loss by."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale().to(loss.device)

    @abstractmethod
    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        """Refresh main (fp32) parameters from the model after the model was changed."""

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None: ...

    # megatron-core's gradient-norm helpers, with its names and signatures.
    # The norm of each separate gradient-norm group at the last step (e.g. {'mtp': 0.14}).
    grad_norms_by_group: Mapping[str, float] = MappingProxyType({})

    def get_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this optimizer steps (fp32 main copies where it keeps them)."""
        return [p for group in self.param_groups for p in group["params"]]

    # These two need no more of `self` than megatron-core's: `get_parameters()` and, if set,
    # `tp_group` (Megatron-LM's tests borrow them onto an object that has nothing else).
    def get_grads_for_grad_norm(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        """Gradients counted in the main norm (None), or in `grad_norm_group`'s own norm."""
        if grad_norm_group is not None:
            check_grad_norm_group(grad_norm_group)
        return self._filter_grads_for_norm(
            self.get_parameters(), param_filter=lambda p: grad_norm_group_of(p) == grad_norm_group
        )

    def _filter_grads_for_norm(self, params: list[torch.nn.Parameter],
                               param_filter: Optional[Callable[[torch.nn.Parameter], bool]] = None,
                               ) -> list[torch.Tensor]:
        """The gradients of `params` a norm counts: those passing `param_filter`, not None, not
        the second copy of a tied parameter, and held by one tensor-parallel rank only."""
        tp_group = getattr(self, "tp_group", None)
        return [p.grad for p in params
                if (param_filter is None or param_filter(p)) and p.grad is not None and counts_in_norm(p, tp_group)]

    @staticmethod
    def _filter_and_reorder_param_groups(current_groups: list[dict], state_dict_groups: list[dict]) -> list[dict]:
        """megatron-core's matching of saved param groups (torch's positional format) to live ones.

        For each current group, the saved group with the same identifying values
        (checkpointable/child.py's PARAM_GROUP_IDENTIFIER_KEYS: a missing key is None, NeMo's `pre_` prefix
        stands in), holding the 'params' of the saved group at that position, as torch's
        load pairs groups by position. A group without a match raises ValueError.
        """
        if len(current_groups) != len(state_dict_groups):
            raise ValueError(f"the state dict has {len(state_dict_groups)} param groups but this optimizer "
                             f"{len(current_groups)}; the overrides (or the model) changed since it was saved.")
        matched = match_param_groups(current_groups, state_dict_groups)
        return [{**group, "params": saved["params"]} for group, saved in zip(matched, state_dict_groups)]


class SteppableChild(ABC):
    """The per-child phases the step recipe drives (see the module docstring)."""

    grad_scaler: Any

    @abstractmethod
    def grad_stats(self, count_zeros: bool) -> LocalStats:
        """Prepare main gradients; return this rank's statistics (grad_stats.py), not yet reduced:
        the chain sums its children's as megatron-core's does (`reduced_stats`)."""

    @abstractmethod
    def current_grad_stats(self, count_zeros: bool) -> LocalStats:
        """grad_stats of the main gradients as they are: nothing prepared or unscaled (the phases'
        norm and zero count, step_phases.py)."""

    @abstractmethod
    def main_grads(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        """Main gradients of the parameters in `grad_norm_group` (None: the main norm's)."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Step and copy the main parameters to the model; True (megatron-core's meaning)."""

    @abstractmethod
    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError if `state_dict` does not fit; changes nothing."""


def counts_in_norm(param: torch.nn.Parameter, tp_group: Any = None) -> bool:
    """megatron-core's rule from the parameter's attributes (`shared`, `tensor_model_parallel`):
    a tied second copy never counts, a tensor-parallel-duplicated one on TP rank 0 only."""
    on_one_rank = getattr(param, "tensor_model_parallel", False) or group_rank(tp_group) == 0
    return not getattr(param, "shared", False) and bool(on_one_rank)


@contextlib.contextmanager
def timed(config: Any, name: str) -> Iterator[None]:
    """Time the block as megatron-core's optimizers do: `config.timers(name, log_level=1)`,
    started with `barrier=config.barrier_with_L1_time`; nothing when `config.timers` is None."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        timers(name).stop()


def take_step(children: list[SteppableChild], config: Any,
              norms_by_group: Optional[dict[str, float]] = None, arrange: Optional[ArrangeStats] = None) -> StepResult:
    """One optimizer step over `children`, which share one gradient norm; `norms_by_group` is
    filled with the norm of every separate gradient-norm group that has parameters; `arrange`
    rearranges the children's statistics before they are summed (ArrangeStats).

    The statistics stay on the device until they are read back once, in one transfer, right
    before the step is decided: the only point where the host must wait for the device (the
    skip decision is the host's, and the contract returns Python numbers).
    """
    found_inf, stats = prepared_stats(children, config, arrange)
    if norms_by_group is not None:
        norms_by_group.clear()
    if found_inf:
        return False, None, None
    grad_norm, group_norms = norms_of(stats)
    num_zeros = int(stats[ZEROS]) if config.log_num_zeros_in_grad else None
    if norms_by_group is not None:
        norms_by_group.update(group_norms)
    clip_by_norms(children, config, grad_norm, group_norms)
    if grad_norm > config.grad_norm_skip_threshold:
        return False, grad_norm, num_zeros
    for child in children:
        child.step_with_ready_grads()
    return True, grad_norm, num_zeros


def prepared_stats(children: list[SteppableChild], config: Any,
                   arrange: Optional[ArrangeStats] = None) -> tuple[bool, list[float]]:
    """Phase 1 and the loss scale's update: (inf/NaN anywhere, the summed statistics)."""
    offloaded = [getattr(child, "name", "") for child in children if getattr(child, "is_offloaded", False)]
    if offloaded:
        raise ValueError(f"the optimizer's state is on the host (offload_to_cpu(), children {offloaded}); call "
                         f"restore_from_cpu() before step().")
    with timed(config, "optimizer-copy-to-main-grad"):
        totals = _summed_stats(children, config.log_num_zeros_in_grad, arrange)
    stats = totals.tolist()  # the step's one device-to-host sync
    found_inf = stats[NONFINITE] > 0
    for scaler in _unique_scalers(children):
        scaler.update(found_inf)
    return found_inf, stats


def norms_of(stats: list[float]) -> tuple[float, dict[str, float]]:
    """(the main gradient norm, the norm of each separate group that has parameters) from statistics."""
    group_norms = {name: stats[group_index(name)] ** 0.5
                   for name in SEPARATE_GRAD_NORM_GROUPS if stats[group_index(name) + 1] > 0}
    return stats[SUM_OF_SQUARES] ** 0.5, group_norms  # `** 0.5`, as megatron-core takes the root


def clip_by_norms(children: list[SteppableChild], config: Any, grad_norm: float, group_norms: Mapping[str, float],
                  clip_grad: Optional[float] = None) -> None:
    """Phase 3: the main gradients by the main norm, each separate group's by its own
    (`clip_grad`, default `config.clip_grad`; 0 = off)."""
    clip_grad = config.clip_grad if clip_grad is None else clip_grad
    with timed(config, "optimizer-clip-main-grad"):
        for name, norm in ({None: grad_norm, **group_norms} if clip_grad > 0.0 else {}).items():
            clip_coeff = clip_grad / (norm + 1.0e-6)
            if clip_coeff < 1.0:
                for child in children:
                    scale_grads(child.main_grads(name), clip_coeff)


def current_stats(children: list[SteppableChild], count_zeros: bool,
                  arrange: Optional[ArrangeStats] = None) -> list[float]:
    """The statistics of the main gradients as they are now (nothing copied, unscaled or
    counted for inf/NaN), summed over the children and their norm groups."""
    local = [child.current_grad_stats(count_zeros) for child in children]
    return reduced_stats(arrange(local) if arrange else local).tolist()


def _summed_stats(children: list[SteppableChild], count_zeros: bool,
                  arrange: Optional[ArrangeStats] = None) -> torch.Tensor:
    """[non-finite, norm^2, zeros, ...] summed over the children and their ranks (grad_stats.py)."""
    local = [child.grad_stats(count_zeros) for child in children]
    return reduced_stats(arrange(local) if arrange else local)


def _unique_scalers(children: list[SteppableChild]) -> list[Any]:
    scalers = {id(c.grad_scaler): c.grad_scaler for c in children if c.grad_scaler is not None}
    return list(scalers.values())


def default_device() -> torch.device:
    """Where a rank without parameters keeps its statistics: the device the other ranks use."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
