"""The optimizer contract megatron-core trainers call, and the one step recipe behind it.

`step()` returns `(update_successful, grad_norm, num_zeros_in_grad)`:
1. every child copies its gradients to fp32 main gradients, unscales them and counts inf/NaN,
   then sums [non-finite, norm^2, zeros] over the ranks that hold disjoint parts;
2. inf/NaN anywhere: update the loss scale, return (False, None, None), change nothing else;
3. clip every child's gradients by the global norm (`clip_grad`, 0 = off);
4. a norm above `grad_norm_skip_threshold` returns (False, norm, zeros) without stepping;
5. every child steps and copies its main parameters back to the model.

With `config.timers` (megatron-core's `Timers`) the phases are timed under megatron-core's names,
with `barrier=config.barrier_with_L1_time`: 'optimizer-copy-to-main-grad' (1),
'optimizer-clip-main-grad' (3), 'optimizer-inner-step' and 'optimizer-copy-main-to-model-params'
(5), and 'params-all-gather' (the layer-wise broadcast).
"""

import contextlib
import math
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional

import torch

from megatron_eopt.wrappers.grad_stats import scale_grads

StepResult = tuple[bool, Optional[float], Optional[int]]


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


class SteppableChild(ABC):
    """The per-child phases the step recipe drives (see the module docstring)."""

    grad_scaler: Any

    @abstractmethod
    def grad_stats(self, count_zeros: bool) -> torch.Tensor:
        """Prepare main gradients; return [non-finite, norm^2, zeros] summed over its group."""

    @abstractmethod
    def main_grads(self) -> list[torch.Tensor]: ...

    @abstractmethod
    def step_with_ready_grads(self) -> None: ...

    @abstractmethod
    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError if `state_dict` does not fit; changes nothing."""


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


def take_step(children: list[SteppableChild], config: Any) -> StepResult:
    """One optimizer step over `children`, which share one gradient norm.

    The statistics stay on the device until they are read back once, in one transfer, right
    before the step is decided: the only point where the host must wait for the device (the
    skip decision is the host's, and the contract returns Python numbers).
    """
    with timed(config, "optimizer-copy-to-main-grad"):
        totals = _summed_stats(children, config.log_num_zeros_in_grad)
    nonfinite, sum_of_squares, zeros = totals.tolist()  # the step's one device-to-host sync
    found_inf = nonfinite > 0
    for scaler in _unique_scalers(children):
        scaler.update(found_inf)
    if found_inf:
        return False, None, None

    grad_norm = math.sqrt(sum_of_squares)
    num_zeros = int(zeros) if config.log_num_zeros_in_grad else None
    with timed(config, "optimizer-clip-main-grad"):
        if config.clip_grad > 0.0:
            clip_coeff = config.clip_grad / (grad_norm + 1.0e-6)
            if clip_coeff < 1.0:
                for child in children:
                    scale_grads(child.main_grads(), clip_coeff)
    if grad_norm > config.grad_norm_skip_threshold:
        return False, grad_norm, num_zeros
    for child in children:
        child.step_with_ready_grads()
    return True, grad_norm, num_zeros


def _summed_stats(children: list[SteppableChild], count_zeros: bool) -> torch.Tensor:
    """[non-finite, norm^2, zeros] summed over the children, on the first child's device."""
    stats = [child.grad_stats(count_zeros) for child in children]
    totals = stats[0]
    for more in stats[1:]:
        totals = totals + more.to(totals.device)
    return totals


def _unique_scalers(children: list[SteppableChild]) -> list[Any]:
    scalers = {id(c.grad_scaler): c.grad_scaler for c in children if c.grad_scaler is not None}
    return list(scalers.values())
