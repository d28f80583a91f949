"""pretrain_gpt.py's parser and `parse_args`: every flag parsed and checked before any process group exists."""

import argparse
from typing import Optional

from megatron_eopt.arguments import (
    add_optimizer_args,
    optimizer_config_from_args,
    validate_args,
)
from megatron_eopt.training.arguments.mla import add_mla_args
from megatron_eopt.training.arguments.model import (
    RECOMPUTE_MODULES,
    check_device_flags,
    model_settings,
    with_experts,
)
from megatron_eopt.training.arguments.moe import (
    add_moe_args,
)
from megatron_eopt.training.arguments.no_effect import add_no_effect_args
from megatron_eopt.training.arguments.training import (
    DEFAULT_TRAIN_ITERS,
    check_training_flags,
)
from megatron_eopt.training.data.batch_schedule import (
    BatchSchedule,
    add_batch_schedule_args,
    check_batch_schedule_flags,
)
from megatron_eopt.training.data.datasets import (
    DEFAULT_RULE_VOCAB_SIZE,
    add_data_args,
)
from megatron_eopt.training.data.tokenizer import add_tokenizer_args
from megatron_eopt.training.errors import PROG, RankZeroArgumentParser, exit_with_error
from megatron_eopt.training.logging.performance import (
    add_performance_args,
    check_performance_flags,
)
from megatron_eopt.training.logging.training_log import (
    add_logging_args,
)
from megatron_eopt.training.loop.evaluation import add_eval_args
from megatron_eopt.training.loop.housekeeping import add_housekeeping_args
from megatron_eopt.training.loop.run_control import (
    add_run_control_args,
)
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
)
from megatron_eopt.training.parallel.grad_reduction import BUCKET_NUMEL
from megatron_eopt.training.parallel.layout import Layout, job_layout
from megatron_eopt.training.parallel.pipeline import add_pipeline_args


def build_parser() -> argparse.ArgumentParser:
    parser = RankZeroArgumentParser(prog=PROG, description="Pretrain a megatron-core GPTModel with megatron_eopt's optimizer: Megatron-LM's flags.")
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


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, GPTModelSettings, Layout]:
    """Parse and check every flag before any process group exists; errors exit with one line."""
    args = build_parser().parse_args(argv)
    try:
        validate_args(args, args.tensor_model_parallel_size, wraps_fully_shard=True)
        # The layer-wise optimizer reduces gradients onto their owners itself, unless the bucketed
        # all-reduce overlapped with backward (--overlap-grad-reduce) has averaged them already.
        args.layer_wise_reduce_grads = args.use_layer_wise_distributed_optimizer and not args.overlap_grad_reduce
        optimizer_config_from_args(args)
        check_device_flags(args)
        check_batch_schedule_flags(args)  # a step schedule sets the global batch size
        layout = job_layout(args)
        settings = model_settings(args, layout.tp)
        layout, settings = with_experts(args, layout, settings)
        check_training_flags(args)
        args.batch_schedule = BatchSchedule(args, args.micro_batch_size * layout.dp)
        args.train_iters = args.batch_schedule.train_iters or args.train_iters
        check_performance_flags(args, layout.world_size)
    except ValueError as error:
        exit_with_error(str(error))
    return args, settings, layout
