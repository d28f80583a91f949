"""GPU tier for checkpoints: CUDA RNG and megatron-core's RNG tracker resume exactly.

Dropout inside `get_cuda_rng_tracker().fork()` (tensor-parallel regions), dropout on the default
CUDA generator and a CPU draw after a load equal those right after the save. Skips without CUDA.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"),
]


def _dropout_draws(tracker) -> list[torch.Tensor]:
    ones = torch.ones(256, device="cuda")
    with tracker.fork():
        in_tensor_parallel_region = torch.nn.functional.dropout(ones, 0.5)
    return [in_tensor_parallel_region, torch.nn.functional.dropout(ones, 0.5), torch.rand(4)]


def test_cuda_and_tracker_rng_resume_exactly(tmp_path) -> None:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    kept_states, kept_seeds = tracker.get_states(), set(tracker.seeds_)
    try:
        tracker.reset()
        tracker.add("model-parallel-rng", 1234 + 2718)  # what model_parallel_cuda_manual_seed adds
        torch.cuda.manual_seed(5)
        model = torch.nn.Linear(16, 16).cuda()
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
        save_checkpoint(str(tmp_path), 1, model, optimizer)
        expected = _dropout_draws(tracker)
        _dropout_draws(tracker)  # every generator moves on
        load_checkpoint(str(tmp_path), model, optimizer)
        for name, want, got in zip(("tracker fork", "default CUDA", "CPU"), expected, _dropout_draws(tracker)):
            assert torch.equal(want, got), name
    finally:
        tracker.reset()
        tracker.set_states(kept_states)
        tracker.seeds_ = kept_seeds
