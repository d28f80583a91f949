"""Pretrain a megatron-core GPTModel with megatron_eopt's optimizer: Megatron-LM's flags.

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --optimizer muon --use-distributed-optimizer --lr 3e-3 --min-lr 3e-4 --train-iters 100

`python scripts/pretrain_gpt.py ...` runs one process. Tensor parallelism comes from
`--tensor-model-parallel-size`, pipeline parallelism from `--pipeline-model-parallel-size` (with
virtual stages and uneven splits; scripts/pipeline.py runs the schedule); the rest of the world is
data parallelism. gloo on CPU, NCCL on
CUDA. Each iteration's global batch is drawn from `--seed` and the iteration number and each
data-parallel rank trains on its slice of it, so every TP/DP layout sees the same global batch.
Gradients are averaged over data-parallel ranks by the layer-wise optimizer when it is on
(`layer_wise_reduce_grads`), else here in buckets (scripts/grad_reduction.py); the step scales
each micro-batch's loss by 1 / (gradient-accumulation steps), so the update follows the
global-batch mean loss (scripts/token_loss.py: `--eod-mask-loss` leaves out end-of-document labels,
`--calculate-per-token-loss` averages over the global batch's tokens instead). The global batch
can grow (scripts/batch_schedule.py: `--rampup-batch-size`, `--step-batch-size-schedule`). A NaN
loss or gradient stops the run, as in Megatron-LM, unless `--no-check-for-nan-in-loss-and-grad`.
`--fp16` trains an fp16 model whose loss is multiplied by the optimizer's
loss scale (dynamic unless `--loss-scale`): an overflow skips the step and backs the scale off.
`--bf16` trains a bf16 model whose gradients are summed over micro-batches and all-reduced in fp32
(`param.main_grad`, Megatron-LM's `--accumulate-allreduce-grads-in-fp32`, implied by `--bf16`).

Data (scripts/data.py): the generated rule language by default, or Megatron-LM's
`--data-path [W1] PREFIX1 ...` (indexed datasets from tools/preprocess_data.py) with `--split`,
`--tokenizer-type` (scripts/tokenizer.py), or `--mock-data`. Validation every `--eval-interval`
iterations and at the end, then test if the split has one (scripts/evaluation.py). Logging
(scripts/training_log.py): rank 0 prints Megatron-LM's iteration line every `--log-interval`
iterations; `--tensorboard-dir` writes Megatron-LM's TensorBoard scalars, `--metrics-jsonl` one
JSON object per logged line, `--plot` the loss curve as a PNG; on a terminal rank 0 also redraws
a progress bar. `--log-throughput` and `--profile` (scripts/performance.py) add Megatron-LM's
TFLOP/s per GPU to the line and profile a range of iterations; `--manual-gc` and
`--empty-unused-memory-level` are scripts/housekeeping.py's. Model and schedule flags keep
Megatron-LM's meaning and defaults where this trainer has them (tied embeddings, linear biases, LayerNorm, `--swiglu`'s FFN size, GQA only
with `--group-query-attention`); dropout defaults to 0 here (so layouts can be compared exactly).
An invalid flag, or a combination the
optimizer factory refuses, exits every rank with status 2 after one line on rank 0's stderr naming
the flags (torchrun then adds its own failure summary).

Mixture of experts (scripts/moe.py; flags in scripts/moe_flags.py): `--num-experts` makes the MLPs
megatron-core's MoELayer (`--moe-layer-freq` says which; router, load-balancing, shared-expert and
capacity flags with Megatron-LM's names, passed to megatron-core's TransformerConfig), its experts split
over `--expert-model-parallel-size` of the data-parallel ranks; expert gradients are summed over
the expert data-parallel group and divided by the data-parallel size, as megatron-core's DDP does.
With `--tensor-model-parallel-size` > 1 it needs `--sequence-parallel` (as megatron-core): the
experts' linears are split over the TP ranks, the tokens gathered over TP x EP, and the router's
gradient summed over TP with the other sequence-parallel parameters.

Checkpoints (megatron_eopt.checkpointing): `--save DIR` every `--save-interval` iterations and
after the last one; `--load DIR` resumes from its latest checkpoint (or `--ckpt-step N`), also
at another TP/DP layout, with or without the distributed optimizer, in bf16 or fp32;
`--no-load-optim` loads the model only (to change optimizers; as in Megatron-LM the lr schedule
then starts again from step 0 while the iteration count continues, and the run says where that
schedule ends). A changed lr schedule (--lr, --min-lr, --train-iters, warmup/decay flags) is
refused before anything is loaded unless `--override-opt_param-scheduler` (this run's schedule)
or `--use-checkpoint-opt_param-scheduler` (the checkpoint's) says which to keep. A `--load`
directory that does not exist or holds no checkpoint starts from scratch (so `--save X --load X`
works from the first run); one without `latest` resumes from its newest complete checkpoint.
Data follows the iteration, so a resumed run continues exactly where the saved one was.
"""

import argparse
import copy
import dataclasses
import datetime
import itertools
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, TextIO

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arguments import (  # noqa: E402
    add_optimizer_args,
    matmul_precision_line,
    optimizer_config_from_args,
    refuse_flags_without,
    validate_args,
)
from megatron_eopt import get_megatron_optimizer  # noqa: E402
from megatron_eopt.bridge import SchedulerConfig, get_scheduler  # noqa: E402
from megatron_eopt.checkpointing import has_checkpoints, load_checkpoint, save_checkpoint  # noqa: E402
from scripts.batch_schedule import BatchSchedule, add_batch_schedule_args, check_batch_schedule_flags  # noqa: E402
from scripts.data import (  # noqa: E402
    DEFAULT_RULE_VOCAB_SIZE,
    SampleCounts,
    add_data_args,
    build_data_source,
    check_data_flags,
    document_inputs,
    model_vocab_size,
)
from scripts.evaluation import Evaluator, add_eval_args, check_eval_flags  # noqa: E402
from scripts.gpt_model import (  # noqa: E402
    GPTModelSettings,
    SettingsError,
    build_gpt_model_chunks,
    destroy_model_parallel,
    initialize_model_parallel,
    transformer_engine_at_least,
)
from scripts.grad_reduction import BUCKET_NUMEL, GradReducer, finalize_model_grads, nan_in_grads  # noqa: E402
from scripts.housekeeping import Housekeeping, add_housekeeping_args, check_housekeeping_flags  # noqa: E402
from scripts.mla_flags import add_mla_args, mla_settings  # noqa: E402
from scripts.moe import finish_router_step, start_step, step_moe_losses  # noqa: E402
from scripts.moe_flags import (  # noqa: E402
    add_moe_args,
    check_moe_flags,
    describe_moe,
    logged_moe_losses,
    moe_layer_pattern,
    moe_note_lines,
    moe_settings,
)
from scripts.no_effect_flags import add_no_effect_args, check_not_offered, no_effect_lines  # noqa: E402
from scripts.performance import (  # noqa: E402
    Profiler,
    add_performance_args,
    check_performance_flags,
    flops_per_iteration,
    performance_lines,
)
from scripts.pipeline import Pipeline, SingleStage, add_pipeline_args, pipeline_layout  # noqa: E402
from scripts.run_control import (  # noqa: E402
    ExitSignal,
    add_run_control_args,
    check_run_control_flags,
    run_control_lines,
)
from scripts.token_loss import TokenLoss  # noqa: E402
from scripts.tokenizer import add_tokenizer_args  # noqa: E402
from scripts.training_log import (  # noqa: E402
    PALETTE,
    Curve,
    Logger,
    Step,
    add_logging_args,
    params_norm,
    plot_curves,
    tensorboard_option_lines,
)


