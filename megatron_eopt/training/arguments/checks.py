"""The checks of parse_args (arguments/parser.py), in one order, run twice: `check_flags_before_import`
before torch and megatron-core are imported, with what is known then (arguments/device.py), and
`check_flags` after, with the installed optimizers, torch's device and Transformer Engine; errors
exit every rank with one line. This module imports neither torch nor megatron-core."""

import argparse

from arguments import (
    optimizer_config_from_args,
    validate_args,
)
from arguments.optimizer_args import resolve_optimizer_flags
from arguments.validate import check_before_import, flag_message
from megatron_eopt.config.rules import check_values
from megatron_eopt.training.arguments.data import check_data_flags
from megatron_eopt.training.arguments.device import Device, device_after_import, device_before_import
from megatron_eopt.training.arguments.flags.table import replaced
from megatron_eopt.training.arguments.loop import check_performance_flags
from megatron_eopt.training.arguments.model import (
    check_device_flags,
    model_defaults,
    model_settings,
    with_experts,
)
from megatron_eopt.training.arguments.training import check_training_flags
from megatron_eopt.training.data.batch_schedule import (
    BatchSchedule,
    check_batch_schedule_flags,
    check_batch_sizes,
    schedule_steps,
)
from megatron_eopt.training.errors import exit_with_error
from megatron_eopt.training.model.settings import GPTModelSettings
from megatron_eopt.training.parallel.layout import Layout, job_layout


def check_flags_before_import(parsed: argparse.Namespace) -> None:
    """Every check that needs neither torch nor megatron-core nor the installed optimizers, on
    what argparse made; errors exit with one line. What only the import can tell (the device's
    CUDA and Transformer Engine, the optimizers' defaults) is None here, and the checks that
    need it pass now and decide in `check_flags`."""
    try:
        stand_in = _optimizer_stand_in(parsed)
        # The optimizer's flags first, as after the import (_optimizer_flags): OptimizerConfig's
        # rules on the flags given, in its words with the fields spelled as flags.
        try:
            check_values(stand_in)
        except ValueError as error:
            raise ValueError(flag_message(str(error))) from None
        check_before_import(stand_in)  # validate_args' refusals that need no installed optimizer
        _resolve(stand_in, device_before_import(parsed), imported=False)
    except ValueError as error:
        exit_with_error(str(error))


def check_flags(parsed: argparse.Namespace) -> tuple[argparse.Namespace, GPTModelSettings, Layout]:
    """Check every flag before any process group exists; errors exit with one line.

    Each step checks (raising ValueError) and returns the values it resolves; they go into a new
    namespace, so `parsed` stays as argparse made it."""
    try:
        args = _optimizer_flags(parsed)
        return _resolve(args, device_after_import(args), imported=True)
    except ValueError as error:
        exit_with_error(str(error))


def _optimizer_flags(parsed: argparse.Namespace) -> argparse.Namespace:
    # validate_args rewrites the deprecated optimizer spellings on the namespace it is given (the
    # library's contract with Megatron-LM): here a copy with the optimizer's defaults resolved.
    args = validate_args(resolve_optimizer_flags(parsed), parsed.tensor_model_parallel_size, wraps_fully_shard=True)
    # The layer-wise optimizer reduces gradients onto their owners itself, unless the bucketed
    # all-reduce overlapped with backward (--overlap-grad-reduce) has averaged them already.
    args = replaced(args, layer_wise_reduce_grads=args.use_layer_wise_distributed_optimizer and not args.overlap_grad_reduce)
    optimizer_config_from_args(args)
    return args


def _optimizer_stand_in(parsed: argparse.Namespace) -> argparse.Namespace:
    """Before the import the optimizer's flags not given are None (their defaults are read from
    the installed OptimizerConfig); the trainer's checks read these, as validate_args leaves them."""
    layer_wise = bool(parsed.use_layer_wise_distributed_optimizer or parsed.use_distributed_optimizer
                      or parsed.optimizer == "dist_muon")
    return replaced(parsed, use_layer_wise_distributed_optimizer=layer_wise, use_distributed_optimizer=False,
                    layer_wise_reduce_grads=layer_wise and not parsed.overlap_grad_reduce,
                    **{name: bool(getattr(parsed, name)) for name in ("bf16", "fp16", "qk_clip",
                                                                      "log_max_attention_logit")})


def _resolve(args: argparse.Namespace, device: Device, imported: bool
             ) -> tuple[argparse.Namespace, GPTModelSettings, Layout]:
    check_device_flags(args, device)
    args = replaced(args, global_batch_size=check_batch_schedule_flags(args))  # a step schedule sets it
    layout = job_layout(args)
    args = replaced(args, global_batch_size=args.micro_batch_size * layout.dp * layout.grad_accumulation_steps)
    args = replaced(args, **check_data_flags(args))
    args = replaced(args, **model_defaults(args, layout.tp, say=imported))
    settings = model_settings(args, layout.tp, device)
    args, layout, settings = with_experts(args, layout, settings, device)
    args = replaced(args, **check_training_flags(args, device))
    if imported:
        schedule = BatchSchedule(args, args.micro_batch_size * layout.dp)
        args = replaced(args, batch_schedule=schedule, train_iters=schedule.train_iters or args.train_iters)
    else:  # megatron-core's calculator lists the batches; their sizes are checked now
        check_batch_sizes(args, schedule_steps(args), args.micro_batch_size * layout.dp)
    return replaced(args, **check_performance_flags(args, layout.world_size)), settings, layout
