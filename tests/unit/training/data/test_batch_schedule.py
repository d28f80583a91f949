"""A growing global batch: --rampup-batch-size and --step-batch-size-schedule
(megatron_eopt/training/data/batch_schedule.py) in scripts/pretrain_gpt.py.

References: batch sizes worked out by hand from Megatron-LM's definitions; a constant-batch run
(the ramp's first iterations read the same samples); the same ramp at DP 2, at PP 2 and resumed
from a checkpoint in the middle of the ramp (losses equal, fp32).
"""

import pytest

from megatron_eopt.training.data.batch_schedule import parse_step_schedule, rampup_schedule

ADAM = ["--optimizer", "adam", "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
        "--mock-data", "--micro-batch-size", "2", "--eval-iters", "0"]  # no evaluation: not checked here
# Batch 4, 4, 8 (from sample 8), then 12 (from sample 16) until 60 samples: 4+4+8+12*4 = 64.
RAMP = ADAM + ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--train-samples", "60"]
RAMP_SIZES = [4, 4, 8, 12, 12, 12, 12]


def test_rampup_steps_follow_megatron_lm() -> None:
    # (1536 - 16) / 16 = 95 steps over 5859375 samples: step k from ceil(k * 61677.63...) on.
    steps = rampup_schedule(16, 16, 5_859_375, 1536)
    assert len(steps) == 96 and steps[0] == (0, 16) and steps[-1] == (5_859_375, 1536)
    assert steps[1] == (61_678, 32) and steps[2] == (123_356, 48)
    assert rampup_schedule(4, 4, 16, 12) == [(0, 4), (8, 8), (16, 12)]
    assert rampup_schedule(4, 4, 0, 12) == [(0, 12)]  # no ramp-up samples: the full batch at once
    assert rampup_schedule(2, 1, 2, 6) == [(0, 2), (1, 4), (2, 6)]  # steps closer than a sample: the last wins


SCHEDULES = ["0:4 256:8", "0:4,1K:8", "  0:4 ,, 2.5k:16  1M:32 ", "0:1 1b:2 1T:4", "512:8 0:4", "0:4 0:8", "0:0",
             "64:4", "0.9:3 7.7:5"]


