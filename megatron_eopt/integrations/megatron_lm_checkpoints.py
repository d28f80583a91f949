"""Checkpoints our optimizer cannot write in Megatron-LM's loop, refused at start-up.

A save that cannot be written fails at the first `--save-interval`, after that much training, on
every rank. So every combination whose checkpoints ours cannot write or read, and that the
arguments show, is one row of CHECKPOINT_REFUSALS, checked by install()'s `validate_args`
before any work: when `--save` or `--load` is given, or always for a row that the format flag
decides alone (`always`, as such rows were refused before this table). `get_megatron_optimizer_for_megatron_lm`
checks the table again, for callers that skip Megatron-LM's `validate_args`. What only the model
or a checkpoint's contents show (a format megatron_eopt does not read, expert biases on
megatron-core's layer-wise layout) is refused when the optimizer is built or the checkpoint read,
still before the first iteration.

docs/megatron-lm.md lists the rows between `<!-- checkpoint refusals: begin -->` and `end -->`;
tests/functional/test_megatron_lm_checkpoint_refusals.py runs each example in the loop, checks that
no iteration ran before the refusal, and keeps the list and the table equal.
"""

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_eopt.megatron_core_formats.dist_checkpointing import scalar_state_per_parameter


@dataclass(frozen=True)
class CheckpointRefusal:
    """One combination refused. `example`: flags that give it, the refused ones first (the docs'
    list and the test run it); `given(args)`: whether `args` ask for it; `why(args)`: the line."""

    example: str
    given: Callable[[argparse.Namespace], bool]
    why: Callable[[argparse.Namespace], str]
    always: bool = False  # refused without --save and --load too


def _format(args: argparse.Namespace) -> Optional[str]:
    return getattr(args, "ckpt_format", None)


def _sharded_engine(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False))


def _per_parameter_scalars(args: argparse.Namespace) -> tuple[str, ...]:
    """Scalar state the run's optimizers keep one value of per parameter (scalar_state_per_parameter)."""
    names = [getattr(args, "optimizer", "adam"), getattr(args, "muon_scalar_optimizer", "adam")]
    return tuple(sorted({state for name in names for state in scalar_state_per_parameter(name)}))


CHECKPOINT_REFUSALS = (
    CheckpointRefusal(
        "--ckpt-format torch_dist --use-torch-fsdp2 --untie-embeddings-and-output-weights",
        lambda args: getattr(args, "use_torch_fsdp2", False) and _format(args) != "torch_dcp",
        lambda args: f"--use-torch-fsdp2 with --ckpt-format {_format(args)} is not supported by megatron_eopt's "
                     f"optimizer; use --ckpt-format torch_dcp, which saves optimizer.state_dict() (DTensor state) "
                     f"with torch DCP.",
        always=True),
    CheckpointRefusal(
        "--ckpt-format torch_dist --optimizer muon_hyperball",
        lambda args: _format(args) == "torch_dist" and not _sharded_engine(args) and bool(_per_parameter_scalars(args)),
        lambda args: f"--ckpt-format torch_dist with --optimizer {args.optimizer}: its state "
                     f"{list(_per_parameter_scalars(args))} holds one number per parameter, and megatron-core's "
                     f"sharded format keeps one per name, so the first save would fail; use --ckpt-format torch."),
)


def refuse_checkpoint_combinations(args: argparse.Namespace) -> None:
    """ValueError naming the first row of CHECKPOINT_REFUSALS that `args` give; nothing otherwise."""
    checkpointing = bool(getattr(args, "save", None) or getattr(args, "load", None))
    for refusal in CHECKPOINT_REFUSALS:
        if (checkpointing or refusal.always) and refusal.given(args):
            flags = " and ".join(flag for flag in ("--save", "--load") if getattr(args, flag[2:], None))
            raise ValueError(refusal.why(args) if refusal.always or not flags else f"{flags}: {refusal.why(args)}")
