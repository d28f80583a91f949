"""Run a functional-test case (tests/functional/test_cases/) inside the distributed harness's workers.

The launcher (tools/run_functional_case.py) starts torchrun, ~20 s of imports per process; `make test`
runs the same command lines, from the same `case_argv`, in the harness's reused workers instead:

    run_distributed(run_case, case.world_size, args=(case, str(output)))

Each run writes its TensorBoard events under `RunPaths(output)`, as the launcher's do; the test process
reads and compares them (megatron_eopt/training/functional/goldens.py). fp32 products at 'highest', as
the launcher's fresh processes have them. `drop_momentum=True` zeroes every optimizer's momentum
buffers right after a resume (a test aid: a resume that loses the momentum must fail the goldens).
"""

import contextlib
import gc
import os
import pathlib
from typing import Iterator

import torch

from megatron_eopt.training.functional.cases import Case, RunPaths, case_argv, prepare_resume
from tests.bf16_numerics import bf16_numerics
from tests.megatron_lm_in_process import run_megatron_lm
from tests.pretrain_gpt_in_process import run_pretrain_gpt


@contextlib.contextmanager
def _case_settings(case: Case) -> Iterator[None]:
    saved_environment, saved_precision = dict(os.environ), torch.get_float32_matmul_precision()
    os.environ.update(case.env_vars)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)
        torch.set_float32_matmul_precision(saved_precision)


def _zero_momentum_after_resume():
    """Patch the trainer's resume to zero every momentum buffer once the checkpoint is loaded."""
    from megatron_eopt.training.loop import train

    original = train.resume

    def resume(*args, **kwargs):
        start = original(*args, **kwargs)
        zeroed = 0
        for candidate in gc.get_objects():
            if isinstance(candidate, torch.optim.Optimizer):
                for state in candidate.state.values():
                    if isinstance(state.get("momentum_buffer"), torch.Tensor):
                        state["momentum_buffer"].zero_()
                        zeroed += 1
        if start > 0 and zeroed == 0:
            raise RuntimeError("drop_momentum: the resumed optimizer holds no momentum_buffer to drop")
        return start

    train.resume = resume
    return lambda: setattr(train, "resume", original)


def run_case(rank: int, world_size: int, case: Case, output: str, drop_momentum: bool = False,
             bf16_products: bool = False) -> list:
    """Every run of `case` (two for ckpt-resume, with `prepare_resume` between), writing under `output`
    as the launcher does; what each run returned on this rank (Megatron-LM's loop: its `Run`).
    `bf16_products`: as a CPU with native bf16 products computes them (tests/bf16_numerics.py)."""
    if world_size != case.world_size:
        raise ValueError(f"case {case.name!r} runs on {case.world_size} ranks; got {world_size}")
    paths = RunPaths(pathlib.Path(output))
    results = []
    for run in case.phases():
        if run > 1:  # Megatron-LM's step between the runs, on one rank (the launcher's node 0)
            if rank == 0:
                prepare_resume(case, paths)
            torch.distributed.barrier()
        undo = _zero_momentum_after_resume() if drop_momentum and run > 1 else (lambda: None)
        try:
            with _case_settings(case), (bf16_numerics() if bf16_products else contextlib.nullcontext()):
                argv = case_argv(case, paths, run)
                run_entry = run_pretrain_gpt if case.script == "pretrain_gpt.py" else run_megatron_lm
                results.append(run_entry(rank, world_size, argv))
        finally:
            undo()
    return results