# ------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------


PROG = "pretrain_gpt.py"
DEFAULT_TRAIN_ITERS = 100
# How long another rank that fails waits before exiting, so that rank 0 (which fails alike) has
# printed the error first: torchrun stops every worker as soon as one exits non-zero, and a rank 1
# that exited first could get rank 0 killed before it says why. Under torchrun the wait ends when
# rank 0 exits; it covers the ranks' difference in start-up time (seconds) with a wide margin.
OTHER_RANKS_WAIT_S = 60.0


def is_rank_zero() -> bool:
    """From torchrun's environment, so it holds before any process group exists (or from the
    process group a caller already made, see `main`)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def exit_with_error(message: str) -> NoReturn:
    """One line on rank 0's stderr, status 2 on every rank (argparse's convention), no traceback:
    every rank parses the same flags and builds the same optimizer, so each rank gets here."""
    _exit_from_any_rank(2, f"{PROG}: error: {' '.join(message.split())}\n")


def _exit_from_any_rank(status: int, message: Optional[str]) -> NoReturn:
    if is_rank_zero():
        if message:
            sys.stderr.write(message)
            sys.stderr.flush()
    elif status:
        time.sleep(OTHER_RANKS_WAIT_S)
    raise SystemExit(status)


class RankZeroArgumentParser(argparse.ArgumentParser):
    """argparse's usage, help and errors printed by rank 0 only; every rank exits alike."""

    def print_usage(self, file: Optional[TextIO] = None) -> None:
        if is_rank_zero():
            super().print_usage(file)

    def print_help(self, file: Optional[TextIO] = None) -> None:
        if is_rank_zero():
            super().print_help(file)

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        _exit_from_any_rank(status, message)


