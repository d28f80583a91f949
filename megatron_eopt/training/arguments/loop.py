"""The evaluation, housekeeping and performance flags' checks: torch-free, run before torch is
imported (loop/evaluation.py, loop/housekeeping.py and logging/performance.py re-export them)."""

import argparse

from megatron_eopt.training.arguments.flags.logging import DEFAULT_PROFILE_STEP_END, DEFAULT_PROFILE_STEP_START

PROFILE_DETAIL_FLAGS = ("--use-pytorch-profiler", "--profile-step-start", "--profile-step-end", "--profile-ranks")


def check_eval_flags(args: argparse.Namespace) -> None:
    if args.eval_interval is not None and args.eval_interval < 1:
        raise ValueError(f"--eval-interval must be >= 1; got {args.eval_interval}.")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0 (0: no evaluation); got {args.eval_iters}.")
    final_eval_iters = getattr(args, "final_eval_iters", None)
    if final_eval_iters is not None and (final_eval_iters < 1 or not args.eval_iters):
        raise ValueError(f"--final-eval-iters must be >= 1, with --eval-iters > 0; got {final_eval_iters} "
                         f"with --eval-iters {args.eval_iters}.")
    if args.skip_train and not args.eval_iters:
        raise ValueError("--skip-train only evaluates, and --eval-iters 0 turns evaluation off; give --eval-iters > 0.")


def check_housekeeping_flags(args: argparse.Namespace) -> None:
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0; got {args.manual_gc_interval}.")
    if args.manual_gc_interval and not args.manual_gc:
        raise ValueError("--manual-gc-interval only applies with --manual-gc.")


def check_performance_flags(args: argparse.Namespace, world_size: int) -> dict:
    """Refuse bad values (naming the flag); returns Megatron-LM's defaults filled in and which of
    the profiling flags were given (for `performance_lines`)."""
    given = [flag for flag in PROFILE_DETAIL_FLAGS if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    start = DEFAULT_PROFILE_STEP_START if args.profile_step_start is None else args.profile_step_start
    end = DEFAULT_PROFILE_STEP_END if args.profile_step_end is None else args.profile_step_end
    if start < 0:
        raise ValueError(f"--profile-step-start must be >= 0; got {start}.")
    if end <= start:
        raise ValueError(f"--profile-step-end {end} must be > --profile-step-start {start}.")
    ranks = args.profile_ranks or []
    outside = [rank for rank in ranks if not 0 <= rank < world_size]
    if outside:
        raise ValueError(f"--profile-ranks {outside[0]}: the ranks run from 0 to {world_size - 1} here.")
    if args.profile and args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ValueError("--use-pytorch-profiler writes its trace next to --tensorboard-dir "
                         "(<dir>/../torch_profile, as Megatron-LM does); give --tensorboard-dir.")
    return dict(profile_flags_given=given, profile_step_start=start, profile_step_end=end, profile_ranks=ranks)
