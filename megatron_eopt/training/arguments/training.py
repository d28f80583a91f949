"""Training-length, schedule, checkpoint and precision flags: checks and the lr schedule's SchedulerConfig."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable, Optional

from arguments import (
    refuse_flags_without,
)
from megatron_eopt.config.scheduler import SchedulerConfig
from megatron_eopt.training.arguments.device import Device
from megatron_eopt.training.arguments.flags.table import replaced, settings_from_flags
from megatron_eopt.training.arguments.flags.training import DEFAULT_TRAIN_ITERS
from megatron_eopt.training.arguments.loop import check_eval_flags, check_housekeeping_flags
from megatron_eopt.training.arguments.no_effect import check_not_offered
from megatron_eopt.training.loop.run_control import (
    check_run_control_flags,
)


def check_training_flags(args: argparse.Namespace, device: Device) -> dict[str, Any]:
    """Check the training flags; returns the defaults they resolve (train_iters, min_lr, the
    gradient precision, WSD's decay style, --exit-signal's, the NaN check's); the lr schedule's SchedulerConfig
    (torch-free) checks its fields, so the same before and after the import."""
    args = replaced(args, train_iters=_training_length(args))
    for name in ("train_iters", "log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}.")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ValueError(f"--ddp-bucket-size must be >= 1; got {args.ddp_bucket_size}.")
    if args.distributed_timeout_minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes must be > 0; got {args.distributed_timeout_minutes}.")
    check_not_offered(args)
    if args.context_parallel_size != 1:
        raise ValueError(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                         f"offered by this trainer (only 1).")
    check_housekeeping_flags(args)
    if args.calculate_per_token_loss and args.num_experts is not None:
        raise ValueError("--calculate-per-token-loss with --num-experts is not offered (megatron-core scales the "
                         "MoE aux loss differently under it).")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ValueError(f"--exit-interval must be >= 1; got {args.exit_interval}.")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ValueError(f"--exit-duration-in-mins must be > 0; got {args.exit_duration_in_mins}.")
    if args.lr is None:
        raise ValueError("--lr is required (the peak learning rate).")
    # Megatron-LM's: with --fp16 and a dynamic loss scale a NaN is the loss scaler's signal to skip the step.
    args = replaced(args, min_lr=0.0 if args.min_lr is None else args.min_lr,
                    accumulate_allreduce_grads_in_fp32=_gradient_precision(args),
                    check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad and not (
                        args.fp16 and not args.loss_scale))
    check_eval_flags(args)
    args = replaced(args, **check_run_control_flags(args))
    _check_document_flags(args, device)
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        raise ValueError(f"--save-interval needs --save and must be >= 1; got {args.save_interval}.")
    if args.ckpt_step is not None and not args.load:
        raise ValueError("--ckpt-step needs --load.")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler (this run's lr schedule) and "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude each other; give one.")
    _check_fsdp2_flags(args)
    _check_megatron_fsdp_flags(args)
    if args.plot and not args.plot.endswith(".png"):
        raise ValueError(f"--plot writes a PNG; give a path ending in .png, got {args.plot!r}.")
    args = replaced(args, lr_wsd_decay_style=_check_wsd_flags(args))
    _check_weight_decay_flags(args)
    if args.lr_warmup_init > args.lr:
        raise ValueError(f"--lr-warmup-init {args.lr_warmup_init} must not exceed --lr {args.lr}.")
    try:
        scheduler_config(args)
    except (TypeError, ValueError) as error:  # SchedulerConfig's field names -> this script's flags
        raise ValueError(re.sub(r"SchedulerConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                                str(error))) from None
    return {name: getattr(args, name) for name in ("train_iters", "min_lr", "accumulate_allreduce_grads_in_fp32",
                                                   "lr_wsd_decay_style", "exit_signal", "check_for_nan_in_loss_and_grad")}


def _check_document_flags(args: argparse.Namespace, device: Device) -> None:
    """--reset-position-ids / --reset-attention-mask run through the one-stage forward, which
    passes the per-document positions and mask to the model (megatron_eopt/training/parallel/pipeline.py's SingleStage)."""
    given = [flag for flag, on in (("--reset-position-ids", args.reset_position_ids),
                                   ("--reset-attention-mask", args.reset_attention_mask)) if on]
    if given and args.pipeline_model_parallel_size > 1:
        raise ValueError(f"{given[0]} needs --pipeline-model-parallel-size 1: the pipeline's stages here pass "
                         f"each other hidden states only (torch.distributed.pipelining), not the per-document "
                         f"positions and mask.")
    if args.reset_attention_mask and device.te_on_cuda is True and args.transformer_impl != "local":
        raise ValueError("--reset-attention-mask with Transformer Engine is not offered: its attention is built "
                         "with the causal mask type, which does not apply a per-document mask; add "
                         "--transformer-impl local.")


def document_lines(args: argparse.Namespace) -> list[str]:
    if args.reset_position_ids and args.position_embedding_type != "learned_absolute":
        return [f"--reset-position-ids: no effect with --position-embedding-type {args.position_embedding_type}: "
                f"megatron-core's GPTModel reads position ids only for learned absolute position embeddings (RoPE "
                f"rotates by the position in the sequence), as in Megatron-LM"]
    return []


def _gradient_precision(args: argparse.Namespace) -> bool:
    """--accumulate-allreduce-grads-in-fp32 resolved. Megatron-LM: with --bf16, gradients are
    accumulated and all-reduced in fp32 unless --grad-reduce-in-bf16 or --main-grads-dtype bf16."""
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 only applies with --bf16.")
    bf16_grads = getattr(args, "main_grads_dtype", "fp32") in ("bf16", "bfloat16")
    if bf16_grads and not args.bf16:
        raise ValueError("--main-grads-dtype bf16 only applies with --bf16.")
    if args.bf16:
        return not (args.grad_reduce_in_bf16 or bf16_grads)
    return args.accumulate_allreduce_grads_in_fp32


_ITERATION_SCHEDULE_FLAGS = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")


_SAMPLE_SCHEDULE_FLAGS = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")


def _training_length(args: argparse.Namespace) -> int:
    """--train-iters or --train-samples (Megatron-LM: then train_samples // global batch
    iterations, and the schedule flags count samples); returns the iterations either way."""
    def given(names: tuple[str, ...]) -> list[str]:
        return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name)]

    if args.train_samples is None:
        if given(_SAMPLE_SCHEDULE_FLAGS):
            raise ValueError(f"{given(_SAMPLE_SCHEDULE_FLAGS)[0]} needs --train-samples (with --train-iters the "
                             f"schedule counts iterations: --lr-decay-iters, --lr-warmup-iters, ...).")
        return DEFAULT_TRAIN_ITERS if args.train_iters is None else args.train_iters
    if args.train_iters is not None:
        raise ValueError("--train-iters and --train-samples both set the training length; give one.")
    if given(_ITERATION_SCHEDULE_FLAGS):
        raise ValueError(f"{given(_ITERATION_SCHEDULE_FLAGS)[0]} counts iterations; with --train-samples the "
                         f"schedule counts samples (--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples).")
    if args.train_samples < args.global_batch_size:
        raise ValueError(f"--train-samples {args.train_samples} must be >= --global-batch-size "
                         f"{args.global_batch_size} (one iteration).")
    return args.train_samples // args.global_batch_size