@pytest.mark.parametrize("seq_length", [None, 1, 32])
def test_step_schedules_are_read_as_megatron_core_reads_them(seq_length) -> None:
    """parse_step_schedule (torch-free) against megatron-core's own parser, the reference."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator as Calculator

    for text in SCHEDULES:
        assert parse_step_schedule(text, seq_length) == Calculator._parse_schedule(text, seq_length), text
    for text in ("0:4 x", "0:4 a:8", "0:4 8:b", "0:4 :8", "0:4 1:inf"):
        with pytest.raises(ValueError, match=r"^Invalid (schedule entry|number)"):
            parse_step_schedule(text, seq_length)


def _parse(argv: list[str], monkeypatch, world_size: int = 1):
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return parse_args(argv)


def test_iterations_and_samples_of_a_ramp_and_a_step_schedule(monkeypatch) -> None:
    args, _, _ = _parse(RAMP, monkeypatch)
    schedule = args.batch_schedule
    assert [schedule.size(i) for i in range(1, 8)] == RAMP_SIZES and args.train_iters == 7
    assert [schedule.first_sample(i) for i in range(1, 8)] == [0, 4, 8, 16, 28, 40, 52]
    # Thresholds count tokens (--seq-length 32): 0 -> 4, 256 tokens = 8 samples -> 8.
    args, _, _ = _parse(ADAM + ["--step-batch-size-schedule", "0:4 256:8", "--train-samples", "30"], monkeypatch)
    assert args.global_batch_size == 8 and [args.batch_schedule.size(i) for i in range(1, 6)] == [4, 4, 8, 8, 8]
    assert args.train_iters == 5  # 4 + 4 + 8 + 8 + 8 = 32 >= 30
    args, _, _ = _parse(ADAM + ["--step-batch-size-schedule", "0:4 1K:8", "--train-samples", "8"], monkeypatch)
    assert [args.batch_schedule.size(i) for i in (1, 2)] == [4, 4]  # 1K tokens = 31 samples: not reached


@pytest.mark.parametrize("argv,message", [
    (["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--train-iters", "5"],
     "--rampup-batch-size needs --train-samples (Megatron-LM: no batch-size ramp-up for iteration-based training"),
    (["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--step-batch-size-schedule", "0:4",
      "--train-samples", "60"], "--rampup-batch-size and --step-batch-size-schedule exclude each other"),
    (["--global-batch-size", "12", "--rampup-batch-size", "4", "5", "16", "--train-samples", "60"],
     "--global-batch-size 12 must be START plus a whole number of INCREMENTs"),
    (["--global-batch-size", "12", "--rampup-batch-size", "0", "4", "16", "--train-samples", "60"],
     "START and INCREMENT must be >= 1"),
    (["--global-batch-size", "12", "--rampup-batch-size", "3", "3", "16", "--train-samples", "60"],
     "--rampup-batch-size: batch size 3 is not a multiple of --micro-batch-size * data-parallel size = 2."),
    (["--global-batch-size", "8", "--step-batch-size-schedule", "0:4 64:8", "--train-samples", "60"],
     "--step-batch-size-schedule sets the global batch size (its last batch); --global-batch-size excludes it"),
    (["--step-batch-size-schedule", "64:4", "--train-samples", "60"], "the first threshold must be 0"),
    (["--step-batch-size-schedule", "0:4 x", "--train-samples", "60"], "--step-batch-size-schedule '0:4 x': Invalid"),
], ids=["iterations", "both", "increment", "start", "multiple", "global-batch", "threshold", "format"])
def test_bad_schedule_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(ADAM + argv, monkeypatch)
    lines = [line for line in capsys.readouterr().err.splitlines() if "CUDA runtime" not in line]
    assert len(lines) == 1 and message in lines[0], lines


def _losses(records: list[dict]) -> list[float]:
    return [record["loss"] for record in records]


def test_ramp_reads_consumed_samples_and_matches_other_layouts(run_distributed, tmp_path) -> None:
    """The ramp's first two batches (4 samples each) are a constant batch-4 run's first two; the
    whole ramp gives the same losses at DP 2, at PP 2 (a pipeline schedule per micro-batch count)
    and resumed from a checkpoint saved mid-ramp; the log counts the samples consumed."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    (ramp,) = run_distributed(run_pretrain_gpt, 1, args=(RAMP,))
    assert [r["global_batch_size"] for r in ramp] == RAMP_SIZES
    assert [r["consumed_samples"] for r in ramp] == [4, 8, 16, 28, 40, 52, 64]
    (constant,) = run_distributed(run_pretrain_gpt, 1, args=(ADAM + ["--global-batch-size", "4", "--train-iters", "2"],))
    assert _losses(ramp)[:2] == _losses(constant)

    data_parallel = run_distributed(run_pretrain_gpt, 2, args=(RAMP,))[0]
    pipeline = run_distributed(run_pretrain_gpt, 2, args=(RAMP + ["--pipeline-model-parallel-size", "2"],))[0]
    for other in (data_parallel, pipeline):
        assert _losses(other) == pytest.approx(_losses(ramp), rel=1e-5, abs=1e-6)

    checkpoints = str(tmp_path / "ckpt")
    run_distributed(run_pretrain_gpt, 1, args=(RAMP + ["--save", checkpoints, "--exit-interval", "3"],))
    (resumed,) = run_distributed(run_pretrain_gpt, 1, args=(RAMP + ["--load", checkpoints],))
    assert [r["iteration"] for r in resumed] == [4, 5, 6, 7]
    assert [r["consumed_samples"] for r in resumed] == [28, 40, 52, 64]
    assert _losses(resumed) == _losses(ramp)[3:]