def build_parser() -> argparse.ArgumentParser:
    parser = RankZeroArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    model = parser.add_argument_group(title="model")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--group-query-attention", action="store_true",
                       help="grouped-query attention with --num-query-groups key/value groups")
    model.add_argument("--num-query-groups", type=int, default=None,
                       help="with --group-query-attention (default then: 1)")
    model.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="default: 4 * hidden size; with --swiglu int(8 * hidden size / 3 / 64) * 64")
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--squared-relu", action="store_true", help="the MLP's activation is relu(x)^2")
    model.add_argument("--quick-geglu", action="store_true",
                       help="the MLP is a gated unit with quick GELU, x * sigmoid(1.702 x)")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="a separate output layer (default: it shares the input embedding's weight)")
    model.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    model.add_argument("--add-qkv-bias", action="store_true",
                       help="with --disable-bias-linear: biases on the QKV projection only")
    model.add_argument("--norm-epsilon", type=float, default=1e-5,
                       help="the epsilon of every LayerNorm/RMSNorm")
    model.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    model.add_argument("--hidden-dropout", type=float, default=0.0,
                       help="default 0 (Megatron-LM's is 0.1): layouts then train identically")
    model.add_argument("--attention-dropout", type=float, default=0.0,
                       help="default 0 (Megatron-LM's is 0.1): layouts then train identically")
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--embedding-init-method-std", type=float, default=None,
                       help="the embeddings' N(0, std) (default: --init-method-std)")
    model.add_argument("--init-method-xavier-uniform", action="store_true",
                       help="draw every weight from Xavier's uniform distribution instead of N(0, --init-method-std)")
    model.add_argument("--position-embedding-type", default="learned_absolute",
                       choices=("learned_absolute", "rope", "none"))
    model.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Megatron-LM's deprecated spelling of --position-embedding-type rope")
    model.add_argument("--rotary-base", type=int, default=None, help="RoPE's base period (default 10000)")
    model.add_argument("--rotary-percent", type=float, default=None,
                       help="the fraction of each head's dimensions RoPE rotates (default 1.0)")
    model.add_argument("--rotary-interleaved", action="store_true",
                       help="RoPE rotates neighbouring pairs of dimensions instead of the two halves of a head")
    model.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="RoPE: positions divided by this (position interpolation)")
    model.add_argument("--use-rope-scaling", action="store_true",
                       help="RoPE: Llama 3.x's frequency scaling (long wavelengths divided by --rope-scaling-factor)")
    model.add_argument("--rope-scaling-factor", type=float, default=None, help="with --use-rope-scaling (default 8)")
    model.add_argument("--kv-channels", type=int, default=None,
                       help="each attention head's width (default: hidden size / attention heads)")
    model.add_argument("--qk-layernorm", action="store_true",
                       help="normalise each head's query and key (--normalization's kind) before attention")
    model.add_argument("--apply-layernorm-1p", action="store_true",
                       help="norms store gamma - 1 (initialised to 0) and scale by weight + 1 "
                            "(megatron's zero-centred gamma)")
    model.add_argument("--seq-length", type=int, default=32)
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    model.add_argument("--vocab-size", type=int, default=None,
                       help=f"the generated task's vocabulary (default {DEFAULT_RULE_VOCAB_SIZE}) or "
                            "NullTokenizer's; with a tokenizer the model's is its vocabulary, padded")
    model.add_argument("--transformer-impl", default=None, choices=("local", "transformer_engine"),
                       help="megatron-core's local layers or Transformer Engine's (CUDA and TE needed); "
                            "default: Transformer Engine on CUDA when installed, else local")
    training = parser.add_argument_group(title="training")
    training.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"),
                          help="default: nccl (one GPU per rank) where CUDA is available, else gloo on CPU; "
                               "gloo runs on CPU even where CUDA is available")
    training.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                          help="how long a collective may wait for the other ranks before failing")
    training.add_argument("--tensor-model-parallel-size", type=int, default=1)
    training.add_argument("--context-parallel-size", type=int, default=1,
                          help="only 1 here: context parallelism is not offered")
    training.add_argument("--sequence-parallel", action="store_true",
                          help="split the activations outside attention and the MLP along the sequence over "
                               "the tensor-parallel ranks (off at TP 1, as in Megatron-LM)")
    add_pipeline_args(parser)
    training.add_argument("--use-torch-fsdp2", action="store_true",
                          help="shard the model with torch FSDP2 (fully_shard each transformer layer, then "
                               "the root) over the data-parallel ranks (of each TP rank, with TP > 1); with "
                               "--bf16 the sharded parameters and the optimizer stay fp32 and FSDP2 computes in "
                               "bf16 (MixedPrecisionPolicy: bf16 parameters in forward/backward, gradients "
                               "reduced in fp32)")
    training.add_argument("--micro-batch-size", type=int, default=4)
    training.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch * DP")
    add_batch_schedule_args(parser)
    training.add_argument("--train-iters", type=int, default=None,
                          help=f"default {DEFAULT_TRAIN_ITERS} (without --train-samples)")
    training.add_argument("--train-samples", type=int, default=None,
                          help="train on this many samples (--train-samples // --global-batch-size iterations); "
                               "the lr schedule then counts samples (--lr-decay-samples, --lr-warmup-samples, "
                               "--lr-wsd-decay-samples)")
    training.add_argument("--exit-interval", type=int, default=None, help="stop after an iteration divisible by this")
    training.add_argument("--exit-duration-in-mins", type=float, default=None,
                          help="stop (saving first, with --save) after the iteration that ends past this many "
                               "minutes of training, on every rank together")
    training.add_argument("--lr-decay-style", default="linear",
                          choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    training.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    training.add_argument("--lr-warmup-iters", type=int, default=0)
    training.add_argument("--lr-warmup-fraction", type=float, default=None,
                          help="warmup over this fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    training.add_argument("--lr-warmup-init", type=float, default=0.0, help="the lr warmup starts from")
    training.add_argument("--lr-wsd-decay-style", default=None,
                          choices=("exponential", "linear", "cosine", "minus_sqrt"),
                          help="the decay phase of --lr-decay-style WSD (default: exponential)")
    training.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                          help="length of WSD's decay phase (needed with --lr-decay-style WSD)")
    training.add_argument("--lr-decay-samples", type=int, default=None, help="with --train-samples (default: it)")
    training.add_argument("--lr-warmup-samples", type=int, default=None, help="with --train-samples (default 0)")
    training.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                          help="with --train-samples and --lr-decay-style WSD")
    training.add_argument("--start-weight-decay", type=float, default=None,
                          help="with --weight-decay-incr-style linear or cosine: the weight decay at the start")
    training.add_argument("--end-weight-decay", type=float, default=None,
                          help="with --weight-decay-incr-style linear or cosine: the weight decay at the end of "
                               "training (it grows over all --train-iters or --train-samples)")
    training.add_argument("--weight-decay-incr-style", default="constant", choices=("constant", "linear", "cosine"),
                          help="constant: --weight-decay throughout")
    training.add_argument("--seed", type=int, default=1234)
    training.add_argument("--recompute-activations", action="store_true",
                          help="recompute each layer's core attention in backward instead of keeping its "
                               "activations (--recompute-granularity selective)")
    training.add_argument("--recompute-granularity", default=None, choices=("full", "selective"),
                          help="full: recompute whole layers (with --recompute-method and --recompute-num-layers); "
                               "selective: the core attention")
    training.add_argument("--recompute-method", default=None, choices=("uniform", "block"),
                          help="with --recompute-granularity full: uniform recomputes groups of "
                               "--recompute-num-layers layers, block the first --recompute-num-layers of each stage")
    training.add_argument("--recompute-num-layers", type=int, default=None)
    training.add_argument("--recompute-modules", nargs="*", default=None, choices=RECOMPUTE_MODULES,
                          help="with selective recompute: the submodules recomputed in backward (default: "
                               "core_attn; moe with --num-experts)")
    training.add_argument("--distribute-saved-activations", action="store_true",
                          help="with full recompute at TP > 1: split each checkpointed layer input over the "
                               "tensor-parallel ranks (CUDA only: megatron gathers it into a CUDA buffer)")
    training.add_argument("--overlap-grad-reduce", action="store_true",
                          help="start each gradient bucket's data-parallel all-reduce during the last "
                               "micro-batch's backward, as soon as its gradients are complete (with "
                               "--use-distributed-optimizer the optimizer then takes averaged gradients "
                               "instead of reducing onto owners; FSDP2 overlaps its reduce-scatter already)")
    training.add_argument("--ddp-bucket-size", type=int, default=None,
                          help=f"elements per gradient all-reduce bucket (default {BUCKET_NUMEL})")
    training.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                          help="sum micro-batch gradients and all-reduce them over data-parallel ranks in "
                               "fp32 (param.main_grad); always on with --bf16, as in Megatron-LM; "
                               "no effect on an fp32 model, whose gradients are fp32 already")
    training.add_argument("--calculate-per-token-loss", action="store_true",
                          help="the step's loss is the sum of the global batch's token losses over their number "
                               "(over micro-batches and data-parallel ranks), not a mean of micro-batch means "
                               "(the same without --eod-mask-loss)")
    training.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                          dest="check_for_nan_in_loss_and_grad",
                          help="a NaN loss or gradient norm skips the step (counted in the log line) instead of "
                               "stopping the run with an error (Megatron-LM's default)")
    training.add_argument("--grad-reduce-in-bf16", action="store_true",
                          help="with --bf16: sum micro-batch gradients and all-reduce them in bf16 (the "
                               "parameters' dtype) instead of fp32")
    checkpointing = parser.add_argument_group(title="checkpointing")
    checkpointing.add_argument("--save", default=None, help="directory to save checkpoints in")
    checkpointing.add_argument("--save-interval", type=int, default=None,
                               help="save every this many iterations (and after the last one)")
    checkpointing.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    checkpointing.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    checkpointing.add_argument("--no-load-optim", action="store_true",
                               help="load the model only (fresh optimizer; the lr schedule starts again at step 0)")
    checkpointing.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                               action="store_true",
                               help="resuming: keep this run's lr schedule (lr, min lr, warmup and decay "
                                    "iters, decay style, weight decay), not the checkpoint's; the step "
                                    "count still comes from the checkpoint")
    checkpointing.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                               action="store_true",
                               help="resuming: take the lr schedule from the checkpoint, ignoring this "
                                    "run's schedule flags")
    checkpointing.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    checkpointing.add_argument("--no-save-optim", action="store_true",
                               help="save the model only (no optimizer or lr schedule state; resume it with "
                                    "--no-load-optim)")
    checkpointing.add_argument("--no-save-rng", action="store_true", help="save no RNG states")
    add_logging_args(parser)
    add_run_control_args(parser)
    add_data_args(parser)
    add_tokenizer_args(parser)
    add_eval_args(parser)
    add_moe_args(parser)
    add_mla_args(parser)
    add_housekeeping_args(parser)
    add_performance_args(parser)
    add_no_effect_args(parser)
    return add_optimizer_args(parser)


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    tp: int
    dp: int
    grad_accumulation_steps: int
    pp: int = 1
    vpp: Optional[int] = None  # model chunks per pipeline rank (interleaved schedule); None: one
    ep: int = 1  # expert-parallel size, out of the data-parallel ranks (scripts/moe.py)


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, GPTModelSettings, Layout]:
    """Parse and check every flag before any process group exists; errors exit with one line."""
    args = build_parser().parse_args(argv)
    try:
        validate_args(args, args.tensor_model_parallel_size, wraps_fully_shard=True)
        # The layer-wise optimizer reduces gradients onto their owners itself, unless the bucketed
        # all-reduce overlapped with backward (--overlap-grad-reduce) has averaged them already.
        args.layer_wise_reduce_grads = args.use_layer_wise_distributed_optimizer and not args.overlap_grad_reduce
        optimizer_config_from_args(args)
        _check_device_flags(args)
        check_batch_schedule_flags(args)  # a step schedule sets the global batch size
        layout = _layout(args)
        settings = _model_settings(args, layout.tp)
        layout, settings = _with_experts(args, layout, settings)
        _check_training_flags(args)
        args.batch_schedule = BatchSchedule(args, args.micro_batch_size * layout.dp)
        args.train_iters = args.batch_schedule.train_iters or args.train_iters
        check_performance_flags(args, layout.world_size)
    except ValueError as error:
        exit_with_error(str(error))
    return args, settings, layout


