"""Issue 74 item 5 on one CUDA GPU: a worker of Megatron-LM's loop (ours installed; DDP with the
distributed optimizer, `torch_dist`, bf16, NCCL) is SIGKILLed at a random iteration under
`torchrun --max-restarts 3`; the restart `--load`s the newest checkpoint and ends bitwise equal to
the same command line run without interruption (every tensor of the last checkpoint).

The CPU tests (test_megatron_lm_faults.py) run two gloo ranks; NCCL puts one rank on each GPU, so
one GPU runs one rank. The restart meets in a store prefix of its own (runtime/torchrun_store.py),
which NCCL's unique-id exchange goes through as gloo's keys do.
"""

import random
import re

import pytest
import torch

from tests.functional.test_megatron_lm_faults import (ENGINES, LONGER, OPTIMIZERS, SEED, TRAIN_ITERS,
                                                      assert_same_checkpoint, launch, loaded_iterations,
                                                      newest_complete_save, report)
from tests.functional.test_megatron_lm_loop import MODEL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"),
]
ENGINE = "DDP distributed optimizer"


def gpu_flags(optimizer: str) -> list[str]:
    """The CPU tests' command line on CUDA: NCCL instead of gloo."""
    model = list(MODEL)
    model[model.index("--distributed-backend") + 1] = "nccl"
    return [*model, *LONGER, *OPTIMIZERS[optimizer], *ENGINES[ENGINE]]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_kill_at_a_random_iteration_on_one_gpu_resumes_bitwise(optimizer: str, tmp_path) -> None:
    iteration = random.Random(f"{SEED}/gpu/{optimizer}").randint(2, TRAIN_ITERS)
    kill = {"attempt": 0, "rank": 0, "iteration": iteration, "phase": "step", "signal": "KILL"}
    print(f"FAULT_SEED={SEED} {optimizer}: SIGKILL as iteration {iteration} starts")
    flags = gpu_flags(optimizer)
    faulted = launch(flags, tmp_path / "faulted", [kill], restarts=3, timeout=600, workers=1)
    assert faulted.returncode == 0, report(faulted)
    assert len(re.findall(r"fault_entry: attempt 0 rank 0 SIGKILL", faulted.stderr)) == 1, report(faulted)
    expected = newest_complete_save(kill)
    assert loaded_iterations(faulted.stdout) == ([expected] if expected else []), report(faulted)
    straight = launch(flags, tmp_path / "straight", timeout=600, workers=1)
    assert straight.returncode == 0, report(straight)
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "faulted", TRAIN_ITERS, tmp_path)
