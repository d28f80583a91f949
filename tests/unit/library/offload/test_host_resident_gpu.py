"""`optimizer_cpu_offload` on a GPU: the optimizer's device memory near 0 between steps, a step's peak
one parameter's window, and the same weights as without offload (benchmarks/optimizer_offload.py
measures; `make gpu-check` reports the numbers, docs/memory.md has them)."""

import pathlib
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"),
]
BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.mark.parametrize("name", ["adam", "muon"])
def test_offloaded_state_leaves_the_device_and_the_steps_unchanged(name: str) -> None:
    if str(BENCHMARKS) not in sys.path:  # the benchmark's module, as when it runs as a script
        sys.path.insert(0, str(BENCHMARKS))
    import optimizer_offload

    row = optimizer_offload.compare(name, hidden=2048, layers=2, device=torch.device("cuda"), steps=3)
    without, offloaded = row["without"], row["with"]
    assert without["bytes_per_param"] >= 4.0  # bf16 moments and remainders: 6 bytes for Adam, 4 for Muon
    assert offloaded["bytes_per_param"] < 0.01, row  # step counters at most
    assert offloaded["step_peak_bytes_per_param"] < 0.5 * without["step_peak_bytes_per_param"], row
    # The same kernels step each parameter with and without offload: the same weights, bit for bit.
    assert row["max_weight_difference"] == 0.0, row
