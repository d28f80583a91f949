"""Megatron-compatible command-line flags (see the trainer issue).

`add_optimizer_args` adds the flags (dest == OptimizerConfig field, dataclass defaults),
`validate_args` applies Megatron-LM's rewrites and checks, `parse_and_validate` does both and
exits like argparse on errors, `optimizer_config_from_args` builds the OptimizerConfig.
"""

from arguments.optimizer_args import add_optimizer_args
from arguments.to_config import matmul_precision_line, optimizer_config_from_args
from arguments.validate import parse_and_validate, refuse_flags_without, validate_args

__all__ = [
    "add_optimizer_args",
    "matmul_precision_line",
    "optimizer_config_from_args",
    "parse_and_validate",
    "refuse_flags_without",
    "validate_args",
]
