"""Run scripts/pretrain_gpt.py's `main` inside the distributed harness's worker processes.

A torchrun launch pays ~20 s of imports per process; the harness's workers have paid it once
for the whole session. `main` uses the process group it finds, so a test can run many
command lines (layouts, optimizers, resumes) in one world:

    records = run_distributed(run_pretrain_gpt, 4, args=(argv,))

Each rank returns its logged records (one dict per logged iteration, the same on every rank).
`run_pretrain_gpt_reporting` returns what a launch would report instead (exit status, stdout,
stderr), for tests that read what the run printed or how it exited.
`run_pretrain_gpt_with_overflow` also puts an inf into one gradient at one iteration (fp16 tests).
"""

import contextlib
import functools
import io
import itertools
import subprocess
from typing import Any

import torch

from megatron_eopt.runtime import rank_exit
from megatron_eopt.training import pretrain
from megatron_eopt.training.loop import train as train_loop


@contextlib.contextmanager
def ranks_exit_together():
    """A refused command line ends every rank at once: the other ranks' wait for rank 0's line
    (rank_exit.OTHER_RANKS_WAIT_S) is for torchrun, which stops them when rank 0 exits; here there
    is no torchrun, and they would wait it out (60 s)."""
    before, rank_exit.OTHER_RANKS_WAIT_S = rank_exit.OTHER_RANKS_WAIT_S, 0.0
    try:
        yield
    finally:
        rank_exit.OTHER_RANKS_WAIT_S = before


def run_pretrain_gpt(rank: int, world_size: int, argv: list[str]) -> list[dict[str, Any]]:
    with ranks_exit_together():
        return pretrain.main(list(argv))


def run_pretrain_gpt_reporting(rank: int, world_size: int, argv: list[str]) -> subprocess.CompletedProcess:
    """`run_pretrain_gpt` seen as a launch of scripts/pretrain_gpt.py sees it: its exit status (a
    SystemExit's code: 2 for a refused flag or checkpoint) and what it printed on each stream."""
    stdout, stderr = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), ranks_exit_together():
        try:
            pretrain.main(list(argv))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["pretrain_gpt.py", *argv], status, stdout.getvalue(), stderr.getvalue())


def run_pretrain_gpt_with_overflow(rank: int, world_size: int, argv: list[str], iteration: int,
                                   value: float = float("inf")) -> list[dict[str, Any]]:
    """`run_pretrain_gpt` with `value` (default inf) put into one gradient element on rank 0 at
    `iteration` (a test aid: the trainer has no such option). Patches `train_step` for this call
    only."""
    original = train_loop.train_step
    calls = itertools.count(1)  # a run from scratch: call i is iteration i

    def train_step(model, *args, **kwargs):
        param = next(p for p in model.parameters() if p.requires_grad)
        poison = functools.partial(_one_element, value=value)
        handle = param.register_hook(poison) if next(calls) == iteration and rank == 0 else None
        try:
            return original(model, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()

    train_loop.train_step = train_step
    try:
        return run_pretrain_gpt(rank, world_size, argv)
    finally:
        train_loop.train_step = original


def _one_element(grad: torch.Tensor, value: float) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = value
    return grad


def run_pretrain_gpt_resaving(rank: int, world_size: int, jobs: list[tuple[list[str], str]]
                              ) -> list[subprocess.CompletedProcess]:
    """For each (argv, directory): `run_pretrain_gpt_reporting(argv)`, whose `--load` loads a
    checkpoint, but in place of training, what the load gave (model, optimizer, scheduler) is
    saved to `directory` at the loaded iteration: a test compares it with what was saved."""
    from megatron_eopt.checkpointing import save_checkpoint

    original = train_loop.run_iterations
    results = []
    for argv, directory in jobs:
        def resave(args, settings, layout, device, run, housekeeping, start, directory=directory):
            save_checkpoint(directory, start, run.chunks, run.optimizer, run.scheduler, save_rng=False)

        train_loop.run_iterations = resave
        try:
            results.append(run_pretrain_gpt_reporting(rank, world_size, argv))
        finally:
            train_loop.run_iterations = original
    return results


def run_pretrain_gpt_many(rank: int, world_size: int, argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """`run_pretrain_gpt_reporting` of each command line, in one call to the workers."""
    return [run_pretrain_gpt_reporting(rank, world_size, argv) for argv in argvs]