@dataclasses.dataclass(frozen=True)
class EngineRefusal:
    """A combination a sharding engine refuses before anything is built. `example`: flags that give it
    beside the engine's flag, the refused one first; docs/trainer.md lists each engine's examples, and
    tests/unit/training/test_engine_refusals.py runs them and keeps the list and this table equal.
    `what` is formatted with the namespace (`args`) and the QK-clip flags given (`qk_clip`)."""
    example: str
    what: str
    given: Callable[[argparse.Namespace], bool]


FSDP2_REFUSALS = (
    EngineRefusal("--use-distributed-optimizer", "--use-distributed-optimizer (FSDP2 shards the optimizer state "
                  "already)", lambda args: args.use_layer_wise_distributed_optimizer),
    EngineRefusal("--log-params-norm", "--log-params-norm", lambda args: args.log_params_norm),
    EngineRefusal("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size > 1",
                  lambda args: args.pipeline_model_parallel_size > 1),
    EngineRefusal("--fp16", "--fp16 (loss scaling of DTensor shards is not implemented)", lambda args: args.fp16),
    EngineRefusal("--main-params-dtype bf16 --bf16 --use-precision-aware-optimizer --no-store-param-remainders",
                  "--main-params-dtype other than fp32 (FSDP2's fp32 shards are the main weights; --exp-avg-dtype and "
                  "--exp-avg-sq-dtype apply)",
                  lambda args: getattr(args, "main_params_dtype", None) not in (None, "fp32")),  # None: fp32
    EngineRefusal("--qk-clip --tensor-model-parallel-size 2", "{qk_clip} with --tensor-model-parallel-size > 1 "
                  "(fully_shard drops the attributes that say which weights TP splits by heads; QK-clip works on "
                  "FSDP2 at TP=1)", lambda args: bool(_qk_clip_flags(args)) and args.tensor_model_parallel_size > 1),
    EngineRefusal("--num-experts 4 --tensor-model-parallel-size 2", "--num-experts with --tensor-model-parallel-size "
                  "> 1 (the experts' own mesh is 1-D, expert data parallel; use TP 1 with experts on FSDP2)",
                  lambda args: args.num_experts is not None and args.tensor_model_parallel_size > 1),
)