def _layout(args: argparse.Namespace) -> Layout:
    if dist.is_initialized():  # a caller's process group (see `main`)
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    tp = args.tensor_model_parallel_size
    if tp < 1 or world_size % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide the world size ({world_size}).")
    pp, vpp = pipeline_layout(args, world_size // tp)
    dp = world_size // (tp * pp)
    if args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1; got {args.micro_batch_size}.")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size < 1 or args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
            f"--micro-batch-size * data-parallel size = {args.micro_batch_size} * {dp} = {per_step}."
        )
    return Layout(world_size, rank, tp, dp, args.global_batch_size // per_step, pp, vpp)


def runs_on_cuda(args: argparse.Namespace) -> bool:
    """NCCL on GPUs or gloo on CPU: a caller's process group, else --distributed-backend, else
    CUDA when available."""
    if dist.is_initialized():
        return dist.get_backend() == "nccl"
    if args.distributed_backend is not None:
        return args.distributed_backend == "nccl"
    return torch.cuda.is_available()


def _check_device_flags(args: argparse.Namespace) -> None:
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--distributed-backend nccl needs CUDA, and none is available (gloo runs on CPU).")
    if dist.is_initialized() and args.distributed_backend not in (None, dist.get_backend()):
        raise ValueError(f"--distributed-backend {args.distributed_backend}: the process group this runs in "
                         f"is {dist.get_backend()}.")
    if args.transformer_impl == "transformer_engine" and not (runs_on_cuda(args) and transformer_engine_at_least(None)):
        raise ValueError("--transformer-impl transformer_engine needs CUDA and Transformer Engine installed "
                         "(--transformer-impl local runs everywhere).")


def _with_experts(args: argparse.Namespace, layout: Layout, settings: GPTModelSettings
                  ) -> tuple[Layout, GPTModelSettings]:
    """The MoE flags (scripts/moe.py) in the layout and the model settings."""
    ep = check_moe_flags(args, layout.tp, layout.dp, use_cuda=runs_on_cuda(args), num_layers=settings.num_layers)
    return dataclasses.replace(layout, ep=ep), dataclasses.replace(settings, **moe_settings(args))


def _model_settings(args: argparse.Namespace, tp: int) -> GPTModelSettings:
    """The model the flags describe; its errors name the flags (`--seq-length`, not `seq_length`)."""
    check_data_flags(args)
    args.padded_vocab_size = model_vocab_size(args, tp)
    if args.sequence_parallel and tp == 1:
        if is_rank_zero():
            print("> --sequence-parallel is off: it needs --tensor-model-parallel-size > 1 (as in Megatron-LM)",
                  flush=True)
        args.sequence_parallel = False
    try:
        settings = _settings_from_flags(args)
        settings.check_tensor_parallel(tp)
    except SettingsError as error:
        # Every setting and tensor_model_parallel_size is the destination of the flag of that name.
        flags = {name: f"--{name.replace('_', '-')}" for name in vars(args)}
        flags["layernorm_epsilon"] = "--norm-epsilon"  # megatron's field name, Megatron-LM's flag
        raise ValueError(f"{error.message_for(flags)}.") from None
    return settings


def _query_groups(args: argparse.Namespace) -> Optional[int]:
    """Megatron-LM: key/value groups only with --group-query-attention (then default 1)."""
    if not args.group_query_attention:
        if args.num_query_groups is not None:
            raise ValueError(f"--num-query-groups {args.num_query_groups} needs --group-query-attention "
                             f"(without it every head has its own key/value group).")
        return None
    return 1 if args.num_query_groups is None else args.num_query_groups


def _ffn_hidden_size(args: argparse.Namespace) -> int:
    """Megatron-LM's default: 4h, or with SwiGLU 2/3 of that rounded down to a multiple of 64
    (the same parameter count as a 4h GELU MLP)."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        if size < 1:
            raise ValueError(f"--swiglu's default FFN size int(8 * --hidden-size {args.hidden_size} / 3 / 64) * 64 "
                             f"is 0 (hidden size below 24); give --ffn-hidden-size.")
        return size
    return 4 * args.hidden_size


def _activation(args: argparse.Namespace) -> str:
    given = [flag for flag, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                   ("--quick-geglu", args.quick_geglu)) if on]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} exclude each other (one activation).")
    return "squared_relu" if args.squared_relu else "quick_geglu" if args.quick_geglu else "gelu"


def _qk_layernorm(args: argparse.Namespace) -> bool:
    if args.qk_layernorm and args.qk_clip:
        raise ValueError("--qk-clip is not offered with --qk-layernorm: the clip rescales W_q and W_k, which the "
                         "norm after the projection undoes (--log-max-attention-logit works).")
    return args.qk_layernorm


def _rotary_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.no_position_embedding and args.position_embedding_type == "learned_absolute":
        raise ValueError("--no-position-embedding is deprecated (as in Megatron-LM): use --position-embedding-type "
                         "none or rope.")
    if args.rope_scaling_factor is not None and not args.use_rope_scaling:
        raise ValueError("--rope-scaling-factor only applies with --use-rope-scaling.")
    flags = {"rotary_base": "rotary_base", "rotary_percent": "rotary_percent",  # setting: its flag's dest
             "rotary_interleaved": "rotary_interleaved", "rope_scaling": "use_rope_scaling",
             "rotary_seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
             "rope_scaling_factor": "rope_scaling_factor"}
    given = {name: getattr(args, dest) for name, dest in flags.items()
             if getattr(args, dest) is not None and getattr(args, dest) is not False}
    # MLA's own RoPE reads --rotary-base and --rotary-percent (scripts/mla_flags.py checks the rest).
    mla_rotary = ("rotary_base", "rotary_percent") if args.multi_latent_attention else ()
    if args.position_embedding_type != "rope":
        refuse_flags_without([f"--{flags[name].replace('_', '-')}" for name in given if name not in mla_rotary],
                             f"--position-embedding-type rope (got {args.position_embedding_type})")
    return given


# Megatron-LM's --recompute-modules that this trainer's models have (no grouped GEMM, MLA, shared
# experts or gated delta net).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe")


def _recompute_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-LM's rules: --recompute-activations is --recompute-granularity selective; full
    recompute needs a method and a layer count, selective neither."""
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ValueError("--recompute-activations (selective recompute) and --recompute-granularity full "
                             "exclude each other; give one.")
        granularity = "selective"
    given = [flag for flag, value in (("--recompute-method", args.recompute_method),
                                      ("--recompute-num-layers", args.recompute_num_layers)) if value is not None]
    if args.distribute_saved_activations:
        given.append("--distribute-saved-activations")
    if args.recompute_modules is not None and granularity != "selective":
        raise ValueError("--recompute-modules only applies with selective recompute (--recompute-activations or "
                         "--recompute-granularity selective).")
    if args.recompute_modules is not None and "moe" in args.recompute_modules and args.num_experts is None:
        raise ValueError("--recompute-modules moe needs --num-experts (a mixture-of-experts model).")
    if args.recompute_modules is not None and "mlp" in args.recompute_modules and not args.disable_bias_linear:
        raise ValueError("--recompute-modules mlp needs --disable-bias-linear (megatron-core's checkpoint hands the "
                         "MLP's output bias, a parameter, back through itself, and its backward then recurses "
                         "without end).")
    if args.recompute_modules is not None and "layernorm" in args.recompute_modules and not (
            runs_on_cuda(args) and transformer_engine_at_least(None)):
        raise ValueError("--recompute-modules layernorm needs CUDA and Transformer Engine (megatron-core's "
                         "output-discarding checkpoint calls Transformer Engine's FP8 state).")
    if granularity != "full":
        refuse_flags_without(given, "--recompute-granularity full" + (f" (got {granularity})" if granularity else ""))
    elif len(given) < 2:
        raise ValueError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                         "--recompute-num-layers.")
    elif not 1 <= args.recompute_num_layers <= args.num_layers:
        raise ValueError(f"--recompute-num-layers {args.recompute_num_layers} must be in [1, --num-layers "
                         f"{args.num_layers}].")
    if args.distribute_saved_activations:
        _check_distributed_saved_activations(args)
    modules = None if args.recompute_modules is None else tuple(args.recompute_modules)
    return dict(recompute_granularity=granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, recompute_modules=modules,
                distribute_saved_activations=args.distribute_saved_activations)


