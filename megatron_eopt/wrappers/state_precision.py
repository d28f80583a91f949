"""Optimizer state stored in 16 bits, updated in fp32 (`exp_avg_dtype`, `exp_avg_sq_dtype`).

One mechanism around any torch optimizer's step, with no per-optimizer code path: between steps
the first- and second-moment tensors of `MOMENT_KEYS` are held in their configured dtype; right
before the inner step they are upcast to fp32 working tensors, the optimizer's own update runs
in fp32, and right after it they are rounded back to nearest (even), as `Tensor.to` rounds.
Every other state tensor (step counters, preconditioners, eigenbases) stays fp32.
docs/memory.md has the table below as the support table.
"""

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

# optimizer name -> (first-moment keys: exp_avg_dtype, second-moment keys: exp_avg_sq_dtype).
MOMENT_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "adam": (("exp_avg",), ("exp_avg_sq",)),
    "sgd": (("momentum_buffer",), ()),
    "muon": (("momentum_buffer",), ()),
    "adaptive_muon": (("momentum_buffer",), ("moment2_buffer",)),
    "mop": (("momentum_buffer",), ()),
    "polargrad": (("momentum_buffer",), ()),
    "scion": (("momentum_buffer",), ()),
    "spel": (("momentum_buffer",), ()),
    "muon_hyperball": (("momentum_buffer",), ()),
    "sinkhorn_muon": (("momentum_buffer",), ()),
    "oblique_sgd": (("momentum_buffer",), ()),
    "lion": (("exp_avg",), ()),
    "laprop": (("exp_avg",), ("exp_avg_sq",)),
    "oblique_adam": (("exp_avg",), ("exp_avg_sq",)),
    "soap": (("exp_avg",), ("exp_avg_sq",)),
    "rekls": (("exp_avg",), ("exp_avg_sq",)),
    "psgd_pro": (("exp_avg",), ()),
}


@dataclass(frozen=True)
class StatePrecision:
    """The stored dtype of each reduced-precision state key of one optimizer."""

    dtype_of: dict[str, torch.dtype]  # state key -> stored dtype (only keys not stored in fp32)

    def store(self, optimizer: torch.optim.Optimizer, params: Optional[list] = None) -> None:
        """Round every covered state tensor of `optimizer` (of `params` only, when given) to its
        stored dtype (nearest, ties to even)."""
        self._cast(optimizer, lambda key: self.dtype_of[key], params)

    @contextlib.contextmanager
    def working(self, optimizer: torch.optim.Optimizer, params: Optional[list] = None) -> Iterator[None]:
        """fp32 working state inside the block (the inner step), stored dtype again after it; the
        state of `params` only, when given (a window of the offloaded step, offload/host_resident.py)."""
        self._cast(optimizer, lambda key: torch.float32, params)
        try:
            yield
        finally:
            self.store(optimizer, params)  # also after a raise: never leave fp32 copies behind

    def _cast(self, optimizer: torch.optim.Optimizer, dtype_for, params: Optional[list]) -> None:
        states = optimizer.state.values() if params is None else [optimizer.state[p] for p in params]
        for state in states:
            for key in self.dtype_of.keys() & state.keys():
                value = state[key]
                if torch.is_tensor(value) and value.is_floating_point():
                    state[key] = value.to(dtype_for(key), memory_format=torch.contiguous_format)


def state_precision_for(optimizer_name: str, config) -> Optional[StatePrecision]:
    """The StatePrecision of `optimizer_name` under `config`, or None when all its state is fp32.

    Raises ValueError for an optimizer outside MOMENT_KEYS when a moment dtype is not fp32: its
    state would silently stay fp32.
    """
    if not config.use_precision_aware_optimizer:
        return None
    wanted = {"exp_avg_dtype": config.exp_avg_dtype, "exp_avg_sq_dtype": config.exp_avg_sq_dtype}
    if all(dtype == torch.float32 for dtype in wanted.values()):
        return None
    if optimizer_name not in MOMENT_KEYS:
        raise ValueError(f"exp_avg_dtype/exp_avg_sq_dtype other than torch.float32 are not supported with optimizer "
                         f"{optimizer_name!r} (no known moment keys); supported: {', '.join(sorted(MOMENT_KEYS))}.")
    first, second = MOMENT_KEYS[optimizer_name]
    dtype_of = {key: config.exp_avg_dtype for key in first} | {key: config.exp_avg_sq_dtype for key in second}
    dtype_of = {key: dtype for key, dtype in dtype_of.items() if dtype != torch.float32}
    return StatePrecision(dtype_of) if dtype_of else None


def state_precision_table_markdown() -> str:
    """docs/memory.md's table: which state each field covers, per optimizer."""
    rows = ["| optimizer | `exp_avg_dtype` | `exp_avg_sq_dtype` |", "|---|---|---|"]
    for name, (first, second) in sorted(MOMENT_KEYS.items()):
        rows.append(f"| {name} | {', '.join(first) or '-'} | {', '.join(second) or '-'} |")
    return "\n".join(rows)