MEGATRON_FSDP_REFUSALS = (
    EngineRefusal("--data-parallel-sharding-strategy optim_grads", "--data-parallel-sharding-strategy other than "
                  "optim_grads_params (given {args.data_parallel_sharding_strategy}; only ZeRO-3 gives the optimizer "
                  "sharded parameters)", lambda args: args.data_parallel_sharding_strategy != "optim_grads_params"),
    EngineRefusal("--use-torch-fsdp2", "--use-torch-fsdp2 (one sharding engine at a time)",
                  lambda args: args.use_torch_fsdp2),
    EngineRefusal("--tensor-model-parallel-size 2", "--tensor-model-parallel-size > 1 (TP x FSDP works with "
                  "--use-torch-fsdp2)", lambda args: args.tensor_model_parallel_size > 1),
    EngineRefusal("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size > 1",
                  lambda args: args.pipeline_model_parallel_size > 1),
    EngineRefusal("--use-distributed-optimizer", "--use-distributed-optimizer (Megatron-FSDP shards the optimizer "
                  "state already)", lambda args: args.use_layer_wise_distributed_optimizer),
    EngineRefusal("--fp16", "--fp16 (fp16 loss scaling is not implemented for the sharded engines; train with --bf16)",
                  lambda args: args.fp16),
    EngineRefusal("--log-params-norm", "--log-params-norm", lambda args: args.log_params_norm),
)

# Each engine's flag, its refusals, and how its message ends (FSDP2's may be lifted).
ENGINE_REFUSALS = {"--use-torch-fsdp2": (FSDP2_REFUSALS, " yet."), "--use-megatron-fsdp": (MEGATRON_FSDP_REFUSALS, ".")}


def _check_fsdp2_flags(args: argparse.Namespace) -> None:
    if args.use_torch_fsdp2:
        _refuse_engine_combinations("--use-torch-fsdp2", args)


def _check_megatron_fsdp_flags(args: argparse.Namespace) -> None:
    if args.use_megatron_fsdp:
        _refuse_engine_combinations("--use-megatron-fsdp", args)
    elif args.data_parallel_sharding_strategy != "optim_grads_params":  # Megatron-LM's default
        raise ValueError(f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} needs "
                         f"--use-megatron-fsdp.")


def _refuse_engine_combinations(engine: str, args: argparse.Namespace) -> None:
    refusals, ending = ENGINE_REFUSALS[engine]
    for refusal in refusals:
        if refusal.given(args):
            what = refusal.what.format(args=args, qk_clip=_qk_clip_flags(args))
            raise ValueError(f"{engine} does not support {what}{ending}")


def _qk_clip_flags(args: argparse.Namespace) -> str:
    return " and ".join(flag for flag, on in (("--qk-clip", args.qk_clip),
                                              ("--log-max-attention-logit", args.log_max_attention_logit)) if on)


def _check_wsd_flags(args: argparse.Namespace) -> Optional[str]:
    """Checks; returns --lr-wsd-decay-style (Megatron-LM's default exponential with WSD)."""
    if args.lr_decay_style != "WSD":
        given = [f"--{name.replace('_', '-')}" for name in ("lr_wsd_decay_iters", "lr_wsd_decay_style")
                 if getattr(args, name) is not None]
        refuse_flags_without(given, f"--lr-decay-style WSD (got --lr-decay-style {args.lr_decay_style})")
        return args.lr_wsd_decay_style
    decay_iters = args.lr_decay_iters or args.train_iters
    if args.train_samples is None and args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_iters > decay_iters:
        raise ValueError(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} must not exceed the decay's "
                         f"{decay_iters} iterations (--lr-decay-iters, default --train-iters).")
    return args.lr_wsd_decay_style or "exponential"  # Megatron-LM's default


def _check_weight_decay_flags(args: argparse.Namespace) -> None:
    """Megatron-LM's rule: a growing weight decay names both ends, a constant one is --weight-decay."""
    style = args.weight_decay_incr_style
    ends = [flag for flag, value in (("--start-weight-decay", args.start_weight_decay),
                                     ("--end-weight-decay", args.end_weight_decay)) if value is not None]
    if style == "constant":
        refuse_flags_without(ends, "--weight-decay-incr-style linear or cosine (constant keeps --weight-decay)")
    elif len(ends) < 2:
        raise ValueError(f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay.")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """Megatron-LM's schedule flags, matched to SchedulerConfig's fields by name;
    megatron_eopt.integrations.megatron_bridge turns iterations into samples. With --train-samples
    the schedule counts samples only."""
    samples = args.train_samples is not None
    return settings_from_flags(args, SchedulerConfig, dict(
        lr_wsd_decay_style=args.lr_wsd_decay_style or "exponential",
        train_iters=None if samples else args.train_iters,
        lr_warmup_samples=args.lr_warmup_samples or 0,
    ))
