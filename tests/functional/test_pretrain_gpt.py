"""`scripts/pretrain_gpt.py` end to end on CPU: golden losses, TP/DP layouts, bad flags.

Golden losses (`golden/pretrain_gpt_{adam,muon}.json`) are the TP=1/DP=1 loss sequences of a
tiny GPT (2 layers, hidden 32, 4 heads, 2 query groups, ffn 64, SwiGLU, seq 16, global batch 16
of micro-batches of 2, 20 iterations, cosine lr 1e-2 -> 1e-3 after 2 warmup iterations). Each
JSON holds the exact training command (`train_command`) and the command that regenerates it:

    .venv/bin/python tests/functional/test_pretrain_gpt.py --regenerate-golden

Tolerance 1e-4 (absolute, on losses ~3-4): layouts and machines differ only in reduction order
(TP splits matmuls and the vocab-parallel softmax, DP sums gradients in another order, gloo vs
local sums, CPU kernels); over 20 iterations that was measured at ~5e-7 here, while any real
error in slicing, gradient averaging or the optimizer moves the loss by >1e-3 within a few steps.

Every layout runs with both optimizers: TP=2/DP=2 (4 processes), TP=1/DP=2 and TP=2/DP=1.
--data-path, --bf16, --exit-interval and --plot are checked on one more launch; the progress
bar in-process. Run time is dominated by importing megatron-core (~15-20 s of CPU per process
on 2 cores).
"""

import argparse
import io
import json
import math
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest

from scripts.plot_png import BLACK, PALETTE
from tests.functional.png_reader import read_png

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
TOLERANCE = 1e-4
REGENERATE = ".venv/bin/python tests/functional/test_pretrain_gpt.py --regenerate-golden"
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--swiglu", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "16", "--train-iters", "20", "--lr", "1e-2", "--min-lr", "1e-3",
    "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--log-interval", "1", "--seed", "1234",
]
# The golden losses are fp32 runs: pinned, since the default precision is chosen from the hardware.
OPTIMIZER_FLAGS = {"adam": ["--optimizer", "adam"],
                   "muon": ["--optimizer", "muon", "--use-distributed-optimizer", "--muon-fp32-matmul-prec", "highest"]}


def _command(nproc: int, optimizer: str, extra: list[str]) -> list[str]:
    if nproc == 1:
        launcher = [sys.executable, "scripts/pretrain_gpt.py"]
    else:
        torchrun = str(pathlib.Path(sys.executable).with_name("torchrun"))
        launcher = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "scripts/pretrain_gpt.py"]
    return launcher + MODEL_FLAGS + OPTIMIZER_FLAGS[optimizer] + extra


def _launch(nproc: int, optimizer: str, metrics: pathlib.Path, extra: list[str] = ()) -> tuple[list[dict], str]:
    """Train 20 logged iterations; returns the metrics records and rank 0's stdout."""
    command = _command(nproc, optimizer, [*extra, "--metrics-jsonl", str(metrics)])
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    log_lines = [line for line in result.stdout.splitlines() if line.startswith(" iteration ")]
    assert len(log_lines) == 20, result.stdout
    return [json.loads(line) for line in metrics.read_text().splitlines()], result.stdout


def _train(nproc: int, optimizer: str, metrics: pathlib.Path, extra: list[str] = ()) -> list[dict]:
    return _launch(nproc, optimizer, metrics, extra)[0]


def _golden(optimizer: str) -> list[float]:
    return json.loads((GOLDEN / f"pretrain_gpt_{optimizer}.json").read_text())["losses"]


def _assert_close(losses: list[float], expected: list[float]) -> None:
    assert len(losses) == len(expected) == 20
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst <= TOLERANCE, f"max |loss - golden| = {worst:.2e} > {TOLERANCE}: {losses} vs {expected}"


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_golden_losses_tp1_dp1(optimizer: str, tmp_path: pathlib.Path) -> None:
    records = _train(1, optimizer, tmp_path / "metrics.jsonl")
    assert set(records[0]) == {"iteration", "loss", "lr", "grad_norm", "skipped", "elapsed_ms"}
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert all(r["skipped"] == 0 for r in records)
    _assert_close([r["loss"] for r in records], _golden(optimizer))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # it learns


LAYOUTS = [  # (processes, TP, optimizer)
    (4, 2, "adam"),
    (4, 2, "muon"),
    (2, 1, "muon"),
    (2, 2, "adam"),
    (2, 1, "adam"),
    (2, 2, "muon"),
]


@pytest.mark.parametrize(
    "nproc,tp,optimizer",
    [pytest.param(n, tp, opt, id=f"tp{tp}-dp{n // tp}-{opt}") for n, tp, opt in LAYOUTS],
)
def test_layouts_match_tp1_dp1(nproc: int, tp: int, optimizer: str, tmp_path: pathlib.Path) -> None:
    records = _train(nproc, optimizer, tmp_path / "metrics.jsonl", ["--tensor-model-parallel-size", str(tp)])
    _assert_close([r["loss"] for r in records], _golden(optimizer))


# --data-path, --bf16, --exit-interval and --plot share one launch (each launch costs ~16 s of
# imports): 40 iterations asked for, an exit after 20, in bf16, on a text file of a few dozen
# distinct bytes, which a byte-level model learns far faster than the 256-token rule task.
FLAGS_TEXT = "the quick brown fox jumps over the lazy dog. " * 60
CURVE_PIXELS = 300  # a curve across the plot covers thousands; the legend swatch alone ~70


@dataclass(frozen=True)
class FlagsRun:
    records: list[dict]
    stdout: str
    plot: pathlib.Path


