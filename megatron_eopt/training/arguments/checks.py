"""The checks of parse_args that need torch, megatron-core or the installed optimizers, run after
the flags are parsed (arguments/parser.py); errors exit every rank with one line."""

import argparse

from megatron_eopt.arguments import (
    optimizer_config_from_args,
    validate_args,
)
from megatron_eopt.arguments.optimizer_args import resolve_optimizer_flags
from megatron_eopt.training.arguments.flags.table import replaced
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
)
from megatron_eopt.training.data.datasets import check_data_flags
from megatron_eopt.training.errors import exit_with_error
from megatron_eopt.training.logging.performance import check_performance_flags
from megatron_eopt.training.model.gpt import GPTModelSettings
from megatron_eopt.training.parallel.layout import Layout, job_layout


def check_flags(parsed: argparse.Namespace) -> tuple[argparse.Namespace, GPTModelSettings, Layout]:
    """Check every flag before any process group exists; errors exit with one line.

    Each step checks (raising ValueError) and returns the values it resolves; they go into a new
    namespace, so `parsed` stays as argparse made it."""
    try:
        return _resolve(parsed)
    except ValueError as error:
        exit_with_error(str(error))


def _resolve(parsed: argparse.Namespace) -> tuple[argparse.Namespace, GPTModelSettings, Layout]:
    # validate_args rewrites the deprecated optimizer spellings on the namespace it is given (the
    # library's contract with Megatron-LM): here a copy with the optimizer's defaults resolved.
    args = validate_args(resolve_optimizer_flags(parsed), parsed.tensor_model_parallel_size, wraps_fully_shard=True)
    # The layer-wise optimizer reduces gradients onto their owners itself, unless the bucketed
    # all-reduce overlapped with backward (--overlap-grad-reduce) has averaged them already.
    args = replaced(args, layer_wise_reduce_grads=args.use_layer_wise_distributed_optimizer and not args.overlap_grad_reduce)
    optimizer_config_from_args(args)
    check_device_flags(args)
    args = replaced(args, global_batch_size=check_batch_schedule_flags(args))  # a step schedule sets it
    layout = job_layout(args)
    args = replaced(args, global_batch_size=args.micro_batch_size * layout.dp * layout.grad_accumulation_steps)
    args = replaced(args, **check_data_flags(args))
    args = replaced(args, **model_defaults(args, layout.tp))
    settings = model_settings(args, layout.tp)
    args, layout, settings = with_experts(args, layout, settings)
    args = replaced(args, **check_training_flags(args))
    schedule = BatchSchedule(args, args.micro_batch_size * layout.dp)
    args = replaced(args, batch_schedule=schedule, train_iters=schedule.train_iters or args.train_iters)
    return replaced(args, **check_performance_flags(args, layout.world_size)), settings, layout
