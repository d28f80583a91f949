"""Shared by the torchrun benchmarks: process-group set-up and interleaved step timing.

Not a benchmark itself; running it does nothing.
"""

import argparse
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist


from _gpt import GptShape, add_shape_arguments
from _timing import interleaved_times, medians


def gpt_benchmark_parser(description: str) -> argparse.ArgumentParser:
    """The model-size and timing flags both distributed benchmarks take."""
    parser = argparse.ArgumentParser(description=description)
    add_shape_arguments(parser, GptShape(hidden=512, layers=4))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here (rank 0)")
    return parser


def init_distributed() -> torch.device:
    """Join the torchrun job: NCCL on `cuda:{LOCAL_RANK}` when CUDA is available, else gloo on CPU."""
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"{sys.argv[0]} needs several ranks; launch it as: torchrun --nproc-per-node 2 {sys.argv[0]}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    steps: dict[str, Callable[[], None]],
    prepare: dict[str, Callable[[], None]],
    warmup: int,
    repeats: int,
    device: torch.device,
) -> dict[str, float]:
    """Median seconds of each step after `warmup` rounds, on the slowest rank.

    Rounds as in `_timing.interleaved_times`; all ranks start each step together after a
    barrier, and a round's time is the slowest rank's.
    """
    def before() -> None:
        synchronize(device)
        dist.barrier()

    times = interleaved_times(steps, prepare, warmup, repeats, before, lambda: synchronize(device))
    names = list(times)
    slowest = torch.tensor([times[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return medians(dict(zip(names, slowest.tolist())))


def gather_ints(value: int, device: torch.device) -> list[int]:
    """`value` of every rank, by rank."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return values.tolist()


def iteration_gpt_settings(hidden: int, layers: int, seq_length: int):
    """The GPT the whole-iteration benchmarks train: 64-wide heads, 4x FFN, vocabulary 1024."""
    from megatron_eopt.training.model.gpt import GPTModelSettings

    heads = max(1, hidden // 64)
    return GPTModelSettings(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
                            ffn_hidden_size=4 * hidden, vocab_size=1024, seq_length=seq_length)


def start_iteration_benchmark(args):
    """Join the job, set up TP=1 model parallelism, and return (device, the GPT settings of
    --hidden/--layers/--seq-length, a token generator seeded by rank)."""
    from megatron_eopt.training.model.gpt import initialize_model_parallel

    device = init_distributed()
    initialize_model_parallel(1, seed=1234)
    settings = iteration_gpt_settings(args.hidden, args.layers, args.seq_length)
    return device, settings, torch.Generator().manual_seed(dist.get_rank())


def time_iterations(steps: dict[str, Callable[[], None]], args, device: torch.device) -> dict[str, float]:
    """`time_interleaved` of steps that need no preparation, --warmup and --repeats from `args`."""
    return time_interleaved(steps, {name: (lambda: None) for name in steps}, args.warmup, args.repeats, device)


def finish_iteration_benchmark() -> None:
    from megatron_eopt.training.model.gpt import destroy_model_parallel

    destroy_model_parallel()
    dist.destroy_process_group()


def report_iterations(title: str, seconds: dict[str, float], baseline: str, json_path, **extra) -> None:
    """Rank 0 prints each mode's median iteration time and its ratio to `baseline`'s, and writes
    them (with `extra`) to `json_path`."""
    from _timing import write_json

    if dist.get_rank() != 0:
        return
    print(title)
    width = max(len(name) for name in seconds) + 2
    for name, value in seconds.items():
        print(f"{name:{width}} {value * 1e3:9.1f} ms per iteration  ({value / seconds[baseline]:.3f} of {baseline})")
    write_json(json_path, {"iteration_ms": {n: s * 1e3 for n, s in seconds.items()},
                           "world_size": dist.get_world_size(), **extra})