@pytest.fixture(scope="module")
def flags_run(tmp_path_factory: pytest.TempPathFactory) -> FlagsRun:
    folder = tmp_path_factory.mktemp("flags")
    (folder / "text.txt").write_text(FLAGS_TEXT)
    extra = ["--data-path", str(folder / "text.txt"), "--bf16", "--train-iters", "40", "--exit-interval", "20",
             "--plot", str(folder / "loss.png")]
    records, stdout = _launch(1, "adam", folder / "metrics.jsonl", extra)
    return FlagsRun(records, stdout, folder / "loss.png")


def test_data_path_trains_on_the_text(flags_run: FlagsRun) -> None:
    losses = [r["loss"] for r in flags_run.records]
    assert abs(losses[0] - math.log(256)) < 0.2, losses  # untrained, over 256 byte tokens
    assert sum(losses[-5:]) / 5 < 2.5, losses  # seen: ~1.7


def test_bf16_runs_with_finite_losses(flags_run: FlagsRun) -> None:
    assert "parameters on rank 0, torch.bfloat16" in flags_run.stdout
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in flags_run.records)


def test_exit_interval_stops_at_that_iteration(flags_run: FlagsRun) -> None:
    assert [r["iteration"] for r in flags_run.records] == list(range(1, 21))
    assert "> exiting after iteration 20 (--exit-interval 20)" in flags_run.stdout


def test_plot_is_a_png_with_the_curve(flags_run: FlagsRun) -> None:
    image = read_png(flags_run.plot)
    assert (image.width, image.height) == (640, 400)
    assert image.colors[PALETTE[0]] > CURVE_PIXELS, image.colors.most_common(6)
    assert image.colors[BLACK] > CURVE_PIXELS  # axes and labels


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream_type,rank,bar", [(_Terminal, 0, True), (io.StringIO, 0, False), (_Terminal, 1, False)],
                         ids=["terminal-rank0", "pipe-rank0", "terminal-rank1"])
def test_progress_bar_only_on_rank0_terminal(stream_type, rank: int, bar: bool, monkeypatch) -> None:
    """In-process: the Logger alone, iterations 1-4 logged every 2."""
    from scripts import pretrain_gpt

    stream = stream_type()
    monkeypatch.setattr(sys, "stdout", stream)
    args = argparse.Namespace(train_iters=4, log_interval=2, metrics_jsonl=None)
    layout = pretrain_gpt.Layout(world_size=2, rank=rank, tp=1, dp=2, grad_accumulation_steps=1)
    log = pretrain_gpt.Logger(args, layout)
    for iteration in range(1, 5):
        log.iteration(iteration, 3.0, 1e-3, 1.0, True)
    log.close()
    out = stream.getvalue()
    assert ("\r" in out) == bar, repr(out)
    assert out.count("elapsed ms per iteration") == (0 if rank else 3), repr(out)  # iterations 1, 2, 4
    if bar:
        assert f"[{'#' * pretrain_gpt.ProgressBar.WIDTH}] 4/4 | loss 3.0000" in out and out.endswith("\n")
        assert out.count("\r iteration ") == 2, repr(out)  # the bar is wiped before each later log line


def test_bad_optimizer_name_exits_with_argparse_error() -> None:
    result = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", "--optimizer", "nope"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: argument --optimizer")


@pytest.mark.parametrize(
    "argv,world_size,message",
    [
        (["--fp16", "--optimizer", "muon", "--lr", "1e-3"], "1", "--fp16 is not supported with --optimizer muon"),
        (["--tensor-model-parallel-size", "3", "--lr", "1e-3"], "2", "--tensor-model-parallel-size 3 must divide"),
        (["--micro-batch-size", "3", "--global-batch-size", "8", "--lr", "1e-3"], "2", "--global-batch-size 8"),
        (["--hidden-size", "48", "--num-attention-heads", "3", "--num-query-groups", "1", "--tensor-model-parallel-size", "2",
          "--lr", "1e-3"], "2", "num_attention_heads (3) must be divisible by tensor parallel size 2"),
        ([], "1", "--lr is required"),
    ],
    ids=["fp16-muon", "tp3-on-2-ranks", "global-batch", "heads-tp", "no-lr"],
)
def test_bad_flags_exit_with_one_line(argv, world_size, message, monkeypatch, capsys) -> None:
    """Checked in-process (the checks run before any process group; a subprocess costs ~16 s)."""
    from scripts import pretrain_gpt

    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.parse_args(argv)
    assert exit_info.value.code == 2
    # Only our line: torch may log a "No CUDA runtime" warning when emerging_optimizers loads.
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines


def regenerate_golden() -> None:
    import tempfile

    for optimizer in OPTIMIZER_FLAGS:
        with tempfile.TemporaryDirectory() as folder:
            records = _train(1, optimizer, pathlib.Path(folder) / "metrics.jsonl")
        command = _command(1, optimizer, ["--metrics-jsonl", "METRICS.jsonl"])  # losses read from it
        command[0] = ".venv/bin/python"
        golden = {"command": REGENERATE, "train_command": " ".join(command), "tolerance": TOLERANCE,
                  "losses": [r["loss"] for r in records]}
        (GOLDEN / f"pretrain_gpt_{optimizer}.json").write_text(json.dumps(golden, indent=1) + "\n")
        print(f"{optimizer}: loss {golden['losses'][0]:.4f} -> {golden['losses'][-1]:.4f}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate-golden"]:
        sys.exit(f"usage: {REGENERATE}")
    regenerate_golden()
