"""The table of optimizers `OptimizerConfig.optimizer` may name.

An entry builds a torch optimizer from torch-format param groups and the config. Built in:
`adam` (torch AdamW with decoupled weight decay, or Adam with L2 decay when
`decoupled_weight_decay=False`) and `sgd` (torch SGD with momentum). Names are lower-case and
unique; looking up an unknown name lists the valid ones.
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch

BuildOptimizer = Callable[[list[dict], Any], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one named optimizer."""

    name: str
    build: BuildOptimizer
    description: str = ""


_REGISTRY: dict[str, OptimizerEntry] = {}


def register_optimizer(entry: OptimizerEntry) -> None:
    """Add `entry`; a name that is already registered is an error, never a silent replace."""
    if not isinstance(entry, OptimizerEntry):
        raise TypeError(f"register_optimizer takes an OptimizerEntry; got {type(entry).__name__}.")
    if not entry.name or entry.name != entry.name.strip().lower():
        raise ValueError(f"optimizer names are non-empty lower-case strings; got {entry.name!r}.")
    if entry.name in _REGISTRY:
        raise ValueError(f"an optimizer named {entry.name!r} is already registered.")
    _REGISTRY[entry.name] = entry


def list_optimizers() -> list[str]:
    """Every name `OptimizerConfig.optimizer` accepts, sorted."""
    return sorted(_REGISTRY)


def get_optimizer_entry(name: str) -> OptimizerEntry:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown optimizer {name!r}; valid names: {', '.join(list_optimizers())}."
        )
    return _REGISTRY[name]


def _build_adam(param_groups: list[dict], config: Any) -> torch.optim.Optimizer:
    adam_class = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    return adam_class(
        param_groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


def _build_sgd(param_groups: list[dict], config: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        param_groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay
    )


register_optimizer(OptimizerEntry("adam", _build_adam, "torch AdamW (Adam if not decoupled)"))
register_optimizer(OptimizerEntry("sgd", _build_sgd, "torch SGD with momentum"))
