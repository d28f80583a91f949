"""Checkpoints our optimizer cannot write, refused at start-up, in one table for both loops.

A save that cannot be written fails at the first `--save-interval`, after that much training, on
every rank. So each combination whose checkpoints ours cannot write, and that the arguments show,
is one row of CHECKPOINT_REFUSALS, for Megatron-LM's loop (`megatron_lm`: install()'s
`validate_args`, again where the optimizer is built) or our trainer (`trainer`: pretrain.py, after
its flags are parsed), checked before any model is built when `--save` or `--load` is given (a run
without them trains whatever the format flag says). What only the model or a checkpoint's
contents show is refused when the optimizer is built or the checkpoint read, still before the
first iteration. Whether an optimizer keeps state a format has no place for is probed with the
save's own rule (megatron_core_formats/dist_checkpointing.py's `probe_state`), so a new optimizer
of that kind is refused too. docs/megatron-lm.md and docs/trainer.md list the rows;
tests/functional/test_checkpoint_refusals.py runs each in its loop, checks that no iteration ran
before the refusal, and keeps the lists and the table equal.
"""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Optional

from megatron_eopt.config.optimizer_config import OptimizerConfig
from megatron_eopt.megatron_core_formats.dist_checkpointing import ProbedState, probe_state


Loop = Literal["megatron_lm", "trainer"]


@dataclass(frozen=True)
class CheckpointRefusal:
    """One combination refused in `loop`. `example`: flags that give it, the refused ones first (the
    docs' list and the test run it); `given(args)`: whether `args` ask for it; `why(args)`: the line."""

    loop: Loop
    example: str
    given: Callable[[argparse.Namespace], bool]
    why: Callable[[argparse.Namespace], str]


def _format(args: argparse.Namespace) -> Optional[str]:
    return getattr(args, "ckpt_format", None)


def sharded_engine(args: argparse.Namespace) -> bool:
    """Whether the run trains on FSDP2 or Megatron-FSDP (their own checkpoint formats)."""
    return bool(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False))


def _optimizer_name(args: argparse.Namespace) -> str:
    return getattr(args, "optimizer", "adam")


def _engine_flag(args: argparse.Namespace) -> str:
    return "--use-torch-fsdp2" if getattr(args, "use_torch_fsdp2", False) else "--use-megatron-fsdp"


def _probed(args: argparse.Namespace) -> ProbedState:
    """What the run's optimizers keep beside parameter-shaped state (probe_state), each probed with
    its own config fields from `args` (`adaptive_muon_moment2_method`, ...)."""
    names = {_optimizer_name(args), getattr(args, "muon_scalar_optimizer", "adam")}
    probes = [probe_state(name, tuple((field.name, getattr(args, field.name)) for field in dataclasses.fields(
        OptimizerConfig) if field.name.startswith(f"{name}_") and hasattr(args, field.name))) for name in sorted(names)]
    return ProbedState(*(tuple(sorted({state for names in kind for state in names})) for kind in zip(*probes)))


def _tensor_parallel_sizes(args: argparse.Namespace) -> str:
    """The TP sizes above 1 (expert TP only with experts), as flags; '' at TP=1."""
    sizes = [("--tensor-model-parallel-size", getattr(args, "tensor_model_parallel_size", 1) or 1)]
    if getattr(args, "num_experts", None):
        sizes.append(("--expert-tensor-parallel-size", getattr(args, "expert_tensor_parallel_size", 1) or 1))
    return " and ".join(f"{flag} {size}" for flag, size in sizes if size > 1)


CHECKPOINT_REFUSALS = (
    CheckpointRefusal(
        "megatron_lm", "--ckpt-format torch_dist --use-torch-fsdp2 --untie-embeddings-and-output-weights",
        lambda args: getattr(args, "use_torch_fsdp2", False) and _format(args) != "torch_dcp",
        lambda args: f"--use-torch-fsdp2 with --ckpt-format {_format(args)} is not supported by megatron_eopt's "
                     f"optimizer; use --ckpt-format torch_dcp, which saves optimizer.state_dict() (DTensor state) "
                     f"with torch DCP."),
    CheckpointRefusal(
        "megatron_lm", "--ckpt-format torch_dist --optimizer muon_hyperball",
        lambda args: _format(args) == "torch_dist" and not sharded_engine(args)
        and bool(_probed(args).per_parameter_scalars),
        lambda args: f"--ckpt-format torch_dist with --optimizer {_optimizer_name(args)}: its state "
                     f"{list(_probed(args).per_parameter_scalars)} holds one number per parameter, and megatron-core's "
                     f"sharded format keeps one per name, so the first save would fail; use --ckpt-format torch."),
    CheckpointRefusal(
        "megatron_lm", "--tensor-model-parallel-size 2 --use-megatron-fsdp --untie-embeddings-and-output-weights "
        "--ckpt-format fsdp_dtensor --bf16 --optimizer adaptive_muon --adaptive-muon-moment2-method normuon",
        lambda args: getattr(args, "use_megatron_fsdp", False) and bool(_tensor_parallel_sizes(args))
        and bool(_probed(args).other_shaped),
        lambda args: f"{_tensor_parallel_sizes(args)} with --use-megatron-fsdp and --optimizer {_optimizer_name(args)}: its "
                     f"state {list(_probed(args).other_shaped)} is not shaped like its parameter, which the DTensor "
                     f"state of TP x Megatron-FSDP's 2-D (dp, tp) mesh holds at TP=1 only, so the first save would "
                     f"fail; checkpoint at tensor-parallel size 1."),
    CheckpointRefusal(
        "trainer", "--use-torch-fsdp2 --optimizer adaptive_muon --adaptive-muon-moment2-method normuon",
        lambda args: sharded_engine(args) and bool(_probed(args).other_shaped),
        lambda args: f"{_engine_flag(args)} with --optimizer {_optimizer_name(args)}: its state "
                     f"{list(_probed(args).other_shaped)} is not shaped like its parameter, and the trainer's "
                     f"checkpoints hold a sharded engine's state as rows of its parameters, so the first save would "
                     f"fail; train it without the sharded engine (e.g. --use-distributed-optimizer) to checkpoint it."),
)


def refuse_checkpoint_combinations(args: argparse.Namespace, loop: Loop) -> None:
    """ValueError naming the first row of `loop` in CHECKPOINT_REFUSALS that `args` give; else nothing."""
    checkpointing = bool(getattr(args, "save", None) or getattr(args, "load", None))
    for refusal in CHECKPOINT_REFUSALS:
        if refusal.loop == loop and checkpointing and refusal.given(args):
            flags = " and ".join(flag for flag in ("--save", "--load") if getattr(args, flag[2:], None))
            raise ValueError(f"{flags}: {refusal.why(args)}")
