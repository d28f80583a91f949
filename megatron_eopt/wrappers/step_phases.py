"""megatron-core's optimizer step in its public phases, for callers that drive it themselves
(megatron-core's MimoOptimizer; trainers that clip or log by rules of their own):
`prepare_grads()` (main gradients copied and unscaled, the loss scale updated: inf/NaN anywhere?),
`clip_grad_norm(clip)` or `get_grad_norm()`, `count_zeros()`, `step_with_ready_grads()`.

`step()` is the same phases in one (wrappers/base.py's `take_step`) with one reduction of the
statistics where the phases make one each. As megatron-core's, the norm and the zero count read
the main gradients as they are when called (after clipping: the clipped norm), reduced over the
groups the optimizer was built with. On purpose, `prepare_grads` reports inf/NaN in fp32 too
(megatron-core's FP32Optimizer never does): our `step()` skips such a step.
`get_grad_stats_parallel_group()` is the one group the norm is summed over; where ours sums over
two in turn (the owners, then model parallel) there is none, and it says so.
"""

from typing import Any, Optional

import torch

from megatron_eopt.runtime.process_groups import ProcessGroup, all_reduce_sum
from megatron_eopt.wrappers.base import (ArrangeStats, SteppableChild, clip_by_norms, current_stats, norms_of,
                                         prepared_stats)
from megatron_eopt.wrappers.grad_stats import ZEROS, check_grad_norm_group


class StepPhases:
    """The phases over `_phase_children()` (the children that share one gradient norm)."""

    config: Any
    grad_norms_by_group: Any
    arrange_stats: Optional[ArrangeStats] = None  # what step() rearranges the statistics with, if anything

    def _phase_children(self) -> list[SteppableChild]:
        raise NotImplementedError

    def prepare_grads(self) -> bool:
        """Main gradients copied and unscaled, the loss scale updated; whether any holds inf/NaN."""
        return prepared_stats(self._phase_children(), self.config, self.arrange_stats)[0]

    def get_grad_norm(self) -> float:
        """The main gradients' norm (a separate group's parameters left out), reduced as step() does."""
        return norms_of(current_stats(self._phase_children(), count_zeros=False, arrange=self.arrange_stats))[0]

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The norm; the main gradients clipped by it to `clip_grad` (0 = off), a separate group's by
        its own norm (kept in `grad_norms_by_group`)."""
        children = self._phase_children()
        grad_norm, group_norms = norms_of(current_stats(children, count_zeros=False, arrange=self.arrange_stats))
        self.grad_norms_by_group = group_norms
        clip_by_norms(children, self.config, grad_norm, group_norms, clip_grad=clip_grad)
        return grad_norm

    def count_zeros(self) -> int:
        """Zero entries in the gradients the norm counts, over the ranks that hold disjoint parts."""
        return int(current_stats(self._phase_children(), count_zeros=True, arrange=self.arrange_stats)[ZEROS])

    def get_grad_stats_parallel_group(self) -> Optional[ProcessGroup]:
        groups = {norm_groups(child) for child in self._phase_children()} or {(None,)}
        if len(groups) > 1 or len(next(iter(groups))) > 1:
            raise ValueError("this optimizer sums its gradient norm over more than one group (its children's "
                             "differ, or the owners' and then the model-parallel group); get_grad_norm() and "
                             "count_zeros() reduce over them.")
        (group,) = next(iter(groups))
        if group is None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError("this optimizer's gradient norm needs no reduction (its parameters are whole on this "
                             "rank): no group to give (None is every rank); get_grad_norm() needs none.")
        return group

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
