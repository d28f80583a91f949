"""megatron-core's optimizer step in its public phases, for callers that drive it themselves
(megatron-core's MimoOptimizer steps each module's optimizer so; trainers that clip or log by
rules of their own do the same):

    found_inf = optimizer.prepare_grads()        # main gradients ready and unscaled; inf/NaN anywhere?
    grad_norm = optimizer.clip_grad_norm(clip)   # or get_grad_norm(): the norm alone
    num_zeros = optimizer.count_zeros()
    optimizer.step_with_ready_grads()            # step, copy the main parameters to the model

`step()` is these phases in one (wrappers/base.py's `take_step`), with one reduction of the
statistics where the phases make one each. As megatron-core's, `get_grad_norm`, `clip_grad_norm`
and `count_zeros` read the main gradients as they are when called (a norm after clipping is the
clipped one), and every reduction runs over the groups the optimizer was built with.
`prepare_grads` updates the loss scale (fp16), as megatron-core's does. One difference on purpose:
it reports inf/NaN in fp32 runs too, where megatron-core's FP32Optimizer returns False whatever
the gradients hold, because our `step()` skips such a step.

The groups: `get_grad_stats_parallel_group()` is the one group the norm is summed over, as
megatron-core's; where ours sums over two in turn (the layer-wise optimizer's and FSDP's owners,
then the model-parallel group) there is no such group, and it says so.
"""

from typing import Any, Optional

import torch

from megatron_eopt.runtime.process_groups import ProcessGroup, all_reduce_sum
from megatron_eopt.wrappers.base import SteppableChild, clip_by_norms, current_stats, norms_of, prepared_stats
from megatron_eopt.wrappers.grad_stats import ZEROS, check_grad_norm_group


class StepPhases:
    """The phases over `_phase_children()` (the children that share one gradient norm)."""

    config: Any
    grad_norms_by_group: Any

    def _phase_children(self) -> list[SteppableChild]:
        raise NotImplementedError

    def prepare_grads(self) -> bool:
        """Main gradients copied and unscaled, the loss scale updated; whether any holds inf/NaN."""
        return prepared_stats(self._phase_children(), self.config)[0]

    def get_grad_norm(self) -> float:
        """The main gradients' norm (a separate group's parameters left out), reduced as step() does."""
        return norms_of(current_stats(self._phase_children(), count_zeros=False))[0]

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The norm; the main gradients clipped by it to `clip_grad` (0 = off), a separate group's by
        its own norm (kept in `grad_norms_by_group`)."""
        children = self._phase_children()
        grad_norm, group_norms = norms_of(current_stats(children, count_zeros=False))
        self.grad_norms_by_group = group_norms
        clip_by_norms(children, self.config, grad_norm, group_norms, clip_grad=clip_grad)
        return grad_norm

    def count_zeros(self) -> int:
        """Zero entries in the gradients the norm counts, over the ranks that hold disjoint parts."""
        return int(current_stats(self._phase_children(), count_zeros=True)[ZEROS])

    def get_grad_stats_parallel_group(self) -> Optional[ProcessGroup]:
        groups = {norm_groups(child) for child in self._phase_children()}
        if len(groups) > 1:
            raise ValueError(f"this optimizer's children sum their gradient norms over different groups ({groups}); "
                             f"ask each child (chained_optimizers), or use get_grad_norm().")
        (chain,) = groups or {(None,)}
        if chain == (None,) and torch.distributed.is_initialized():
            raise ValueError("this optimizer's gradient norm needs no reduction (its parameters are whole on this "
                             "rank), so it has no group to give; use get_grad_norm() and count_zeros().")
        if len(chain) > 1:
            raise ValueError("this optimizer sums the gradient norm over two groups in turn (the parameters' owners, "
                             "then the model-parallel group), not over one; use get_grad_norm() and count_zeros(), "
                             "which reduce over both.")
        return chain[0]

    def grads_states_parallel_group_is_shared(self) -> bool:
        """Whether every child sums its gradient statistics over the same groups."""
        return len({norm_groups(child) for child in self._phase_children()}) <= 1

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any rank of the norm's groups has a parameter tagged `grad_norm_group` (one
        reduction, cached: the tags are set when the model is built)."""
        check_grad_norm_group(grad_norm_group)
        cache = self.__dict__.setdefault("_has_grad_norm_group", {})
        if grad_norm_group not in cache:
            cache[grad_norm_group] = any(_has_group(child, grad_norm_group) for child in self._phase_children())
        return cache[grad_norm_group]


def norm_groups(child: Any) -> tuple:
    return tuple(getattr(child, "_norm_groups", ()))


def _has_group(child: Any, grad_norm_group: str) -> bool:
    tags = getattr(child, "_grad_norm_groups", [])
    device = getattr(child, "_device", torch.device("cpu"))
    count = torch.tensor([float(sum(tag == grad_norm_group for tag in tags))], device=device)
    for group in norm_groups(child):
        all_reduce_sum(count, group)
    return bool(count.item() > 0)