def _check_distributed_saved_activations(args: argparse.Namespace) -> None:
    """megatron-core's rules (TransformerConfig), plus CUDA: its checkpoint gathers the split
    input into a buffer on torch.cuda.current_device()."""
    if args.tensor_model_parallel_size == 1:
        raise ValueError("--distribute-saved-activations needs --tensor-model-parallel-size > 1 (it splits "
                         "activations over the tensor-parallel ranks).")
    if args.sequence_parallel:
        raise ValueError("--distribute-saved-activations and --sequence-parallel exclude each other (as in "
                         "megatron-core: the activations are split over TP already).")
    if not runs_on_cuda(args):
        raise ValueError("--distribute-saved-activations needs CUDA (megatron-core gathers the saved activations "
                         "into a CUDA buffer).")


def _settings_from_flags(args: argparse.Namespace) -> GPTModelSettings:
    if args.use_rotary_position_embeddings:  # Megatron-LM's legacy flag
        args.position_embedding_type = "rope"
    return GPTModelSettings(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=_query_groups(args),
        ffn_hidden_size=_ffn_hidden_size(args),
        swiglu=args.swiglu,
        activation=_activation(args),
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=args.padded_vocab_size,
        bf16=args.bf16 and not args.use_torch_fsdp2,  # FSDP2: fp32 shards, bf16 compute (fully_shard_gpt)
        fp16=args.fp16,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        kv_channels=args.kv_channels,
        qk_layernorm=_qk_layernorm(args),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        init_method_xavier_uniform=args.init_method_xavier_uniform,
        embedding_init_method_std=args.embedding_init_method_std,
        position_embedding_type=args.position_embedding_type,
        transformer_impl=args.transformer_impl or "auto",
        **_rotary_settings(args),
        **mla_settings(args, local_spec=_uses_local_spec(args)),
        **_recompute_settings(args),
        sequence_parallel=args.sequence_parallel,
        # QK-clip: the model's TransformerConfig carries the flags too (Transformer Engine's
        # attention records its maximum logits only when built with them).
        qk_clip=args.qk_clip,
        qk_clip_threshold=args.qk_clip_threshold,
        qk_clip_alpha=args.qk_clip_alpha,
        log_max_attention_logit=args.log_max_attention_logit,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
    )


def _uses_local_spec(args: argparse.Namespace) -> bool:
    """Whether megatron-core's local layers are built (scripts/gpt_model.py's gpt_layer_spec)."""
    return args.transformer_impl == "local" or not (runs_on_cuda(args) and transformer_engine_at_least(None))


def _check_training_flags(args: argparse.Namespace) -> None:
    _training_length(args)
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
    _gradient_precision(args)
    if args.min_lr is None:
        args.min_lr = 0.0
    check_eval_flags(args)
    check_run_control_flags(args)
    _check_document_flags(args)
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        raise ValueError(f"--save-interval needs --save and must be >= 1; got {args.save_interval}.")
    if args.ckpt_step is not None and not args.load:
        raise ValueError("--ckpt-step needs --load.")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler (this run's lr schedule) and "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude each other; give one.")
    _check_fsdp2_flags(args)
    if args.plot and not args.plot.endswith(".png"):
        raise ValueError(f"--plot writes a PNG; give a path ending in .png, got {args.plot!r}.")
    _check_wsd_flags(args)
    _check_weight_decay_flags(args)
    if args.lr_warmup_init > args.lr:
        raise ValueError(f"--lr-warmup-init {args.lr_warmup_init} must not exceed --lr {args.lr}.")
    try:
        scheduler_config(args)
    except (TypeError, ValueError) as error:  # SchedulerConfig's field names -> this script's flags
        raise ValueError(re.sub(r"SchedulerConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                                str(error))) from None


def _check_document_flags(args: argparse.Namespace) -> None:
    """--reset-position-ids / --reset-attention-mask run through the one-stage forward, which
    passes the per-document positions and mask to the model (scripts/pipeline.py's SingleStage)."""
    given = [flag for flag, on in (("--reset-position-ids", args.reset_position_ids),
                                   ("--reset-attention-mask", args.reset_attention_mask)) if on]
    if given and args.pipeline_model_parallel_size > 1:
        raise ValueError(f"{given[0]} needs --pipeline-model-parallel-size 1: the pipeline's stages here pass "
                         f"each other hidden states only (torch.distributed.pipelining), not the per-document "
                         f"positions and mask.")
    if args.reset_attention_mask and runs_on_cuda(args) and args.transformer_impl != "local" and (
            transformer_engine_at_least(None)):
        raise ValueError("--reset-attention-mask with Transformer Engine is not offered: its attention is built "
                         "with the causal mask type, which does not apply a per-document mask; add "
                         "--transformer-impl local.")


def document_lines(args: argparse.Namespace) -> list[str]:
    if args.reset_position_ids and args.position_embedding_type != "learned_absolute":
        return [f"--reset-position-ids: no effect with --position-embedding-type {args.position_embedding_type}: "
                f"megatron-core's GPTModel reads position ids only for learned absolute position embeddings (RoPE "
                f"rotates by the position in the sequence), as in Megatron-LM"]
    return []


def _gradient_precision(args: argparse.Namespace) -> None:
    """Megatron-LM: with --bf16, gradients are accumulated and all-reduced in fp32 unless
    --grad-reduce-in-bf16 (which wins over --accumulate-allreduce-grads-in-fp32)."""
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 only applies with --bf16.")
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16


_ITERATION_SCHEDULE_FLAGS = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")
_SAMPLE_SCHEDULE_FLAGS = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")


def _training_length(args: argparse.Namespace) -> None:
    """--train-iters or --train-samples (Megatron-LM: then train_samples // global batch
    iterations, and the schedule flags count samples); sets args.train_iters either way."""
    def given(names: tuple[str, ...]) -> list[str]:
        return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name)]

    if args.train_samples is None:
        if given(_SAMPLE_SCHEDULE_FLAGS):
            raise ValueError(f"{given(_SAMPLE_SCHEDULE_FLAGS)[0]} needs --train-samples (with --train-iters the "
                             f"schedule counts iterations: --lr-decay-iters, --lr-warmup-iters, ...).")
        if args.train_iters is None:
            args.train_iters = DEFAULT_TRAIN_ITERS
        return
    if args.train_iters is not None:
        raise ValueError("--train-iters and --train-samples both set the training length; give one.")
    if given(_ITERATION_SCHEDULE_FLAGS):
        raise ValueError(f"{given(_ITERATION_SCHEDULE_FLAGS)[0]} counts iterations; with --train-samples the "
                         f"schedule counts samples (--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples).")
    if args.train_samples < args.global_batch_size:
        raise ValueError(f"--train-samples {args.train_samples} must be >= --global-batch-size "
                         f"{args.global_batch_size} (one iteration).")
    args.train_iters = args.train_samples // args.global_batch_size


def _check_fsdp2_flags(args: argparse.Namespace) -> None:
    """What --use-torch-fsdp2 does not do yet, refused before anything is built."""
    if not args.use_torch_fsdp2:
        return
    refused = [("--use-distributed-optimizer (FSDP2 shards the optimizer state already)",
                args.use_layer_wise_distributed_optimizer),
               ("--log-params-norm", args.log_params_norm),
               ("--pipeline-model-parallel-size > 1", args.pipeline_model_parallel_size > 1),
               ("--fp16 (loss scaling of DTensor shards is not implemented)", args.fp16)]
    for what, given in refused:
        if given:
            raise ValueError(f"--use-torch-fsdp2 does not support {what} yet.")


def _check_wsd_flags(args: argparse.Namespace) -> None:
    if args.lr_decay_style != "WSD":
        given = [f"--{name.replace('_', '-')}" for name in ("lr_wsd_decay_iters", "lr_wsd_decay_style")
                 if getattr(args, name) is not None]
        refuse_flags_without(given, f"--lr-decay-style WSD (got --lr-decay-style {args.lr_decay_style})")
        return
    if args.lr_wsd_decay_style is None:
        args.lr_wsd_decay_style = "exponential"  # Megatron-LM's default
    decay_iters = args.lr_decay_iters or args.train_iters
    if args.train_samples is None and args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_iters > decay_iters:
        raise ValueError(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} must not exceed the decay's "
                         f"{decay_iters} iterations (--lr-decay-iters, default --train-iters).")


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
    """Megatron-LM's schedule flags; megatron_eopt.bridge turns iterations into samples."""
    return SchedulerConfig(
        lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction,
        lr_warmup_init=args.lr_warmup_init,
        lr_wsd_decay_style=args.lr_wsd_decay_style or "exponential",
        lr_wsd_decay_iters=args.lr_wsd_decay_iters,
        global_batch_size=args.global_batch_size,
        **_training_length_fields(args),
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        start_weight_decay=args.start_weight_decay,
        end_weight_decay=args.end_weight_decay,
        weight_decay_incr_style=args.weight_decay_incr_style,
    )


