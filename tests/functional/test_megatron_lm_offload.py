"""Megatron-LM's loop on CPU (gloo, 2 ranks) with `--optimizer-cpu-offload` (docs/memory.md).

The model and the comparisons are test_megatron_lm_loop.py's. Every expectation comes from another
run: the same command line without offload. On this machine the host is also the device, so the
values cannot differ by where they sit; what is checked is that the streamed step (each offloaded
parameter's state copied into fresh tensors, stepped, copied back) computes the same steps, and
that checkpoints are the same with and without offload: a job switches offload on or off at a resume.
"""

import torch

from tests.functional.test_megatron_lm_loop import _runs
from tests.megatron_lm_in_process import run_megatron_lm_refused
from tests.megatron_lm_matrix import ITERATIONS, MODEL, SAVED_AT, assert_resumed_exactly, column, saving_at_3
from tests.refusals import assert_one_error_line

# The run without offload for Adam drops --use-precision-aware-optimizer too: megatron-core's config asks
# Transformer Engine's FusedAdam for it, except with offload. Its defaults (fp32 main weights and
# moments) are what the precision-aware optimizer keeps without its dtype flags.
DISTRIBUTED_ADAM = ["--optimizer", "adam", "--use-distributed-optimizer", "--bf16"]
PRECISION_AWARE = ["--use-precision-aware-optimizer"]
# Layer-wise Muon, bf16 momentum and parameter remainders (ours; megatron-core offloads no Muon).
LAYER_WISE_MUON = ["--optimizer", "muon", "--use-distributed-optimizer", "--bf16"] + PRECISION_AWARE + [
    "--exp-avg-dtype", "bf16"]


def _offload(fraction: float) -> list[str]:
    return ["--optimizer-cpu-offload", "--optimizer-offload-fraction", str(fraction)]


def _assert_same_losses(mine, reference, where: str) -> None:
    every = range(1, ITERATIONS + 1)
    for a, b in zip(mine, reference):
        assert column(a, "lm loss", every) == column(b, "lm loss", every), where
        assert column(a, "grad norm", every) == column(b, "grad norm", every), where


def _command_lines(plain: list[str], offloaded: list[str], tmp_path, name: str) -> list[list[str]]:
    """Without offload; offloading all of it (1.0) and part (0.5); saved at 3 with 0.5 and resumed with
    it and without; saved at 3 without and resumed with 1.0."""
    with_offload, without = str(tmp_path / f"{name}_with"), str(tmp_path / f"{name}_without")
    half, whole = offloaded + _offload(0.5), offloaded + _offload(1.0)
    return [plain, whole, half, half + saving_at_3(with_offload), half + ["--load", with_offload],
            plain + ["--load", with_offload], plain + saving_at_3(without), whole + ["--load", without]]


def _assert_offload_changes_nothing(runs, name: str) -> None:
    """Ours: bitwise, steps and checkpoints, each rank offloading what it owns."""
    plain, all_offloaded, half, saved, resumed, resumed_plain, saved_plain, resumed_offloaded = runs
    assert all(run.host_resident == {} for run in plain), name
    assert all(sum(run.host_resident.values()) > 0 for run in all_offloaded + half), name
    _assert_same_losses(all_offloaded, plain, f"{name}, fraction 1.0")
    _assert_same_losses(half, plain, f"{name}, fraction 0.5")
    assert_resumed_exactly(plain, saved, resumed, f"{name}: offloaded, resumed offloaded")
    assert_resumed_exactly(plain, saved, resumed_plain, f"{name}: offloaded, resumed without offload")
    assert_resumed_exactly(plain, saved_plain, resumed_offloaded, f"{name}: without offload, resumed offloaded")


