"""scripts/pretrain_gpt.py's --fp16 and --bf16 (issue 14, item 5), run in the harness's workers.

- --fp16 builds an fp16 model, scales the loss and learns; an inf injected into one gradient
  (tests/pretrain_gpt_in_process.py, a test aid) makes the dynamic scaler skip that step and
  halve the scale, and training goes on.
- --bf16 sums micro-batch gradients and all-reduces them in fp32 (`main_grad`): its losses follow
  the fp32 run's, and DP=2 equals DP=1.
"""

import pytest
import torch

from tests.pretrain_gpt_in_process import run_pretrain_gpt, run_pretrain_gpt_with_overflow

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-2",
        "--log-interval", "1", "--eval-iters", "0", "--optimizer", "adam"]
FP16 = ["--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1"]  # one overflow halves the scale


def losses(records):
    return [r["loss"] for r in records]


@pytest.mark.parametrize("accumulation", [[], ["--accumulate-allreduce-grads-in-fp32"]], ids=["fp16-grads", "fp32-main-grad"])
def test_fp16_learns_and_backs_off_after_an_overflow(accumulation, run_distributed):
    overflow_at = 4
    records = run_distributed(run_pretrain_gpt_with_overflow, 1, args=(ARGV + FP16 + accumulation, overflow_at))[0]
    fp32 = run_distributed(run_pretrain_gpt, 1, args=(ARGV,))[0]
    # Before the overflow the fp16 run follows the fp32 one; the grad norm is the unscaled one
    # (a loss not multiplied by the scale would report it 4096 times too small).
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in records[:overflow_at - 1]] == pytest.approx(
            [r[key] for r in fp32[:overflow_at - 1]], rel=1e-2)
    assert [r["skipped"] for r in records] == [int(r["iteration"] == overflow_at) for r in records]
    scales = [r["loss_scale"] for r in records]
    assert scales == [4096.0] * (overflow_at - 1) + [2048.0] * (len(records) - overflow_at + 1)
    assert records[overflow_at - 1]["loss"] is None  # a skipped step's loss is not averaged
    trained = [loss for loss in losses(records) if loss is not None]
    assert len(trained) == 9 and trained[-1] < trained[0] - 0.1


def test_bf16_accumulates_in_fp32_and_matches_fp32_and_dp1(run_distributed):
    fp32 = losses(run_distributed(run_pretrain_gpt, 1, args=(ARGV,))[0])
    bf16 = losses(run_distributed(run_pretrain_gpt, 1, args=(ARGV + ["--bf16"],))[0])
    bf16_dp2 = run_distributed(run_pretrain_gpt, 2, args=(ARGV + ["--bf16"],))
    assert fp32[-1] < fp32[0] - 0.1
    # bf16 parameters and activations: ~3 significant digits per operation, and the runs drift.
    assert bf16 == pytest.approx(fp32, rel=1e-2)
    # DP=2 sums 2 micro-batches per rank, then the ranks' fp32 buckets; DP=1 sums 4: the fp32
    # sums differ in summation order only (measured: 6e-8 relative).
    for records in bf16_dp2:
        assert losses(records) == pytest.approx(bf16, rel=1e-5)


def _parse(argv: list[str], monkeypatch):
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return parse_args(["--lr", "1.0"] + argv)


def test_precision_flags_reach_the_model_and_the_gradients(monkeypatch):
    args, settings, _ = _parse(["--optimizer", "adam", "--fp16"], monkeypatch)
    assert settings.params_dtype == torch.float16 and not args.accumulate_allreduce_grads_in_fp32
    args, settings, _ = _parse(["--bf16"], monkeypatch)  # fp32 accumulation is implied, as in Megatron-LM
    assert settings.params_dtype == torch.bfloat16 and args.accumulate_allreduce_grads_in_fp32


def test_main_grads_dtype_bf16_keeps_gradients_in_bf16(monkeypatch):
    """Megatron-LM: --main-grads-dtype bf16 turns off --bf16's fp32 gradient accumulation."""
    args, _, _ = _parse(["--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], monkeypatch)
    assert not args.accumulate_allreduce_grads_in_fp32
    args, _, _ = _parse(["--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "fp32"], monkeypatch)
    assert args.accumulate_allreduce_grads_in_fp32


@pytest.mark.parametrize("argv,message", [
    (["--fp16", "--bf16"], "--fp16 and --bf16 are both True; choose at most one."),
    (["--fp16", "--optimizer", "muon"], "--fp16 is not supported with --optimizer muon"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be > 0 or None; got 0.0."),
])
def test_bad_precision_flags_exit_with_one_line(argv, message, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, monkeypatch)
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
    assert exit_info.value.code == 2 and len(lines) == 1
    assert lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines
