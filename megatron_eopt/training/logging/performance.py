"""Megatron-LM's performance flags: `--log-throughput` and `--profile` (megatron/training/training.py).

`--log-throughput` adds `throughput per GPU (TFLOP/s/GPU): X |` to the iteration line, the
`throughput` TensorBoard scalar and the JSONL: the logged step's global-batch FLOPs, counted by
megatron's `num_floating_point_operations` for the model built, over (seconds per iteration over
the interval) x 1e12 x world size. On CPU a process stands for a GPU.

`--profile` profiles iterations `--profile-step-start` to `--profile-step-end` on the ranks of
`--profile-ranks` (default: every rank), as Megatron-LM's loop does. Without
`--use-pytorch-profiler` it opens a CUDA profiler capture range for
`nsys profile --capture-range=cudaProfilerApi`. With it, torch.profiler records those steps on
Megatron-LM's schedule and writes a Chrome trace to
`<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz`.
"""

import argparse
import os
from typing import Optional

import torch

from megatron_eopt.training.arguments.loop import PROFILE_DETAIL_FLAGS, check_performance_flags  # noqa: F401


def performance_lines(args: argparse.Namespace, on_cuda: bool) -> list[str]:
    """Rank 0's start-up notes: what these flags do in this run, or that they do nothing."""
    lines = []
    if args.log_throughput and not on_cuda:
        lines.append("--log-throughput: TFLOP/s/GPU counts per process here (no GPUs)")
    if not args.profile:
        if args.profile_flags_given:
            lines.append(f"{', '.join(args.profile_flags_given)}: no effect without --profile (as in Megatron-LM)")
        return lines
    if not args.use_pytorch_profiler and not on_cuda:
        return lines + ["--profile: no effect here, the CUDA profiler capture range needs CUDA; "
                        "--use-pytorch-profiler profiles on CPU"]
    return lines + [_profile_line(args)]


def _profile_line(args: argparse.Namespace) -> str:
    ranks = "every rank" if not args.profile_ranks else f"ranks {args.profile_ranks}"
    first, last = profiled_iterations(args)
    iterations = f"iteration {first}" if first == last else f"iterations {first}-{last}"
    if args.use_pytorch_profiler:
        line = (f"--profile --use-pytorch-profiler: torch.profiler records {iterations} of this run "
                f"on {ranks}, trace {trace_dir(args.tensorboard_dir)}/rank-<rank>.json.gz")
    else:
        line = (f"--profile: CUDA profiler capture range (nsys --capture-range=cudaProfilerApi) over {iterations} "
                f"on {ranks}")
    if first > min(last, args.train_iters):
        line += f" (none of --train-iters {args.train_iters}: nothing is profiled)"
    return line


def profiled_iterations(args: argparse.Namespace) -> tuple[int, int]:
    """The first and last iteration (numbered from 1) Megatron-LM's profiling covers: torch.profiler's
    schedule records steps start..end-1 (step 0 comes before iteration 1); the CUDA range opens
    after `start` completed iterations and closes after `end`."""
    start, end = args.profile_step_start, args.profile_step_end
    return (max(start, 1), end - 1) if args.use_pytorch_profiler else (start + 1, end)


def trace_dir(tensorboard_dir: str) -> str:
    """Megatron-LM's `f"{args.tensorboard_dir}/../torch_profile"`."""
    return os.path.normpath(os.path.join(tensorboard_dir, os.pardir, "torch_profile"))


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------


def flops_per_iteration(settings, global_batch_size: int) -> float:
    """megatron's `num_floating_point_operations` for one global batch of the model `settings`
    (scripts/gpt_model.GPTModelSettings) describes: the model built, not the raw flags (the FFN
    size and query groups after their defaults, the padded vocabulary)."""
    from megatron.training.training import num_floating_point_operations

    return float(num_floating_point_operations(flops_namespace(settings), global_batch_size))


def flops_namespace(settings) -> argparse.Namespace:
    """Exactly the attributes megatron's count reads for a dense or MoE GPT (a fresh namespace
    each time: it writes num_query_groups back without group-query attention)."""
    heads = settings.num_attention_heads
    return argparse.Namespace(
        seq_length=settings.seq_length, num_layers=settings.num_layers, hidden_size=settings.hidden_size,
        num_attention_heads=heads, group_query_attention=settings.num_query_groups is not None,
        num_query_groups=settings.num_query_groups or heads,
        kv_channels=settings.kv_channels or settings.hidden_size // heads,  # --kv-channels, else megatron's default
        ffn_hidden_size=settings.ffn_hidden_size, swiglu=settings.swiglu, padded_vocab_size=settings.vocab_size,
        # Mixture of experts: the MoE layers, expert and shared-expert sizes as the model has them.
        num_experts=settings.num_moe_experts,
        moe_layer_freq=list(settings.moe_layer_freq) if isinstance(settings.moe_layer_freq, tuple)
        else settings.moe_layer_freq,
        moe_router_topk=settings.moe_router_topk,
        moe_ffn_hidden_size=settings.moe_ffn_hidden_size or settings.ffn_hidden_size,
        moe_shared_expert_intermediate_size=settings.moe_shared_expert_intermediate_size,
        moe_latent_size=None,
        # Multi-latent attention (megatron's count has its own branch for it).
        multi_latent_attention=settings.multi_latent_attention, q_lora_rank=settings.q_lora_rank,
        kv_lora_rank=settings.kv_lora_rank, qk_head_dim=settings.qk_head_dim,
        qk_pos_emb_head_dim=settings.qk_pos_emb_head_dim, v_head_dim=settings.v_head_dim,
        # What this trainer's GPT never has: multi-token prediction, gated or linear attention,
        # hybrid (Mamba) layers.
        mtp_num_layers=None, attention_output_gate=False,
        experimental_attention_variant=None, hybrid_layer_pattern=None,
    )


# ------------------------------------------------------------------------------------------------
# Profiling
# ------------------------------------------------------------------------------------------------


class Profiler:
    """Megatron-LM's profiling around the training loop: `before(iteration)` and `after(iteration)`
    for each iteration (numbered from 1, as logged), `close()` after the loop, which ends what is
    still recording (a run shorter than --profile-step-end still gets its trace)."""

    def __init__(self, args: argparse.Namespace, rank: int, on_cuda: bool) -> None:
        self.args = args
        self.active = args.profile and (not args.profile_ranks or rank in args.profile_ranks)
        self.torch_profiler: Optional[torch.profiler.profile] = None
        self.nvtx = None  # the CUDA path's emit_nvtx context while its capture range is open
        if self.active and args.use_pytorch_profiler:
            self.torch_profiler = self._torch_profiler(rank)
            self.torch_profiler.start()
        self.cuda = self.active and not args.use_pytorch_profiler and on_cuda

    def _torch_profiler(self, rank: int) -> torch.profiler.profile:
        start, end = self.args.profile_step_start, self.args.profile_step_end
        directory = trace_dir(self.args.tensorboard_dir)

        def write_trace(profiler: torch.profiler.profile) -> None:
            os.makedirs(directory, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(directory, f"rank-{rank}.json.gz"))

        # Megatron-LM's schedule: step() before each iteration makes this run's i-th iteration step i.
        schedule = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                           active=end - start, repeat=1)
        return torch.profiler.profile(schedule=schedule, on_trace_ready=write_trace)

    def before(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.cuda and iteration - 1 == self.args.profile_step_start:  # Megatron-LM counts completed iterations
            torch.cuda.profiler.start()
            self.nvtx = torch.autograd.profiler.emit_nvtx()
            self.nvtx.__enter__()

    def after(self, iteration: int) -> None:
        if iteration == self.args.profile_step_end:
            self.close()

    def close(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()  # writes the trace if the recording has not ended yet
            self.torch_profiler = None
        if self.nvtx is not None:
            torch.cuda.profiler.stop()
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
        self.cuda = False
