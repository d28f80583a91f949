"""`make demo`: AdamW vs Muon on real text (the Python standard library's source, byte-level),
each trained by two processes (torchrun).

Builds the corpus on first use (megatron_eopt/training/corpus.py, cached under --corpus-dir), then
runs the trainer twice with the same model, data, seed and schedule (cosine after 10 warm-up
iterations, to a tenth of the peak lr); only the optimizer and its tuned peak lr change. Writes
to `--out-dir` (default demo_output/):

    loss.png                 training (smoothed) and validation loss curves of both runs
    summary.json, .txt       final training and validation losses, ms per iteration, and the
                             iteration at which Muon reaches AdamW's final validation loss
    adamw.*, muon.*          each run's --metrics-jsonl and full log

The lrs are the best of a sweep on this task (README.md, "Demo").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from megatron_eopt.training.corpus import prepare_stdlib_corpus
from megatron_eopt.training.curves import (  # noqa: F401 (re-exported for the tests)
    WINDOW,
    final_loss,
    iterations_to_reach,
    smoothed,
    read_metrics,
    validation_curve,
    validation_reach,
)
from megatron_eopt.training.logging.training_log import ITERATION_IN_LINE, PALETTE, Curve, plot_curves

NPROC = 2
SEQ_LENGTH = 64
EVAL_ITERS = 16
COMMON_FLAGS = ["--global-batch-size", "8", "--seq-length", str(SEQ_LENGTH), "--lr-warmup-iters", "10",
                "--lr-decay-style", "cosine", "--log-interval", "1", "--seed", "1234",
                "--eval-iters", str(EVAL_ITERS)]


@dataclass(frozen=True)
class Run:
    name: str
    lr: float
    flags: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.name.lower()

    def command(self, args: argparse.Namespace, data_flags: list[str], metrics: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                "-m", "megatron_eopt.training.pretrain", *COMMON_FLAGS, *data_flags, *self.flags,
                "--train-iters", str(args.train_iters), "--eval-interval", str(args.eval_interval),
                "--lr", str(self.lr), "--min-lr", str(self.lr / 10), "--metrics-jsonl", metrics]


RUNS = (
    Run("AdamW", 1.5e-3, ("--optimizer", "adam")),
    # Matched to AdamW's update RMS, so the embeddings and norms (stepped by Adam inside Muon)
    # and the Muon-stepped matrices share one sensible lr. Momentum 0.95 (OptimizerConfig's), as the
    # recorded demo ran before the trainer took Megatron-LM's default 0.9.
    Run("Muon", 2e-2, ("--optimizer", "muon", "--use-distributed-optimizer", "--muon-match-adamw-rms",
                       "--muon-momentum", "0.95")),
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=50, help="iterations between validations")
    parser.add_argument("--out-dir", type=os.path.abspath, default="demo_output")  # argparse converts the default too
    parser.add_argument("--corpus-dir", default="data", help="where the corpus is built and cached")
    args = parser.parse_args(argv)
    if args.train_iters < WINDOW:
        parser.error(f"--train-iters must be >= {WINDOW} (the smoothing window); got {args.train_iters}")
    if args.eval_interval < 1 or args.train_iters % args.eval_interval:
        parser.error(f"--eval-interval must divide --train-iters {args.train_iters}; got {args.eval_interval}")
    return args


def train(run: Run, args: argparse.Namespace, data_flags: list[str]) -> dict:
    """One torchrun job; its log goes to a file, and every tenth of the run is echoed here.
    Returns {"train": the metrics records, "validation": [(iteration, loss), ...]}."""
    metrics, log_path = (os.path.join(args.out_dir, f"{run.key}.{ext}") for ext in ("jsonl", "log"))
    command = run.command(args, data_flags, metrics)
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
    train, evaluations = read_metrics(metrics)
    return {"train": train, "validation": validation_curve(evaluations)}


def _is_milestone(line: str, every: int) -> bool:
    if line.startswith("> "):
        return True
    match = ITERATION_IN_LINE.search(line)
    return bool(match) and int(match.group(1)) % every == 0


def summarize(records: dict[str, dict], args: argparse.Namespace) -> dict:
    """records: each run's train() result by Run.key."""
    summary = {"corpus": args.corpus_description, "train_iters": args.train_iters, "processes": NPROC,
               "smoothing_window": WINDOW, "eval_interval": args.eval_interval, "eval_iters": EVAL_ITERS}
    for run in RUNS:
        rows, points = records[run.key]["train"], records[run.key]["validation"]
        # Iteration 1 pays one-off set-up, so it is left out of the speed.
        summary[run.key] = {"lr": run.lr, "final_loss": final_loss([r["loss"] for r in rows]),
                            "final_validation_loss": points[-1][1],
                            "ms_per_iteration": statistics.median(r["elapsed_ms"] for r in rows[1:])}
    reached = validation_reach(records["muon"]["validation"], summary["adamw"]["final_validation_loss"])
    summary["muon_iterations_to_adamw_final_validation_loss"] = reached
    return summary


def describe(summary: dict) -> str:
    lines = [f"corpus: {summary['corpus']}"]
    lines += [f"{run.name:6s} lr {run.lr:g}: final validation loss {summary[run.key]['final_validation_loss']:.4f}, "
              f"training loss {summary[run.key]['final_loss']:.4f}, "
              f"{summary[run.key]['ms_per_iteration']:.1f} ms per iteration" for run in RUNS]
    reached = summary["muon_iterations_to_adamw_final_validation_loss"]
    iters = summary["train_iters"]
    lines.append(f"Muon reaches AdamW's final validation loss at iteration {reached:.0f} of {iters} "
                 f"({reached / iters:.2f} of the run)" if reached is not None
                 else f"Muon does not reach AdamW's final validation loss in {iters} iterations")
    lines.append(f"(validation every {summary['eval_interval']} iterations, {summary['eval_iters']} batches, "
                 f"crossing interpolated between evaluations; training loss: mean of the last {WINDOW} "
                 f"iterations; {summary['processes']} processes each)")
    return "\n".join(lines)


def write_outputs(records: dict[str, dict], summary: dict, out_dir: str) -> None:
    curves = []
    for run, color in zip(RUNS, PALETTE):
        rows, points = records[run.key]["train"], records[run.key]["validation"]
        curves.append(Curve(f"{run.name} training", [r["iteration"] for r in rows],
                            smoothed([r["loss"] for r in rows]), color))
        curves.append(Curve(f"{run.name} validation", [p[0] for p in points], [p[1] for p in points], color,
                            dashed=True))
    plot_curves(os.path.join(out_dir, "loss.png"), curves, y_label=f"loss (training: mean of {WINDOW} iterations)")
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    with open(os.path.join(out_dir, "summary.txt"), "w") as handle:
        handle.write(describe(summary) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    corpus = prepare_stdlib_corpus(args.corpus_dir)
    args.corpus_description = (f"Python {sys.version.split()[0]} standard library, {corpus.documents} files, "
                               f"{corpus.bytes / 1e6:.1f} MB, byte-level")
    records = {run.key: train(run, args, corpus.trainer_flags()) for run in RUNS}
    summary = summarize(records, args)
    write_outputs(records, summary, args.out_dir)
    print("\n" + describe(summary))
    print(f"> wrote {os.path.join(args.out_dir, 'loss.png')} and summary.json/.txt there")


if __name__ == "__main__":
    main()
