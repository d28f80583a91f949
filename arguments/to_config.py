"""`optimizer_config_from_args(args)`: the OptimizerConfig a parsed command line describes.

Copies every attribute of `args` whose name is an `OptimizerConfig` field, as Megatron-LM does
(`getattr(args, f.name)` for each field), so a namespace from Megatron-LM's own parser works
too; fields `args` lacks keep their defaults. The config validates itself on construction.
Dtype flags ('fp32', 'bf16', 'fp16') become torch dtypes.
`--muon-fp32-matmul-prec` left at None is chosen for the device (`fp32_matmul_prec_for`);
`matmul_precision_line` is the one line a trainer prints about that choice.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Optional

from arguments.optimizer_args import DEPRECATED_OPTIMIZER_NAMES, DTYPE_NAMES

if TYPE_CHECKING:  # torch and the config are imported where used: parsers stay torch-free
    import torch

    from megatron_eopt.config.optimizer_config import OptimizerConfig


def optimizer_config_from_args(args: argparse.Namespace, device: Optional[torch.device] = None) -> OptimizerConfig:
    """OptimizerConfig with every field `args` has copied by name, validated.

    `device`: where the parameters live, for a `muon_fp32_matmul_prec` of None (not given on
    the command line); None means CUDA if available, else CPU.

    Call `validate_args(args)` first: it rewrites deprecated spellings (dist_muon) and the
    distributed-optimizer flags of emerging optimizers, which this function does not.
    """
    from megatron_eopt.config.optimizer_config import OptimizerConfig, fp32_matmul_prec_for, megatron_core_default

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
    for name, value in values.items():
        if isinstance(value, str) and value in DTYPE_NAMES:  # 'bf16' -> torch.bfloat16, as Megatron-LM maps them
            import torch

            values[name] = getattr(torch, DTYPE_NAMES[value])
    if values.get("muon_fp32_matmul_prec", "") is None:
        # Chosen for the device, not by the user: an emerging optimizer's own default precision stays.
        values["muon_fp32_matmul_prec"] = megatron_core_default(fp32_matmul_prec_for(_device_or_default(device))[0])
    return OptimizerConfig(**values)


def matmul_precision_line(args: argparse.Namespace, device: Optional[torch.device] = None) -> Optional[str]:
    """The line to print when `--muon-fp32-matmul-prec` was left to the hardware, else None
    (also for adam/sgd, which have no use for it)."""
    if getattr(args, "muon_fp32_matmul_prec", "") is not None or getattr(args, "optimizer", None) in ("adam", "sgd"):
        return None
    from megatron_eopt.config.optimizer_config import fp32_matmul_prec_for

    value, why = fp32_matmul_prec_for(_device_or_default(device))
    return f"--muon-fp32-matmul-prec not given: using {value!r} ({why}); pass it to choose."


def _device_or_default(device: Optional[torch.device]) -> torch.device:
    import torch

    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