def _training_length_fields(args: argparse.Namespace) -> dict[str, Any]:
    if args.train_samples is None:
        return dict(train_iters=args.train_iters)
    return dict(train_samples=args.train_samples, lr_decay_samples=args.lr_decay_samples,
                lr_warmup_samples=args.lr_warmup_samples or 0, lr_wsd_decay_samples=args.lr_wsd_decay_samples)


# ------------------------------------------------------------------------------------------------
# Set-up
# ------------------------------------------------------------------------------------------------


def init_distributed(args: argparse.Namespace, layout: Layout) -> torch.device:
    """One process group over every rank: NCCL on CUDA (cuda:LOCAL_RANK), gloo on CPU (see
    `runs_on_cuda`). A process group that already exists (a caller's, see `main`) is used as it is."""
    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if "MASTER_ADDR" not in os.environ:  # plain `python`: a one-process group on a free port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if runs_on_cuda(args):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=layout.rank, world_size=layout.world_size, device_id=device,
                                timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=layout.rank, world_size=layout.world_size, timeout=timeout)
    return device


class BatchSource:
    """Global batches of a data source (scripts/data.py), this DP rank's rows in micro-batches.
    Training iteration i reads train batch i - 1 (the generated task: seed stream i), of the
    size args.batch_schedule gives it (scripts/batch_schedule.py), from the samples consumed
    before it on; evaluation batches have the global batch size."""

    def __init__(self, args: argparse.Namespace, layout: Layout, dp_rank: int) -> None:
        self.args, self.dp, self.dp_rank, self.schedule = args, layout.dp, dp_rank, args.batch_schedule
        self.data = build_data_source(args, SampleCounts.for_run(
            args.train_iters, args.global_batch_size, args.eval_interval, args.eval_iters,
            train_samples=self.schedule.first_sample(args.train_iters + 1)))

    def micro_batches(self, iteration: int) -> list[torch.Tensor]:
        size = self.schedule.size(iteration)
        mine = self.data.samples("train", iteration - 1, size, self._rows(size),
                                 first_sample=self.schedule.first_sample(iteration))
        return list(mine.split(self.args.micro_batch_size))

    def split_batches(self, split: str, batch_index: int) -> list[torch.Tensor]:
        size = self.args.global_batch_size
        return list(self.data.samples(split, batch_index, size, self._rows(size)).split(self.args.micro_batch_size))

    def _rows(self, global_batch_size: int) -> slice:
        per_rank = global_batch_size // self.dp
        return slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def train_step(model, optimizer, micro_batches, forward, grads: GradReducer, dp_group,
               after_forward_backward: Callable[[], None] = lambda: None
               ) -> tuple[float, bool, Optional[float], Optional[float]]:
    """Forward/backward over the micro-batches (`forward`: one stage or a pipeline,
    scripts/pipeline.py), the gradients finalised (DP average, sums over TP of the
    sequence-parallel ones and over the pipeline of the tied embedding), optimizer step.

    Each micro-batch's loss is divided by the number of micro-batches and scaled by the
    optimizer's loss scale (fp16; 1 otherwise), which the optimizer divides out of the gradients
    again; an overflow makes it skip the step and back the scale off. Returns (global-batch mean
    loss, update successful, grad norm, zeros in the gradients (with --log-num-zeros-in-grad,
    else None)).
    """
    optimizer.zero_grad()
    grads.zero_grads(len(micro_batches))
    start_step(optimizer.get_loss_scale(), len(micro_batches))  # the MoE aux loss's gradient scale
    total = forward.forward_backward(micro_batches, optimizer.scale_loss)
    after_forward_backward()
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    finalize_model_grads(chunks, grads)
    finish_router_step(chunks)  # MoE expert biases and token counts, as megatron's finalize_model_grads
    dp_size = dist.get_world_size(dp_group)
    loss_sum = total.to(next(model.parameters()).device)
    dist.all_reduce(loss_sum, group=dp_group)
    ok, grad_norm, num_zeros = optimizer.step()
    return loss_sum.item() / dp_size, ok, grad_norm, num_zeros


def _moe_losses(args, settings: GPTModelSettings, num_micro_batches: int, device: torch.device) -> dict[str, float]:
    """The step's MoE losses Megatron-LM logs (none for a dense model)."""
    if args.num_experts is None:
        return {}
    num_moe_layers = sum(moe_layer_pattern(args.moe_layer_freq, settings.num_layers))
    return step_moe_losses(logged_moe_losses(args), num_micro_batches, settings.num_layers, num_moe_layers, device)


