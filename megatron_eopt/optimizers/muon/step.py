"""The orthogonalized step with one orthogonalize call for all parameters.

emerging_optimizers' `OrthogonalizedOptimizer.step` orthogonalizes parameter by parameter, through
the `scaled_orthogonalize_fn` it is given. Here the optimizer is given an `orthogonalize_all_fn`
instead, which takes every parameter's update at once, so that tensor-parallel shards and FSDP2
row shards move in one exchange per step (optimizers/muon/shards.py builds it).

`momentum_updates` and `apply_weight_updates` are the two halves of emerging_optimizers 0.3's
`OrthogonalizedOptimizer.step` (orthogonalized_optimizer.py), copied: weight decay, the momentum
update and Nesterov's lerp before orthogonalization; the weight update with its pre and post hooks
after it. tests/unit/library/optimizers/test_orthogonalized_step.py checks that they still step
exactly as the installed emerging_optimizers does.
"""

from typing import Any, Callable, Optional

import torch
from emerging_optimizers import utils as eo_utils

# (params, their updates) -> the orthogonalized updates, in the same order.
OrthogonalizeAllFn = Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]

Pending = tuple[dict, torch.Tensor, torch.Tensor]  # (param group, param, update to orthogonalize)


def momentum_updates(optimizer: Any) -> list[Pending]:
    """Copied from emerging_optimizers' OrthogonalizedOptimizer.step, up to orthogonalization, for
    every parameter with a gradient: weight decay, the momentum update, and the update to
    orthogonalize (the momentum, or Nesterov's)."""
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


def apply_weight_updates(optimizer: Any, pending: list[Pending], orthogonal: list[torch.Tensor]) -> None:
    """Copied from emerging_optimizers' OrthogonalizedOptimizer.step, after orthogonalization:
    the weight update between its pre and post hooks."""
    for (group, p, _), update in zip(pending, orthogonal):
        optimizer.pre_weight_update_fn_inplace(p, update)
        p.add_(update, alpha=-group["lr"])
        optimizer.post_weight_update_fn_inplace(p)


class OrthogonalizeTogether:
    """Mixed in before an OrthogonalizedOptimizer subclass, whose constructor sets
    `orthogonalize_all_fn`: emerging_optimizers' step, with one orthogonalize call for all
    parameters. Weight decay, momentum and the weight update are emerging_optimizers' own."""

    orthogonalize_all_fn: OrthogonalizeAllFn

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        if closure is not None:
            raise ValueError("closure is not supported")
        pending = momentum_updates(self)
        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            orthogonal = self.orthogonalize_all_fn([p for _, p, _ in pending], [u for _, _, u in pending])
        apply_weight_updates(self, pending, orthogonal)

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The orthogonalized update of one parameter (emerging_optimizers' per-parameter hook)."""
        return self.orthogonalize_all_fn([p], [grad])[0]
