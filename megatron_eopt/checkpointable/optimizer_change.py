"""Loading optimizer state after a parameter's optimizer changed since the save.

A parameter's optimizer changes when the routing does (another megatron_eopt version,
`muon_include_params` / `muon_exclude_params`, `muon_scalar_optimizer`) or the run does (an AdamW
checkpoint continued with Muon). Its saved state does not fit its optimizer now (Adam's `exp_avg`
where Muon keeps `momentum_buffer`), and its optimizer here may find no state for it at all.

Every load path (the trainer's checkpoints, torch DCP, Megatron-LM's loop) names such parameters
by comparing where each parameter's state was saved with where it lives now (`optimizer_changes`),
and hands them to `settle_optimizer_changes`: without the opt-in a ValueError names them and the
opt-in; with `OptimizerConfig.allow_optimizer_change_on_load` (`--allow-optimizer-change-on-load`)
one line names them, their state starts fresh (as torchtitan does), and everything else loads
exactly.
"""

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

OPT_IN_FIELD = "allow_optimizer_change_on_load"
OPT_IN_FLAG = "--allow-optimizer-change-on-load"
NAMED_AT_MOST = 6  # parameters named in the line; the rest counted


@dataclass(frozen=True)
class Owner:
    """Where a parameter's state is kept: an optimizer (a chain's child) and the kind of state it
    keeps (its torch class, or its state names); another child of the same kind takes the state."""

    child: str
    kind: str

    def __str__(self) -> str:
        return f"{self.child} ({self.kind})" if self.kind else self.child


@dataclass(frozen=True)
class OptimizerChange:
    """One parameter whose optimizer is not the one its checkpointed state was saved under."""

    name: str
    saved: Optional[Owner]  # where the checkpoint holds its state; None: nowhere
    live: Owner  # the optimizer that steps it here

    def __str__(self) -> str:
        return f"{self.name} ({self.saved or 'no saved state'} -> {self.live})"


def optimizer_changes(saved: Mapping[str, Owner], live: Mapping[str, Owner]) -> list[OptimizerChange]:
    """The parameters of `live` ({name: owner}) whose state `saved` holds under another kind of
    optimizer, or not at all (a child of another name but the same kind is no change)."""
    return [OptimizerChange(name, saved.get(name), owner) for name, owner in sorted(live.items())
            if saved.get(name) is None or saved[name].kind != owner.kind]


def allows_optimizer_change(optimizer_or_config: Any) -> bool:
    """The opt-in of an optimizer (its `config`) or a config; False for anything without it."""
    config = getattr(optimizer_or_config, "config", optimizer_or_config)
    return bool(getattr(config, OPT_IN_FIELD, False))


def describe_changes(changes: Iterable[OptimizerChange]) -> str:
    changes = list(changes)
    named = ", ".join(map(str, changes[:NAMED_AT_MOST]))
    rest = len(changes) - NAMED_AT_MOST
    return named + (f" and {rest} more" if rest > 0 else "")


OPT_IN_REMEDY = (f"To load everything else exactly and start their state fresh, set OptimizerConfig.{OPT_IN_FIELD}=True "
                 f"({OPT_IN_FLAG}); to start all optimizer state fresh, load the model only (load_optimizer=False, "
                 f"--no-load-optim).")


def settle_optimizer_changes(changes: list[OptimizerChange], allowed: bool, where: str,
                             error: type = ValueError, remedy: str = OPT_IN_REMEDY) -> set[str]:
    """The names whose state starts fresh; raises `error` (a ValueError) naming them and `remedy`
    (the opt-in) when not `allowed`; says it in one line on rank zero when it is. Nothing for no changes."""
    if not changes:
        return set()
    what = (f"{where}: the optimizer of {len(changes)} parameter(s) changed since the checkpoint was "
            f"saved: {describe_changes(changes)}")
    if not allowed:
        raise error(f"{what}. Their saved state does not fit their optimizer now. {remedy}")
    say_on_rank_zero(f"megatron_eopt: {what}; their optimizer state starts fresh ({OPT_IN_FIELD}), "
                      f"everything else is loaded.")
    return {change.name for change in changes}


def say_on_rank_zero(line: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(line, flush=True)
