"""Shared by the torchrun benchmarks: process-group set-up and interleaved step timing.

Not a benchmark itself; running it does nothing.
"""

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist


def gpt_benchmark_parser(description: str) -> argparse.ArgumentParser:
    """The model-size and timing flags both distributed benchmarks take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="query groups (GQA)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
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

    Every round runs each alternative once (order rotated from round to round, so none always
    goes first); `prepare[name]` (setting gradients) runs untimed before its step, and all ranks
    start each step together after a barrier. A step's time is the slowest rank's.
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            prepare[name]()
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    slowest = torch.tensor([times[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row) for name, row in zip(names, slowest.tolist())}


def gather_ints(value: int, device: torch.device) -> list[int]:
    """`value` of every rank, by rank."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return values.tolist()