def _assert_within_rounding(mine, reference, where: str) -> None:
    """The same losses from the save on, bitwise; the parameters at the end within fp32 rounding of
    the bf16 updates (megatron-core's host part steps with torch's fused CPU AdamW, which rounds a
    few elements otherwise than the unfused AdamW without offload: 3e-8 in one weight after 6 steps)."""
    after = range(SAVED_AT + 1, ITERATIONS + 1)
    for rank, (a, b) in enumerate(zip(mine, reference)):
        assert column(a, "lm loss", after) == column(b, "lm loss", after), f"{where}, rank {rank}"
        for key, value in a.parameters.items():
            assert torch.allclose(value.float(), b.parameters[key].float(), rtol=0, atol=1e-6), f"{where}: {key}"


def _assert_megatron_cores_offload_changes_nothing(runs, name: str) -> None:
    """megatron-core's HybridDeviceOptimizer: the losses of the run without offload, bitwise; its own
    resume exact; a checkpoint moving between the two continues within rounding."""
    plain, all_offloaded, half, saved, resumed, resumed_plain, saved_plain, resumed_offloaded = runs
    assert all(run.optimizer_package == "megatron" for line in runs for run in line), name
    _assert_same_losses(all_offloaded, plain, f"{name}, fraction 1.0")
    _assert_same_losses(half, plain, f"{name}, fraction 0.5")
    assert_resumed_exactly(half, saved, resumed, f"{name}: offloaded, resumed offloaded")
    _assert_within_rounding(resumed_plain, plain, f"{name}: offloaded, resumed without offload")
    _assert_within_rounding(resumed_offloaded, plain, f"{name}: without offload, resumed offloaded")


def test_offload_changes_no_step_and_no_checkpoint(run_distributed, tmp_path) -> None:
    """Layer-wise Muon (ours, streamed through the device) and distributed Adam (megatron-core's
    DistributedOptimizer with its HybridDeviceOptimizer, which steps the offloaded part on the host),
    offloading all (1.0) or half (0.5) of each rank's state: the losses and gradient norms of the run
    without offload, bitwise. A torch_dist checkpoint saved at 3 with offload resumes with and without
    it, and one saved without resumes with it: for ours each continues as the run not interrupted, to
    the last bit of every rank's parameters and optimizer state (megatron-core's: see above)."""
    muon = _command_lines(LAYER_WISE_MUON, LAYER_WISE_MUON, tmp_path, "muon")
    adam = _command_lines(DISTRIBUTED_ADAM, DISTRIBUTED_ADAM + PRECISION_AWARE, tmp_path, "adam")
    runs = _runs(run_distributed, *muon, *adam)
    _assert_offload_changes_nothing(runs[:8], "layer-wise Muon")
    _assert_megatron_cores_offload_changes_nothing(runs[8:], "distributed Adam")


REFUSED = {  # command line, what its one error line says
    "Megatron-LM's check": (LAYER_WISE_MUON[:4] + ["--optimizer-cpu-offload"],
                            "must be used in conjunction with `--use-precision-aware-optimizer`"),
    "ours, the fraction": (LAYER_WISE_MUON + _offload(1.5),
                           "--optimizer-offload-fraction must be in [0, 1]"),
    "ours, the fraction with megatron-core's optimizer": (
        DISTRIBUTED_ADAM + PRECISION_AWARE + _offload(2.0), "--optimizer-offload-fraction must be in [0, 1]"),
}


def test_what_megatron_core_refuses_is_refused_at_start_up(run_distributed) -> None:
    # First a run that trains, as test_megatron_lm_loop.py's refusals do: with refusals alone the harness
    # found a gloo thread left in a worker.
    argvs = [MODEL + ["--train-iters", "1"]] + [MODEL + flags for flags, _ in REFUSED.values()]
    results = run_distributed(run_megatron_lm_refused, 2, args=(argvs,), timeout=600)
    for rank, (trained, *per_line) in enumerate(results):
        assert trained[0] == 0, (rank, trained[1][-2000:])
        for (name, (_, message)), (status, stderr, _) in zip(REFUSED.items(), per_line):
            assert status == 2, (name, rank, status, stderr[-2000:])
            assert_one_error_line(stderr, rank, "pretrain_gpt_megatron_lm.py", message, name)
