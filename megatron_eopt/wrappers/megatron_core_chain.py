"""The chain's step over children that follow megatron-core's optimizer interface instead of ours.

megatron-core's ChainedOptimizer takes any object with its optimizer interface (its own
optimizers, a test's stand-in). Such a child provides `config`, `prepare_grads() -> found_inf`,
`get_grad_norm()`, `get_parameters()`, `get_grads_for_grad_norm(grad_norm_group=None)`,
`step_with_ready_grads() -> bool`, and optionally `is_stub_optimizer`, `has_grad_norm_group(g)`,
`get_grad_stats_parallel_group()` and `count_zeros()`. The step is megatron-core's:
1. inf/NaN in any child: (False, None, None);
2. the norm: the one child's `get_grad_norm()`, else the root of the children's squares summed;
3. each separate gradient-norm group (grad_stats.py) that a child has: its norm over the
   children's `get_grads_for_grad_norm(group)`, summed over each child's grad-stats group;
4. every non-stub child with `clip_grad > 0` clips its main parameters' `.grad` by the norm and
   each group's parameters by the group's norm;
5. a main norm above a child's `grad_norm_skip_threshold` skips the update: (False, norm, zeros).
"""

import math
from typing import Any, Optional

import torch

from megatron_eopt.runtime.process_groups import all_reduce_sum
from megatron_eopt.wrappers.base import StepResult
from megatron_eopt.wrappers.grad_stats import SEPARATE_GRAD_NORM_GROUPS, grad_norm_group_of, scale_grads

# What a child must have for the chain to step it.
STEP_METHODS = ("prepare_grads", "get_grad_norm", "get_parameters", "get_grads_for_grad_norm", "step_with_ready_grads")


def step_megatron_core_children(children: list[Any], config: Any, norms_by_group: dict[str, float]) -> StepResult:
    """One step over `children` (the module docstring); fills `norms_by_group`."""
    missing = sorted({m for child in children for m in STEP_METHODS if not hasattr(child, m)})
    if missing:
        raise TypeError(f"ChainedOptimizer.step needs children with megatron-core's optimizer interface; "
                        f"a child lacks {missing}.")
    chain = MegatronCoreChildren(children)
    norms_by_group.clear()
    if chain.prepare_grads():
        return False, None, None
    grad_norm = chain.get_grad_norm()
    active = chain.active()
    if any(child.config.clip_grad > 0.0 for child in active):
        norms_by_group.update(_group_norms(children))
    skip = False
    for child in active:
        if child.config.clip_grad > 0.0:
            _clip_child(child, child.config.clip_grad, grad_norm, norms_by_group)
        threshold = child.config.grad_norm_skip_threshold
        has_main = any(grad_norm_group_of(p) is None for p in child.get_parameters())
        skip |= has_main and math.isfinite(threshold) and grad_norm > threshold
    num_zeros = chain.count_zeros() if config is not None and config.log_num_zeros_in_grad else None
    if skip:
        return False, grad_norm, num_zeros
    return chain.step_with_ready_grads(), grad_norm, num_zeros


class MegatronCoreChildren:
    """megatron-core's ChainedOptimizer's phases over children of its optimizer interface."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children
        self.norms_by_group: dict[str, float] = {}  # set by clip_grad_norm

    def active(self) -> list[Any]:
        return [child for child in self.children if not getattr(child, "is_stub_optimizer", False)]

    def prepare_grads(self) -> bool:
        return any([bool(child.prepare_grads()) for child in self.children])  # a list: every child prepares

    def get_grad_norm(self) -> float:
        norms = [float(child.get_grad_norm() or 0.0) for child in self.children]
        return norms[0] if len(norms) == 1 else math.sqrt(sum(n * n for n in norms))

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The norm; every child's gradients clipped to `clip_grad`, a separate group's by its norm."""
        grad_norm = self.get_grad_norm()
        self.norms_by_group = _group_norms(self.children) if clip_grad > 0.0 else {}
        for child in self.active() if clip_grad > 0.0 else []:
            _clip_child(child, clip_grad, grad_norm, self.norms_by_group)
        return grad_norm

    def count_zeros(self) -> int:
        return int(sum(child.count_zeros() for child in self.children if hasattr(child, "count_zeros")))

    def step_with_ready_grads(self) -> bool:
        return all([bool(child.step_with_ready_grads()) for child in self.children])  # a list: every child steps


def _clip_child(child: Any, clip_grad: float, grad_norm: float, norms_by_group: dict[str, float]) -> None:
    params = child.get_parameters()
    _clip([p for p in params if grad_norm_group_of(p) is None], clip_grad, grad_norm)
    for name, norm in norms_by_group.items():
        _clip([p for p in params if grad_norm_group_of(p) == name], clip_grad, norm)


def _group_norms(children: list[Any]) -> dict[str, float]:
    norms = {}
    for name in SEPARATE_GRAD_NORM_GROUPS:
        has_group = [getattr(child, "has_grad_norm_group", None) for child in children]
        if not any(has(name) if has is not None else child.get_grads_for_grad_norm(name)
                   for child, has in zip(children, has_group)):
            continue
        squares = 0.0
        for child in children:
            grads = child.get_grads_for_grad_norm(name)
            square = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
            for grad in grads:
                square = square + grad.float().square().sum()
            group = child.get_grad_stats_parallel_group() if hasattr(child, "get_grad_stats_parallel_group") else None
            squares += all_reduce_sum(square, group).item()
        norms[name] = math.sqrt(squares)
    return norms


def _clip(params: list[torch.nn.Parameter], clip_grad: float, norm: Optional[float]) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    clip_coeff = clip_grad / ((norm or 0.0) + 1.0e-6)
    if grads and clip_coeff < 1.0:
        scale_grads(grads, clip_coeff)
