"""`make demo`: AdamW vs Muon on the default small GPT, each trained by two processes (torchrun).

Runs the trainer (scripts/pretrain_gpt.py) twice with the same model, data, seed and schedule (cosine after
10 warm-up iterations, to a tenth of the peak lr) and only the optimizer and its tuned peak lr
changed, then writes to `--out-dir` (default demo_output/):

    loss.png                 both loss curves (mean of the last 10 iterations, log scale)
    summary.json, .txt       final losses, ms per iteration, when Muon reaches AdamW's final loss
    adamw.*, muon.*          each run's --metrics-jsonl and full log

The lrs were tuned by a sweep on this task (see README.md, "Demo"). Losses are smoothed over
WINDOW iterations because one global batch of 8 sequences is a noisy estimate.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from megatron_eopt.training.logging.training_log import (
    ITERATION_IN_LINE,
    PALETTE,
    Curve,
    plot_curves,
)

WINDOW = 10
NPROC = 2
COMMON_FLAGS = ["--global-batch-size", "8", "--lr-warmup-iters", "10", "--lr-decay-style", "cosine",
                "--log-interval", "1", "--seed", "1234"]


@dataclass(frozen=True)
class Run:
    name: str
    lr: float
    flags: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.name.lower()

    def command(self, train_iters: int, metrics: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                "-m", "megatron_eopt.training.pretrain", *COMMON_FLAGS, *self.flags,
                "--train-iters", str(train_iters), "--lr", str(self.lr), "--min-lr", str(self.lr / 10),
                "--metrics-jsonl", metrics]


RUNS = (
    Run("AdamW", 1e-2, ("--optimizer", "adam")),
    # Matched to AdamW's update RMS, so the embeddings and norms (stepped by Adam inside Muon)
    # and the Muon-stepped matrices share one sensible lr.
    Run("Muon", 2e-2, ("--optimizer", "muon", "--use-distributed-optimizer", "--muon-match-adamw-rms")),
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--out-dir", type=os.path.abspath, default="demo_output")  # argparse converts the default too
    args = parser.parse_args(argv)
    if args.train_iters < WINDOW:
        parser.error(f"--train-iters must be >= {WINDOW} (the smoothing window); got {args.train_iters}")
    return args


def train(run: Run, args: argparse.Namespace) -> list[dict]:
    """One torchrun job; its log goes to a file, and every tenth of the run is echoed here."""
    metrics, log_path = (os.path.join(args.out_dir, f"{run.key}.{ext}") for ext in ("jsonl", "log"))
    command = run.command(args.train_iters, metrics)
    print(f"> {run.name}: torchrun {' '.join(command[3:])}", flush=True)
    echo_every = max(1, args.train_iters // 10)
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            log.write(line)
            if _is_milestone(line, echo_every):
                print(line, end="", flush=True)
    if process.returncode:
        sys.exit(f"{run.name} failed (exit {process.returncode}); see {log_path}")
    with open(metrics) as handle:
        return [json.loads(line) for line in handle]


def _is_milestone(line: str, every: int) -> bool:
    if line.startswith("> "):
        return True
    match = ITERATION_IN_LINE.search(line)
    return bool(match) and int(match.group(1)) % every == 0


def smoothed(losses: list[float]) -> list[float]:
    """Mean of the last WINDOW losses (fewer at the start) at each iteration."""
    return [statistics.fmean(losses[max(0, i + 1 - WINDOW):i + 1]) for i in range(len(losses))]


def iterations_to_reach(losses: list[float], target: float) -> Optional[int]:
    """First iteration (1-based, >= WINDOW) whose smoothed loss is <= target; None if never."""
    return next((i + 1 for i, loss in enumerate(smoothed(losses)) if i + 1 >= WINDOW and loss <= target), None)


def final_loss(losses: list[float]) -> float:
    return statistics.fmean(losses[-WINDOW:])


def summarize(records: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """records: each run's metrics by Run.key."""
    losses = {key: [r["loss"] for r in rows] for key, rows in records.items()}
    summary = {"train_iters": args.train_iters, "processes": NPROC, "smoothing_window": WINDOW}
    for run in RUNS:
        # Iteration 1 pays one-off set-up, so it is left out of the speed.
        speed = statistics.median(r["elapsed_ms"] for r in records[run.key][1:])
        summary[run.key] = {"lr": run.lr, "final_loss": final_loss(losses[run.key]), "ms_per_iteration": speed}
    summary["muon_iterations_to_adamw_final_loss"] = iterations_to_reach(losses["muon"], summary["adamw"]["final_loss"])
    return summary


def describe(summary: dict) -> str:
    lines = [f"{run.name:6s} lr {run.lr:g}: final loss {summary[run.key]['final_loss']:.4f}, "
             f"{summary[run.key]['ms_per_iteration']:.1f} ms per iteration" for run in RUNS]
    reached = summary["muon_iterations_to_adamw_final_loss"]
    iters = summary["train_iters"]
    lines.append(f"Muon reaches AdamW's final loss at iteration {reached} of {iters}" if reached
                 else f"Muon does not reach AdamW's final loss in {iters} iterations")
    lines.append(f"(final loss: mean of the last {WINDOW} iterations; {summary['processes']} processes each)")
    return "\n".join(lines)


def write_outputs(records: dict[str, list[dict]], summary: dict, out_dir: str) -> None:
    curves = [Curve(run.name, [r["iteration"] for r in records[run.key]],
                    smoothed([r["loss"] for r in records[run.key]]), color)
              for run, color in zip(RUNS, PALETTE)]
    plot_curves(os.path.join(out_dir, "loss.png"), curves, y_label=f"loss (mean of {WINDOW} iterations)")
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    with open(os.path.join(out_dir, "summary.txt"), "w") as handle:
        handle.write(describe(summary) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    records = {run.key: train(run, args) for run in RUNS}
    summary = summarize(records, args)
    write_outputs(records, summary, args.out_dir)
    print("\n" + describe(summary))
    print(f"> wrote {os.path.join(args.out_dir, 'loss.png')} and summary.json/.txt there")


if __name__ == "__main__":
    main()