def train(args, settings, layout, device, housekeeping: Optional[Housekeeping] = None) -> list[dict]:
    """The training loop (inside `housekeeping.training()`, see `main`)."""
    from megatron.core import parallel_state

    housekeeping = housekeeping or Housekeeping(args, device)

    chunks = build_gpt_model_chunks(settings, device)
    model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)  # all of this rank's parameters
    dp_group = parallel_state.get_data_parallel_group()
    if args.use_torch_fsdp2:
        fully_shard_gpt(model, dp_group, device, bf16_compute=args.bf16)
    batches = BatchSource(args, layout, parallel_state.get_data_parallel_rank())
    token_loss = TokenLoss(batches.data.tokenizer.eod if args.eod_mask_loss else None,
                           per_token=args.calculate_per_token_loss, dp_group=dp_group)
    documents = None
    if args.reset_position_ids or args.reset_attention_mask:
        eod = batches.data.tokenizer.eod
        documents = lambda inputs: document_inputs(inputs, eod, args.reset_position_ids,  # noqa: E731
                                                   args.reset_attention_mask)
    forward = SingleStage(model, token_loss, documents) if layout.pp == 1 else Pipeline(
        chunks, layout.grad_accumulation_steps, (args.micro_batch_size, args.seq_length), device, token_loss)
    config = optimizer_config_from_args(args, device)
    if args.use_torch_fsdp2:  # --bf16 is FSDP2's compute dtype there: the parameters it shards are fp32
        config = dataclasses.replace(config, bf16=False)
    optimizer = get_megatron_optimizer(config, chunks)
    scheduler = get_scheduler(config, scheduler_config(args), optimizer)
    # The layer-wise optimizer reduces onto owners itself (unless --overlap-grad-reduce); FSDP2
    # reduce-scatters (averages) in backward.
    grads = GradReducer(model, dp_group, args.accumulate_allreduce_grads_in_fp32,
                        reduce_over_dp=not (config.layer_wise_reduce_grads or args.use_torch_fsdp2),
                        bucket_numel=args.ddp_bucket_size or BUCKET_NUMEL,
                        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
                        overlap=args.overlap_grad_reduce)
    flops = flops_per_iteration(settings, 1) if args.log_throughput else None
    log = Logger(args, layout.rank, flops_per_sample=flops, world_size=layout.world_size, on_cuda=device.type == "cuda")
    evaluator = Evaluator(args, batches.data.splits, batches.split_batches, forward.eval_loss, dp_group,
                          is_first_rank=layout.rank == 0, print_line=log.print_line,
                          on_result=lambda r: log.validation(r.iteration, r.loss) if r.split == "valid" else None,
                          around_each=housekeeping.evaluation)
    log.say(describe_model(model) + (", bf16 compute (FSDP2 MixedPrecisionPolicy)" if args.use_torch_fsdp2 and args.bf16 else ""))
    if args.num_experts is not None:
        log.say(describe_moe(args, settings.num_layers))
    for line in (no_effect_lines(args) + moe_note_lines(args) + run_control_lines(args) + document_lines(args)
                 + performance_lines(args, on_cuda=device.type == "cuda")
                 + tensorboard_option_lines(args, on_cuda=device.type == "cuda")
                 + [line for line in (housekeeping.start_line, args.batch_schedule.describe()) if line]):
        log.say(line)
    if args.overlap_grad_reduce and args.use_torch_fsdp2:
        log.say("--overlap-grad-reduce: nothing to change, FSDP2 reduce-scatters each layer's gradients during backward")
    precision_line = matmul_precision_line(args, device)
    if precision_line:
        log.say(precision_line)
    start = resume(args, chunks, optimizer, scheduler, log)
    if args.skip_train:  # Megatron-LM: evaluate the loaded model on validation and test, no training
        evaluator.final(model, start)
        log.close()
        return log.records
    started = time.time()
    profiler = Profiler(args, layout.rank, on_cuda=device.type == "cuda")
    with ExitSignal(args) as exit_signal:  # --exit-signal-handler (scripts/run_control.py)
        for iteration in range(start + 1, args.train_iters + 1):
            profiler.before(iteration)
            lr = optimizer.param_groups[0]["lr"]
            micro_batches = batches.micro_batches(iteration)
            loss, ok, grad_norm, num_zeros = train_step(
                model, optimizer, micro_batches, forward, grads, dp_group, housekeeping.after_forward_backward)
            housekeeping.after_step(iteration)
            if args.check_for_nan_in_loss_and_grad:
                stop_on_nan(iteration, loss, model, check_grads=not args.fp16, device=device)
            batch_size = args.batch_schedule.size(iteration)
            if ok:
                scheduler.step(batch_size)
            log.iteration(Step(
                iteration, loss, lr, ok, grad_norm=None if grad_norm is None else float(grad_norm),
                loss_scale=float(optimizer.get_loss_scale()), num_zeros=None if num_zeros is None else float(num_zeros),
                params_norm=logged_params_norm(model, optimizer) if args.log_params_norm else None,
                max_attention_logit=optimizer.max_attention_logit,
                other_losses=_moe_losses(args, settings, len(micro_batches), device), batch_size=batch_size))
            profiler.after(iteration)
            evaluator.periodic(model, iteration)
            stop = exit_signal.received() or exit_reason(args, iteration, started, device)
            at_interval = bool(args.save_interval) and iteration % args.save_interval == 0
            if args.save and (at_interval or stop or iteration == args.train_iters):
                finish_param_sync(optimizer)  # save_checkpoint waits itself, but not when given no optimizer
                path = save_checkpoint(args.save, iteration, chunks, None if args.no_save_optim else optimizer,
                                       None if args.no_save_optim else scheduler, save_rng=not args.no_save_rng)
                log.say(f"saved checkpoint {path}")
            if stop:
                log.say(f"exiting after iteration {iteration} ({stop})")
                break
        else:  # as in Megatron-LM, a run stopped early skips the final evaluation
            evaluator.final(model, args.train_iters)
    profiler.close()
    log.close()
    return log.records


def stop_on_nan(iteration: int, loss: float, model: torch.nn.Module, check_grads: bool, device: torch.device) -> None:
    """Megatron-LM's --check-for-nan-in-loss-and-grad (on by default): a NaN loss or a NaN in a
    gradient stops the run on every rank. The step has skipped such an update already (its
    gradients are not finite), so the parameters are the last good ones. The loss is reduced over
    the ranks; the gradients' verdict is all-reduced (`nan_in_grads`). With fp16 only the loss is
    checked: an overflow is the loss scaler's to skip."""
    what = "loss" if math.isnan(loss) else ("gradients" if check_grads and nan_in_grads(model, device) else None)
    if what is not None:
        exit_with_error(f"iteration {iteration}: found NaN in the {what} (Megatron-LM's check; "
                        f"--no-check-for-nan-in-loss-and-grad skips such steps instead).")


def exit_reason(args: argparse.Namespace, iteration: int, started: float, device: torch.device) -> Optional[str]:
    """Why training stops after `iteration` (None: it goes on): --exit-interval, or
    --exit-duration-in-mins, decided on every rank at once (the longest clock: a MAX all-reduce,
    as Megatron-LM does)."""
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    if args.exit_duration_in_mins is None:
        return None
    minutes = torch.tensor((time.time() - started) / 60, dtype=torch.float64, device=device)
    dist.all_reduce(minutes, op=dist.ReduceOp.MAX)
    if minutes.item() < args.exit_duration_in_mins:
        return None
    return f"--exit-duration-in-mins {args.exit_duration_in_mins:g}: {minutes.item():.2f} minutes of training"


