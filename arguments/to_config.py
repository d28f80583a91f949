"""`optimizer_config_from_args(args)`: the OptimizerConfig a parsed command line describes.

Copies every attribute of `args` whose name is an `OptimizerConfig` field, as Megatron-LM does
(`getattr(args, f.name)` for each field), so a namespace from Megatron-LM's own parser works
too; fields `args` lacks keep their defaults. The config validates itself on construction.
"""

import argparse
import dataclasses

from megatron_eopt.config import OptimizerConfig

from arguments.optimizer_args import DEPRECATED_OPTIMIZER_NAMES


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """OptimizerConfig with every field `args` has copied by name, validated.

    Call `validate_args(args)` first: it rewrites deprecated spellings (dist_muon) and the
    distributed-optimizer flags of emerging optimizers, which this function does not.
    """
    if getattr(args, "optimizer", None) in DEPRECATED_OPTIMIZER_NAMES:
        raise ValueError(
            f"--optimizer {args.optimizer} is a deprecated spelling; call validate_args(args) "
            f"before optimizer_config_from_args(args) (it rewrites it to --optimizer muon "
            f"--use-distributed-optimizer)."
        )
    values = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(OptimizerConfig)
        if hasattr(args, field.name)
    }
    return OptimizerConfig(**values)
