"""The job's layout (world = TP x PP x DP, experts out of DP) and its process group.

`job_layout` is torch-free (the flags are checked before torch is imported); torch is imported
by the functions that need it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_eopt.training.arguments.device import runs_on_cuda, world  # noqa: F401 (runs_on_cuda re-exported)
from megatron_eopt.training.arguments.pipeline import pipeline_layout

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    tp: int
    dp: int
    grad_accumulation_steps: int
    pp: int = 1
    vpp: Optional[int] = None  # model chunks per pipeline rank (interleaved schedule); None: one
    ep: int = 1  # expert-parallel size, out of the data-parallel ranks (megatron_eopt/training/model/moe.py)


def job_layout(args: argparse.Namespace) -> Layout:
    """The layout the flags ask for over the world (a caller's process group, see `main`, else
    WORLD_SIZE and RANK); torch-free, so the same before and after the import."""
    world_size, rank = world()
    tp = args.tensor_model_parallel_size
    if tp < 1 or world_size % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide the world size ({world_size}).")
    pp, vpp = pipeline_layout(args, world_size // tp)
    dp = world_size // (tp * pp)
    if args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1; got {args.micro_batch_size}.")
    per_step = args.micro_batch_size * dp
    global_batch = per_step if args.global_batch_size is None else args.global_batch_size  # default: one step
    if global_batch < 1 or global_batch % per_step:
        raise ValueError(
            f"--global-batch-size {global_batch} must be a positive multiple of "
            f"--micro-batch-size * data-parallel size = {args.micro_batch_size} * {dp} = {per_step}."
        )
    return Layout(world_size, rank, tp, dp, global_batch // per_step, pp, vpp)


def init_distributed(args: argparse.Namespace, layout: Layout) -> torch.device:
    """One process group over every rank: NCCL on CUDA (cuda:LOCAL_RANK), gloo on CPU (see
    `runs_on_cuda`). A process group that already exists (a caller's, see `main`) is used as it is.
    Under torchrun each restart meets in a key space of its own (runtime/torchrun_store.py's `restart_store`); a
    rendezvous that does not complete within --distributed-timeout-minutes ends in one line."""
    import torch
    import torch.distributed as dist

    from megatron_eopt.runtime.torchrun_store import restart_attempt, restart_store
    from megatron_eopt.training.parallel.elastic import fail

    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # Plain `python`: a one-process group meets in an in-process store. A port picked free and
    # bound later races with every other process starting beside it (EADDRINUSE).
    alone = "MASTER_ADDR" not in os.environ and layout.world_size == 1
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    where = "an in-process store" if alone else address
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    on_cuda = runs_on_cuda(args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_cuda else torch.device("cpu")
    started = time.monotonic()
    try:
        store = dist.HashStore() if alone else restart_store(layout.rank, layout.world_size, timeout)
        extra = {} if store is None else {"store": store}
        if on_cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=layout.rank, world_size=layout.world_size, device_id=device,
                                    timeout=timeout, **extra)
        else:
            dist.init_process_group("gloo", rank=layout.rank, world_size=layout.world_size, timeout=timeout, **extra)
    except (RuntimeError, TimeoutError, ConnectionError, ValueError) as error:  # ValueError: env:// unset
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        attempt = restart_attempt()
        fail(layout.rank, f"the rendezvous of {layout.world_size} ranks at {where}"
                          f"{'' if attempt is None else f' (restart {attempt})'} "
                          f"failed after {time.monotonic() - started:.0f} s (--distributed-timeout-minutes "
                          f"{args.distributed_timeout_minutes:g}): {first[:300]}")
    return device
