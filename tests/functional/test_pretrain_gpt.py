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
Run time is dominated by importing megatron-core (~15-20 s of CPU per process on 2 cores).
"""

import json
import pathlib
import subprocess
import sys

import pytest

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
OPTIMIZER_FLAGS = {"adam": ["--optimizer", "adam"], "muon": ["--optimizer", "muon", "--use-distributed-optimizer"]}


def _command(nproc: int, optimizer: str, extra: list[str]) -> list[str]:
    if nproc == 1:
        launcher = [sys.executable, "scripts/pretrain_gpt.py"]
    else:
        torchrun = str(pathlib.Path(sys.executable).with_name("torchrun"))
        launcher = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "scripts/pretrain_gpt.py"]
    return launcher + MODEL_FLAGS + OPTIMIZER_FLAGS[optimizer] + extra


def _train(nproc: int, optimizer: str, metrics: pathlib.Path, extra: list[str] = ()) -> list[dict]:
    command = _command(nproc, optimizer, [*extra, "--metrics-jsonl", str(metrics)])
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    log_lines = [line for line in result.stdout.splitlines() if line.startswith(" iteration ")]
    assert len(log_lines) == 20, result.stdout
    return [json.loads(line) for line in metrics.read_text().splitlines()]


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