def finish_param_sync(optimizer) -> None:
    """Wait for the layer-wise optimizer's parameter broadcasts still in flight (with
    --overlap-param-gather the next forward would): code that reads every parameter first."""
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:
        finish()


def logged_params_norm(model: torch.nn.Module, optimizer) -> float:
    """--log-params-norm reads every parameter: first wait for the layer-wise optimizer's
    broadcasts still in flight (with --overlap-param-gather the next forward would wait for them)."""
    from megatron.core import parallel_state

    finish_param_sync(optimizer)
    expert_group = (parallel_state.get_expert_tensor_model_pipeline_parallel_group()
                    if parallel_state.get_expert_model_parallel_world_size() > 1 else None)  # experts split over EP
    return params_norm(model, parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_model_parallel_group(),
                       parallel_state.get_expert_tensor_parallel_rank(), expert_group)


def fully_shard_gpt(model: torch.nn.Module, dp_group, device: torch.device, bf16_compute: bool = False) -> None:
    """Megatron-LM's --use-torch-fsdp2 layout: each transformer layer, then the root, sharded with
    fully_shard over the data-parallel ranks (a 1-D mesh, FSDP2's default Shard(0) placement).
    With TP > 1 each TP rank shards its TP shards over its own data-parallel group; the optimizer
    takes the TP group from parallel_state. `bf16_compute` (--bf16): the fp32 shards are cast to
    bf16 for forward and backward, and gradients reduce-scattered in fp32 (torch's
    MixedPrecisionPolicy), so the optimizer steps fp32 shards: fp32 main weights without copies."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = data_parallel_mesh(dp_group, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    # fully_shard replaces the parameters, dropping megatron's attributes; the trainer's sum of
    # the sequence-parallel gradients over TP reads this one, so it is put back.
    sequence_parallel = {name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    for name, param in model.named_parameters():
        if name in sequence_parallel:
            param.sequence_parallel = True


_MESH_NUMBERS = itertools.count()


def data_parallel_mesh(dp_group, device: torch.device) -> Any:
    """A 1-D DeviceMesh over `dp_group`, named anew on every call. torch caches meshes that compare
    equal (same ranks, device and names), and `main` may run several times in one process, each
    time with new process groups: an unnamed mesh of an earlier run, whose groups are destroyed,
    would come back."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dp_group, device.type, mesh_dim_names=(f"dp{next(_MESH_NUMBERS)}",))


def resume(args: argparse.Namespace, chunks, optimizer, scheduler, log: Logger) -> int:
    """Load --load's checkpoint (if there is one); returns the iteration training continues
    from: the saved one, or 0 with --finetune (weights only, as Megatron-LM). --skip-train loads
    the model only, as Megatron-LM (it sets --no-load-optim)."""
    if not args.load:
        return 0
    if args.ckpt_step is None and not has_checkpoints(args.load):
        why = "it holds no checkpoint" if os.path.isdir(args.load) else "it does not exist"
        if args.exit_on_missing_checkpoint:
            exit_with_error(f"--exit-on-missing-checkpoint: no checkpoint in --load {args.load} ({why}).")
        log.say(f"no checkpoint in {args.load} ({why}): training from scratch")
        return 0
    model_only = args.no_load_optim or args.finetune or args.skip_train
    loaded = load_checkpoint(args.load, chunks, optimizer, scheduler, iteration=args.ckpt_step,
                             load_optimizer=not model_only, load_rng=not (args.no_load_rng or args.finetune))
    for message in loaded.messages:
        log.say(message)
    log.say(f"loaded checkpoint {loaded.path} (iteration {loaded.iteration}"
            f"{', model only' if model_only else ''})")
    if args.finetune:
        log.say("--finetune: weights loaded; iteration, consumed samples, optimizer, lr schedule and RNG start fresh")
        return 0
    if args.no_load_optim and not args.skip_train:
        log.say(fresh_schedule_note(args, scheduler, loaded.iteration))
    log.start_at(loaded.iteration, args.batch_schedule.first_sample(loaded.iteration + 1))
    return loaded.iteration


def fresh_schedule_note(args: argparse.Namespace, scheduler, start: int) -> str:
    """--no-load-optim keeps Megatron-LM's semantics: the iteration count continues from the
    checkpoint, the lr schedule starts again at step 0. Say where that leaves this run."""
    def lr_after(iterations: int) -> float:
        probe = copy.copy(scheduler)  # get_lr reads only num_steps and the schedule values
        schedule = args.batch_schedule
        probe.num_steps = schedule.first_sample(start + 1 + iterations) - schedule.first_sample(start + 1)
        return probe.get_lr({})

    last, span = args.train_iters, args.lr_decay_iters or args.train_iters
    if args.train_samples is not None:
        span = (args.lr_decay_samples or args.train_samples) // args.global_batch_size
    note = (f"--no-load-optim: fresh optimizer, lr schedule from step 0 at iteration {start + 1} (lr "
            f"{lr_after(0):.6e}) over --lr-decay-iters {span} iterations; the last iteration, {last}, "
            f"runs at lr {lr_after(last - start - 1):.6e}")
    if span != last - start:
        note += f" (--lr-decay-iters {last - start} fits the schedule to this run)"
    return note


def describe_model(model: torch.nn.Module) -> str:
    """Read from the built model (not the flags), so the line shows what --bf16 really made."""
    params = list(model.parameters())
    return f"model: {sum(p.numel() for p in params):,} parameters on rank 0, {params[0].dtype}"


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Train as the flags say; returns the logged records (every rank keeps them).

    Called with torch.distributed already initialised (tests run many configurations in one set
    of worker processes this way), the job is that whole process group, which is left
    initialised at the end; otherwise the process group is made here and destroyed at the end.
    """
    owns_process_group = not dist.is_initialized()
    args, settings, layout = parse_args(argv)
    device = init_distributed(args, layout)
    initialize_model_parallel(layout.tp, args.seed, pipeline_model_parallel_size=layout.pp,
                              virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep)
    try:
        if layout.rank == 0:
            pipeline = f" x PP {layout.pp}" + (f" ({layout.vpp} model chunks per rank)" if layout.vpp else "")
            sequence_parallel = " (sequence parallel)" if settings.sequence_parallel else ""
            print(f"> world {layout.world_size} = TP {layout.tp}{sequence_parallel}{pipeline if layout.pp > 1 else ''} x DP "
                  f"{layout.dp}; global batch "
                  f"{args.global_batch_size} = micro batch {args.micro_batch_size} x DP {layout.dp} x "
                  f"{layout.grad_accumulation_steps} accumulation steps; optimizer {args.optimizer}"
                  f"{' (layer-wise distributed)' if args.use_layer_wise_distributed_optimizer else ''}",
                  flush=True)
        housekeeping = Housekeeping(args, device)
        with housekeeping.training():
            records = train(args, settings, layout, device, housekeeping)
        if args.plot and layout.rank == 0:
            logged = [r for r in records if r["loss"] is not None]  # None: every step of an interval skipped
            plot_curves(args.plot, [Curve(args.optimizer, [r["iteration"] for r in logged],
                                          [r["loss"] for r in logged], PALETTE[0])])
    except ValueError as error:  # e.g. optimizer/config combinations the factory rejects
        exit_with_error(str(error))
    finally:
        destroy_model_parallel()
        if owns_process_group:
            dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
