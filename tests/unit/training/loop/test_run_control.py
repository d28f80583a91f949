"""Megatron-LM's run-control flags in scripts/pretrain_gpt.py (megatron_eopt/training/loop/run_control.py), at 2 ranks:

- `--exit-signal-handler`: SIGTERM sent to one rank of a running run during iteration 3 makes
  both ranks save iteration 3 and stop; resuming it gives the uninterrupted run's later losses.
- `--finetune`: equals a run from scratch whose model was given the checkpoint's weights by
  megatron_eopt.checkpointing directly (fresh optimizer, iteration and data from 0).
- `--skip-train`: the loaded model's validation loss equals the uninterrupted run's final one.
- `--exit-on-missing-checkpoint`: an empty --load stops the run with one line.
Flag errors are checked without a process group.
"""

import os
import pathlib
import signal

import pytest

from tests.pretrain_gpt_in_process import ranks_exit_together
from megatron_eopt.training import pretrain
from megatron_eopt.training.arguments.parser import parse_args
from megatron_eopt.training.loop import train as train_loop

ARGV = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-2", "--log-interval", "1",
        "--eval-interval", "3", "--eval-iters", "1"]


def _losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["iteration"], r["loss"]) for r in records]


def _main_collecting_validation(argv: list[str]) -> tuple[list[dict], list]:
    """pretrain.main, also returning every evaluation result (split, iteration, loss)."""
    original, results = train_loop.Evaluator._run, []

    def run(self, *args, **kwargs):
        results.append(original(self, *args, **kwargs))
        return results[-1]

    train_loop.Evaluator._run = run
    try:
        return pretrain.main(argv), [(r.split, r.iteration, r.loss) for r in results]
    finally:
        train_loop.Evaluator._run = original


def _signal_at(rank: int, iteration: int, argv: list[str]) -> list[dict]:
    """A run in which rank 1 sends itself SIGTERM in the middle of `iteration`'s step."""
    original, calls = train_loop.train_step, iter(range(1, 10**6))

    def train_step(*args, **kwargs):
        if next(calls) == iteration and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    train_loop.train_step = train_step
    try:
        return pretrain.main(argv)
    finally:
        train_loop.train_step = original


def _finetune_reference(checkpoint: str, argv: list[str]) -> list[dict]:
    """A run from scratch whose freshly built model first takes the checkpoint's weights (model
    only, through megatron_eopt.checkpointing, not the trainer's resume)."""
    from megatron_eopt.checkpointing import load_checkpoint

    original = train_loop.build_gpt_model_chunks

    def build(settings, device):
        chunks = original(settings, device)
        load_checkpoint(checkpoint, chunks, load_optimizer=False, load_rng=False)
        return chunks

    train_loop.build_gpt_model_chunks = build
    try:
        return pretrain.main(argv)
    finally:
        train_loop.build_gpt_model_chunks = original


def _run_control_body(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    full = pathlib.Path(folder, "full")
    out["full"], out["full_validation"] = _main_collecting_validation([*ARGV, "--save", str(full)])
    stopped = pathlib.Path(folder, "stopped")
    signalled = [*ARGV, "--save", str(stopped), "--exit-signal-handler"]
    out["stopped"] = _signal_at(rank, 3, signalled)
    out["stopped_saves"] = sorted(p.name for p in stopped.iterdir() if p.name.startswith("iter_"))
    out["resumed"] = pretrain.main([*signalled, "--load", str(stopped)])
    short = [arg if arg != "6" else "3" for arg in ARGV]  # --train-iters 3
    out["finetune"] = pretrain.main([*short, "--load", str(full), "--finetune"])
    out["finetune_reference"] = _finetune_reference(str(full), short)
    out["skip_train"], out["skip_train_validation"] = _main_collecting_validation(
        [*ARGV, "--load", str(full), "--skip-train"])
    try:
        with ranks_exit_together():
            pretrain.main([*ARGV, "--load", str(pathlib.Path(folder, "empty")), "--exit-on-missing-checkpoint"])
        out["missing_exit"] = None
    except SystemExit as exit_info:
        out["missing_exit"] = exit_info.code
    return out


def test_signal_finetune_skip_train_and_missing_checkpoint(tmp_path, run_distributed, capfd) -> None:
    results = run_distributed(_run_control_body, 2, args=(str(tmp_path),))
    out = results[0]
    full = _losses(out["full"])
    # SIGTERM reached rank 1 only; both ranks stopped after iteration 3 and saved it.
    assert [_losses(r["stopped"]) for r in results] == [full[:3]] * 2
    assert out["stopped_saves"] == ["iter_0000003"]
    assert _losses(out["resumed"]) == full[3:]  # bitwise: the same steps on the same data
    # --finetune: iterations from 1 on the first samples, fresh optimizer, the checkpoint's weights.
    assert _losses(out["finetune"]) == _losses(out["finetune_reference"])
    assert [i for i, _ in _losses(out["finetune"])] == [1, 2, 3]
    assert out["finetune"][0]["loss"] < full[0][1] - 0.1  # it did start from the trained weights
    # --skip-train: no iterations; validation (and no test split in the generated task) at 6.
    assert out["skip_train"] == [] and out["skip_train_validation"] == [out["full_validation"][-1]]
    assert out["missing_exit"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--exit-signal", "SIGUSR2"], "--exit-signal SIGUSR2 needs --exit-signal-handler."),
    (["--finetune"], "--finetune needs --load"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load"),
    (["--dist-ckpt-strictness", "log_all"], "--dist-ckpt-strictness log_all is not offered"),
    (["--use-checkpoint-args"], "--use-checkpoint-args: checkpoints here do not store the command line"),
    (["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"], "exclude each other"),
    (["--mock-data", "--reset-attention-mask", "--pipeline-model-parallel-size", "2"],
     "--reset-attention-mask needs --pipeline-model-parallel-size 1"),
])
def test_bad_run_control_flags_exit_with_one_line(argv, message, monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*argv, "--lr", "1e-3"])
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
    assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_dash_spellings_and_no_effect_checkpoint_flags(monkeypatch) -> None:
    from megatron_eopt.training.arguments.no_effect import no_effect_lines
    from megatron_eopt.training.loop.run_control import run_control_lines

    monkeypatch.setenv("WORLD_SIZE", "1")
    args, _, _ = parse_args(["--lr", "1e-3", "--override-opt-param-scheduler", "--async-save",
                                          "--use-dist-ckpt", "--no-ckpt-fully-parallel-save",
                                          "--ckpt-fully-parallel-load", "--ckpt-assume-constant-structure",
                                          "--auto-detect-ckpt-format", "--ckpt-fully-parallel-save",
                                          "--dist-ckpt-strictness", "raise_all"])
    assert args.override_opt_param_scheduler and args.async_save  # --async-save is active (docs/reliability.md)
    named = [line.split(":")[0] for line in no_effect_lines(args) + run_control_lines(args)]
    assert named == ["--use-dist-ckpt", "--auto-detect-ckpt-format", "--ckpt-fully-parallel-save",
                     "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                     "--ckpt-assume-constant-structure", "--dist-ckpt-strictness raise_all"]
    args, _, _ = parse_args(["--lr", "1e-3", "--use-checkpoint-opt-param-scheduler"])
    assert args.use_checkpoint_opt_param_scheduler
