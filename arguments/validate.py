"""`validate_args`: Megatron-LM's optimizer checks and rewrites on a parsed namespace.

- `--optimizer dist_muon` (deprecated) becomes `--optimizer muon` with the layer-wise
  distributed optimizer, with a DeprecationWarning saying what to write instead.
- An emerging optimizer (anything but adam/sgd, as Megatron-LM decides it) with
  `--use-distributed-optimizer` means the layer-wise distributed optimizer.
- `--fp16` with an emerging optimizer, and any value OptimizerConfig rejects, raise ValueError
  with a one-line message naming the flag; `parse_and_validate` turns that into
  `parser.error`-style output (exit code 2, one line on stderr).
- `--muon-tp-mode` given without tensor parallelism warns that it has no effect.
"""

import argparse
import re
import warnings
from typing import Optional, Sequence

from arguments.optimizer_args import GIVEN_FLAGS_ATTR, OPTION_OF, add_optimizer_args
from arguments.to_config import optimizer_config_from_args

NON_EMERGING_OPTIMIZERS = ("adam", "sgd")  # Megatron-LM: `args.optimizer not in ('sgd', 'adam')`


def validate_args(
    args: argparse.Namespace, tensor_model_parallel_size: Optional[int] = None
) -> argparse.Namespace:
    """Rewrite and check the optimizer flags of `args` in place; return `args`.

    `tensor_model_parallel_size`: None reads `args.tensor_model_parallel_size` (Megatron-LM's
    namespace has it), else 1. Raises ValueError naming the offending flag.
    """
    if tensor_model_parallel_size is None:
        tensor_model_parallel_size = getattr(args, "tensor_model_parallel_size", None) or 1
    _rewrite_dist_muon(args)
    if args.optimizer not in NON_EMERGING_OPTIMIZERS:
        _check_emerging_precision(args)
        _use_layer_wise_distributed_optimizer(args)
    _warn_tp_mode_without_tp(args, tensor_model_parallel_size)
    try:
        optimizer_config_from_args(args)
    except (ValueError, TypeError) as error:
        raise ValueError(flag_message(str(error))) from None
    return args


def parse_and_validate(
    argv: Optional[Sequence[str]] = None,
    parser: Optional[argparse.ArgumentParser] = None,
    tensor_model_parallel_size: Optional[int] = None,
) -> argparse.Namespace:
    """Parse `argv` (default: sys.argv[1:]) and validate it; errors exit like argparse's.

    `parser`: one that already has `add_optimizer_args` (default: a fresh one with only those
    flags). A ValueError from `validate_args` prints `prog: error: message` (one line) to
    stderr and exits with code 2; argparse's own errors (bad choice, bad type) exit as usual.
    """
    if parser is None:
        parser = add_optimizer_args(argparse.ArgumentParser(description="Optimizer flags."))
    args = parser.parse_args(argv)
    try:
        return validate_args(args, tensor_model_parallel_size)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")


def flag_message(message: str) -> str:
    """`message` about OptimizerConfig fields, with each field spelled as its flag, one line."""
    # One pass, so a flag already written is never rewritten. Bare field names ("must not exceed
    # lr") too, but 'optimizer' only after 'OptimizerConfig.': the word also appears in prose.
    bare = sorted((name for name in OPTION_OF if "_" in name or name == "lr"), key=len, reverse=True)
    pattern = r"\bOptimizerConfig\.(\w+)|(?<![\w-])(" + "|".join(bare) + r")(?![\w-])"
    message = re.sub(pattern, _option_for_field, message)
    return " ".join(message.replace("OptimizerConfig needs", "needs").split())


def _option_for_field(match: re.Match) -> str:
    name = match.group(1) or match.group(2)
    return OPTION_OF.get(name, f"OptimizerConfig.{name}")  # a field without a flag keeps its name


def _rewrite_dist_muon(args: argparse.Namespace) -> None:
    if args.optimizer != "dist_muon":
        return
    warnings.warn(
        "--optimizer dist_muon is deprecated; write --optimizer muon --use-distributed-optimizer "
        "instead (the layer-wise distributed optimizer).",
        DeprecationWarning,
        stacklevel=3,
    )
    args.optimizer = "muon"
    args.use_layer_wise_distributed_optimizer = True
    args.use_distributed_optimizer = False


def _check_emerging_precision(args: argparse.Namespace) -> None:
    if getattr(args, "fp16", False):
        raise ValueError(
            f"--fp16 is not supported with --optimizer {args.optimizer}: emerging optimizers have "
            f"no loss scaling; use --bf16, or --optimizer adam/sgd for fp16."
        )


def _use_layer_wise_distributed_optimizer(args: argparse.Namespace) -> None:
    if getattr(args, "use_distributed_optimizer", False):
        args.use_layer_wise_distributed_optimizer = True
        args.use_distributed_optimizer = False


def _warn_tp_mode_without_tp(args: argparse.Namespace, tensor_model_parallel_size: int) -> None:
    given = getattr(args, GIVEN_FLAGS_ATTR, None) or ()
    if tensor_model_parallel_size == 1 and "muon_tp_mode" in given:
        warnings.warn(
            f"--muon-tp-mode {args.muon_tp_mode} has no effect with tensor-model-parallel size 1 "
            f"(every rank holds whole matrices).",
            UserWarning,
            stacklevel=3,
        )
