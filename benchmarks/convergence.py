"""`make convergence`: Muon against AdamW on real text, both tuned; see docs/convergence.md.

A 1.0M-parameter GPT (3 layers, hidden 160) on the Python standard library's source
(megatron_eopt/training/corpus.py, byte-level), one process per run, 1,000 iterations of 8 x 64
tokens. Stages, each run once and kept as benchmarks/results/convergence/runs/NAME.json (a run
whose file exists with the same command is not repeated, so an interrupted sweep resumes):
1. lr sweep, seed 1: AdamW and Muon (AdamW-RMS matched, quintic), 4 lrs each; 2. the best lr
of each (lowest final validation loss) with seeds 2 and 3; 3. Muon variants at Muon's best lr,
seed 1: polar_express, NorMuon, spectral scale at 1x and 2.5x the lr, weight decay 0.1, a halved
embedding lr, and Gram Newton-Schulz; 4. AdamW and Muon at their best lrs with bf16 state, every
seed. Runs go `--jobs` at a time (default: one per CPU, one thread each). Then summary.json,
convergence_loss.png and a Markdown table; with --docs (`make convergence`) the table and the
plot go into docs/convergence.md. --quick: a tiny model, 60 iterations (plumbing, no numbers).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from megatron_eopt.training.corpus import prepare_stdlib_corpus
from megatron_eopt.training.curves import VALIDATION_LINE, final_loss, read_metrics, validation_curve, validation_reach
from megatron_eopt.training.logging.training_log import GREY, PALETTE, Curve, plot_curves

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "convergence.md")
DOC_PLOT = os.path.join(ROOT, "docs", "convergence_loss.png")
VARIANT_COLORS = (*PALETTE[2:], (148, 103, 189), (140, 86, 75), (227, 119, 194), (188, 189, 34))
TABLE_BEGIN, TABLE_END = "<!-- convergence table: begin -->", "<!-- convergence table: end -->"


@dataclass(frozen=True)
class Scale:
    """Model, length and sweep of one mode (full or --quick)."""

    model: tuple[str, ...]
    seq_length: int
    global_batch: int
    train_iters: int
    eval_interval: int
    eval_iters: int
    adamw_lrs: tuple[float, ...]
    muon_lrs: tuple[float, ...]
    spectral_lr_factors: tuple[float, ...]
    seeds: tuple[int, ...]
    corpus_bytes: int


# 999,840 parameters; 512 tokens an iteration, so the 20 runs fit in about an hour on 2 cores.
FULL = Scale(("--num-layers", "3", "--hidden-size", "160", "--num-attention-heads", "5"), 64, 8, 1000, 50, 10,
             (5e-4, 1e-3, 2e-3, 4e-3), (2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2), (1.0, 2.5), (1, 2, 3), 4_000_000)
QUICK = Scale(("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"), 32, 4, 60, 20, 2,
              (4e-3, 1.6e-2), (8e-3, 3.2e-2), (2.0,), (1, 2), 1_000_000)

# Momentum 0.95 (OptimizerConfig's): the results in docs/convergence.md were measured with it, before the
# trainer took Megatron-LM's default 0.9.
MOMENTUM = ("--muon-momentum", "0.95")
MUON = ("--optimizer", "muon", "--muon-match-adamw-rms", *MOMENTUM)
ADAMW = ("--optimizer", "adam")
# megatron-core's precision-aware state (docs/memory.md): bf16 moments. The model is fp32 here, so
# there are no bf16 parameters to hold remainders for; only the moments change.
BF16_STATE = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")


@dataclass(frozen=True)
class Variant:
    """A Muon variant run at Muon's best lr times each of `lr_factors`, with each of `seeds`."""

    name: str
    flags: tuple[str, ...]
    lr_factors: tuple[float, ...] = (1.0,)
    decoupled_lr_factor: Optional[float] = None  # --decoupled-lr = best lr x this
    seeds: tuple[int, ...] = (1,)


def variants(scale: Scale) -> tuple[Variant, ...]:
    return (
        Variant("polar_express", MUON + ("--muon-coefficient-type", "polar_express")),
        Variant("normuon", ("--optimizer", "adaptive_muon", "--muon-match-adamw-rms", *MOMENTUM,
                            "--adaptive-muon-moment2-method", "normuon")),
        # Spectral scale without matching, one lr for all: at Muon's best lr the matrices' updates
        # are ~2.5x smaller (0.2 sqrt(max(m, n)) at hidden 160); at 2.5x it, the Adam-stepped
        # embedding and norms get 2.5x the lr.
        Variant("spectral", ("--optimizer", "muon", *MOMENTUM, "--muon-scale-mode", "spectral"),
                scale.spectral_lr_factors),
        Variant("weight_decay_0.1", MUON + ("--weight-decay", "0.1")),
        Variant("embedding_lr_half", MUON, decoupled_lr_factor=0.5),
        # Every seed: whether Gram in bf16 trains as well as the standard iteration is a question of
        # the seed spread (docs/newton-schulz.md).
        Variant("gram_newton_schulz", MUON + ("--muon-gram-newton-schulz",), seeds=scale.seeds),
        # Turbo-Muon: the AOL preconditioner, 'aol' x 4 (docs/newton-schulz.md); every seed, as Gram.
        Variant("turbo_muon", MUON + ("--muon-aol-preconditioner",), seeds=scale.seeds),
    )


@dataclass
class Spec:
    """One trainer run."""

    name: str
    group: str  # adamw, muon, or a variant's name
    lr: float
    seed: int
    flags: tuple[str, ...]
    decoupled_lr: Optional[float] = None

    def command(self, scale: Scale, data_flags: list[str], metrics: str) -> list[str]:
        decoupled = ["--decoupled-lr", f"{self.decoupled_lr:g}", "--decoupled-min-lr",
                     f"{self.decoupled_lr / 10:g}"] if self.decoupled_lr else []
        return [sys.executable, "-m", "megatron_eopt.training.pretrain", *scale.model, *data_flags,
                "--seq-length", str(scale.seq_length), "--micro-batch-size", str(scale.global_batch),
                "--global-batch-size", str(scale.global_batch), "--train-iters", str(scale.train_iters),
                "--lr-warmup-iters", str(max(1, scale.train_iters // 20)), "--lr-decay-style", "cosine",
                "--lr", f"{self.lr:g}", "--min-lr", f"{self.lr / 10:g}", *decoupled, "--seed", str(self.seed),
                "--log-interval", "1", "--eval-interval", str(scale.eval_interval),
                "--eval-iters", str(scale.eval_iters), *self.flags, "--metrics-jsonl", metrics]


def sweep_specs(scale: Scale) -> list[Spec]:
    specs = [Spec(f"adamw_lr{lr:g}_seed1", "adamw", lr, 1, ADAMW) for lr in scale.adamw_lrs]
    return specs + [Spec(f"muon_lr{lr:g}_seed1", "muon", lr, 1, MUON) for lr in scale.muon_lrs]


def best_lr(results: dict[str, dict], group: str) -> Optional[float]:
    """The lr of `group`'s seed-1 run with the lowest final validation loss (NaN counts as worst);
    None if none finished."""
    rows = [r for r in results.values() if r["group"] == group and r["seed"] == 1 and r.get("status") == "done"]
    return min(rows, key=lambda r: _sortable(r["final_validation_loss"]))["lr"] if rows else None


def _sortable(loss: Optional[float]) -> float:
    return loss if loss is not None and loss == loss else float("inf")


def later_specs(scale: Scale, results: dict[str, dict]) -> list[Spec]:
    """Stages 2 and 3, which need the sweep's best lrs."""
    specs = []
    for group, flags in (("adamw", ADAMW), ("muon", MUON)):
        lr = best_lr(results, group)
        specs += [Spec(f"{group}_lr{lr:g}_seed{seed}", group, lr, seed, flags) for seed in scale.seeds[1:]]
    muon_lr = best_lr(results, "muon")
    for variant in variants(scale):
        for factor in variant.lr_factors:
            decoupled = muon_lr * variant.decoupled_lr_factor if variant.decoupled_lr_factor else None
            specs += [Spec(f"{variant.name}_lr{muon_lr * factor:g}_seed{seed}", variant.name, muon_lr * factor, seed,
                           variant.flags, decoupled) for seed in variant.seeds]
    return specs


def bf16_state_specs(scale: Scale, results: dict[str, dict]) -> list[Spec]:
    """Stage 4: AdamW and Muon at their best lrs with bf16 state, every seed, to compare with their
    fp32-state seeds."""
    specs = []
    for group, flags in (("adamw", ADAMW), ("muon", MUON)):
        lr = best_lr(results, group)
        specs += [Spec(f"{group}_bf16_state_lr{lr:g}_seed{seed}", f"{group}_bf16_state", lr, seed, flags + BF16_STATE)
                  for seed in scale.seeds]
    return specs


def command_key(command: list[str]) -> list[str]:
    """The command without the interpreter and the metrics path: what makes two runs the same."""
    return command[1:-2]


def run_spec(spec: Spec, scale: Scale, data_flags: list[str], runs_dir: str, progress: str,
             threads: int = 1) -> tuple[dict, bool]:
    """Train `spec` unless runs_dir holds its result for the same command; returns the result and
    whether it was trained now."""
    path, metrics, log_path = (os.path.join(runs_dir, f"{spec.name}.{ext}") for ext in ("json", "jsonl", "log"))
    command = spec.command(scale, data_flags, metrics)
    base = {"name": spec.name, "group": spec.group, "lr": spec.lr, "seed": spec.seed, "decoupled_lr": spec.decoupled_lr}
    if os.path.exists(path):
        with open(path) as handle:
            done = json.load(handle)
        if done.get("command") == command_key(command):
            print(f"{progress} {spec.name}: done earlier ({_loss_text(done)})", flush=True)
            return done, False
    print(f"{progress} {spec.name}: {' '.join(command_key(command))}", flush=True)
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, cwd=ROOT, env=env) as process:
        for line in process.stdout:
            log.write(line)
            if VALIDATION_LINE.search(line) and "on validation set" not in line:
                print(f"    {spec.name}: {line.strip()}", flush=True)
    result = {**base, **measure(metrics, scale), "command": command_key(command),
              "wall_s": round(time.time() - start, 1), "exit_code": process.returncode}
    result["status"] = "done" if process.returncode == 0 else "failed"
    with open(path, "w") as handle:
        json.dump(result, handle)
    print(f"    {spec.name}: {result['status']} in {result['wall_s']:.0f} s ({_loss_text(result)})", flush=True)
    return result, True


def measure(metrics: str, scale: Scale) -> dict:
    """A run's validation points, final losses and speed (what exists of a run that stopped early)."""
    rows, evaluations = read_metrics(metrics) if os.path.exists(metrics) else ([], [])
    points = validation_curve(evaluations)
    losses = [r["loss"] for r in rows]
    finished = bool(rows) and rows[-1]["iteration"] == scale.train_iters
    speeds = [r["elapsed_ms"] for r in rows[1:]]  # the first iteration pays one-off set-up
    tokens = scale.seq_length * scale.global_batch
    return {"validation": points, "train_losses": losses,
            "final_validation_loss": points[-1][1] if finished and points[-1:] and points[-1][0] == scale.train_iters
            else None,
            "final_train_loss": final_loss(losses) if finished else None,
            "tokens_per_second": tokens / (statistics.median(speeds) / 1000) if speeds else None}


def _loss_text(result: dict) -> str:
    loss = result.get("final_validation_loss")
    return f"final validation loss {loss:.4f}" if loss is not None else "no final validation loss"


def _mean_spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarize(results: list[dict], scale: Scale) -> dict:
    """Everything the report shows, from the runs' results."""
    done = {r["name"]: r for r in results}
    best = {group: best_lr(done, group) for group in {r["group"] for r in done.values()}}
    adamw_finals = [r["final_validation_loss"] for r in done.values()
                    if r["group"] == "adamw" and r["lr"] == best["adamw"] and r["final_validation_loss"] is not None]
    target = statistics.fmean(adamw_finals)
    rows = {}
    for r in results:
        key = (r["group"], r["lr"])
        row = rows.setdefault(key, {"group": r["group"], "lr": r["lr"], "seeds": [], "finals": [], "reach": [],
                                    "tokens_per_second": []})
        row["seeds"].append(r["seed"])
        row["finals"].append(r["final_validation_loss"])
        row["reach"].append(validation_reach(r["validation"], target) if r["group"] != "adamw" else None)
        if r.get("tokens_per_second"):
            row["tokens_per_second"].append(r["tokens_per_second"])
    table = [_table_row(row, best) for row in rows.values()]
    muon = next(row for row in table if row["group"] == "muon" and row["best"])
    reach = muon["reach"]
    ratio = reach["mean"] / scale.train_iters if reach and reach["n"] == len(muon["seeds"]) else None
    return {"train_iters": scale.train_iters, "tokens_per_iteration": scale.seq_length * scale.global_batch,
            "model": list(scale.model), "best_lr": {g: best[g] for g in ("adamw", "muon")},
            "adamw_final_validation_loss": _mean_spread(adamw_finals),
            "target": target, "muon_reach": reach, "muon_reach_fraction": ratio,
            "target_met": ratio is not None and ratio <= 0.7, "rows": table,
            "best_at_sweep_edge": [g for g, lrs in (("adamw", scale.adamw_lrs), ("muon", scale.muon_lrs))
                                   if best[g] in (min(lrs), max(lrs))]}


def _table_row(row: dict, best: dict) -> dict:
    finals = [f for f in row["finals"] if f is not None]
    reached = [r for r in row["reach"] if r is not None]
    return {"group": row["group"], "lr": row["lr"], "seeds": row["seeds"], "best": best.get(row["group"]) == row["lr"],
            "final_validation_loss": _mean_spread(finals) if finals else None,
            "diverged": len(row["finals"]) - len(finals),
            "reach": _mean_spread(reached) if reached else None, "not_reached": len(row["reach"]) - len(reached),
            "tokens_per_second": statistics.fmean(row["tokens_per_second"]) if row["tokens_per_second"] else None}


def markdown(summary: dict) -> str:
    lines = ["| optimizer | lr | seeds | final validation loss | reaches AdamW's final validation loss at "
             "iteration | tokens/s |", "|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        name = f"**{row['group']}**" if row["best"] else row["group"]
        loss = _spread_text(row["final_validation_loss"], "{:.4f}")
        if row["diverged"]:
            loss += f" ({row['diverged']} without a final loss: diverged or stopped)"
        reach = "-" if row["group"] == "adamw" else _spread_text(row["reach"], "{:.0f}")
        if row["not_reached"] and row["group"] != "adamw":
            reach += f" ({row['not_reached']} never)"
        speed = f"{row['tokens_per_second']:.0f}" if row["tokens_per_second"] else "-"
        lines.append(f"| {name} | {row['lr']:g} | {','.join(map(str, row['seeds']))} | {loss} | {reach} | {speed} |")
    fraction = summary["muon_reach_fraction"]
    reach = summary["muon_reach"]
    lines += ["", f"Target: AdamW's final validation loss (best lr {summary['best_lr']['adamw']:g}, mean over its "
              f"seeds) {_spread_text(summary['adamw_final_validation_loss'], '{:.4f}')}. Muon (best lr "
              f"{summary['best_lr']['muon']:g}) reaches it at iteration {_spread_text(reach, '{:.0f}')} of "
              f"{summary['train_iters']}" + (f": {fraction:.2f} of the iterations at equal tokens, "
                                             f"{'within' if summary['target_met'] else 'short of'} the 0.7 target."
                                             if fraction is not None else ", not in every seed.")]
    for group in summary["best_at_sweep_edge"]:
        lines.append(f"Note: {group}'s best lr {summary['best_lr'][group]:g} is at the end of its sweep; a wider "
                     f"sweep may find a better one.")
    return "\n".join(lines)


def _spread_text(spread: Optional[dict], number: str) -> str:
    if spread is None:
        return "-"
    text = number.format(spread["mean"])
    if spread["n"] > 1:
        text += f" ± {number.format(spread['std'])} (min {number.format(spread['min'])}, " \
                f"max {number.format(spread['max'])}, n={spread['n']})"
    return text


def plot(results: list[dict], summary: dict, path: str) -> None:
    """Validation curves: the best AdamW and Muon (mean over seeds) and each variant's best run."""
    curves, colors = [], iter(VARIANT_COLORS)
    for row in summary["rows"]:
        if not row["best"]:
            continue
        runs = [r for r in results if r["group"] == row["group"] and r["lr"] == row["lr"] and r.get("validation")]
        if not runs:
            continue
        iterations = [p[0] for p in min(runs, key=lambda r: len(r["validation"]))["validation"]]
        means = [statistics.fmean(r["validation"][i][1] for r in runs) for i in range(len(iterations))]
        color = {"adamw": PALETTE[0], "muon": PALETTE[1]}.get(row["group"]) or next(colors, GREY)
        label = f"{row['group']} lr {row['lr']:g}" + (f" (mean of {len(runs)} seeds)" if len(runs) > 1 else "")
        curves.append(Curve(label, iterations, means, color, dashed=row["group"] not in ("adamw", "muon")))
    plot_curves(path, curves, y_label="validation loss", log_y=False)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "convergence")
    return checked_common_arguments(parser, parser.parse_args(argv), "convergence")


def add_common_arguments(parser: argparse.ArgumentParser, folder: str) -> None:
    """--quick, --out, --corpus-dir, --jobs and --docs: this script's and convergence_range.py's."""
    parser.add_argument("--quick", action="store_true", help="a tiny model and sweep: checks the plumbing only")
    parser.add_argument("--out", default=None, help=f"results folder (default benchmarks/results/{folder}[-quick])")
    parser.add_argument("--corpus-dir", default=os.path.join(ROOT, "data"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="runs trained at once, each with CPUs/jobs threads (default: one per CPU)")
    parser.add_argument("--docs", action="store_true", help="write the table and plot into docs/ (not with --quick)")


def checked_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                             folder: str) -> argparse.Namespace:
    """Refuse --docs with --quick and --jobs < 1; --out defaults to benchmarks/results/FOLDER[-quick]."""
    if args.docs and args.quick:
        parser.error("--docs records the full benchmark; --quick results stay in their folder")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    args.out = args.out or os.path.join(HERE, "results", f"{folder}-quick" if args.quick else folder)
    return args


def run_all(scale: Scale, args: argparse.Namespace) -> list[dict]:
    """The three stages in order, `args.jobs` runs at a time, with progress and an estimate of the
    time left. Results keep the stages' order whatever order the runs finish in."""
    corpus = prepare_stdlib_corpus(args.corpus_dir, scale.corpus_bytes)
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    extra_seeds = 2 * (len(scale.seeds) - 1)
    total = (len(sweep_specs(scale)) + extra_seeds + 2 * len(scale.seeds)
             + sum(len(v.lr_factors) * len(v.seeds) for v in variants(scale)))
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    start, trained, started, lock = time.time(), [], [], threading.Lock()  # trained: for the estimate

    def run(spec: Spec) -> dict:
        with lock:  # runs finish at `jobs` at a time, so time per trained run already counts the overlap
            started.append(spec)
            elapsed = time.time() - start
            eta = f", about {elapsed / len(trained) * (total - len(started) + 1) / 60:.0f} min left" if trained else ""
            progress = f"[{len(started)}/{total}, {elapsed / 60:.1f} min{eta}]"
        result, trained_now = run_spec(spec, scale, corpus.trainer_flags(), runs_dir, progress, threads)
        with lock:
            trained.extend([result] if trained_now else [])
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run, sweep_specs(scale)))
        results += list(pool.map(run, later_specs(scale, {r["name"]: r for r in results})))
        results += list(pool.map(run, bf16_state_specs(scale, {r["name"]: r for r in results})))
    return results


def report(results: list[dict], scale: Scale, args: argparse.Namespace) -> str:
    summary = summarize(results, scale)
    table = markdown(summary)
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    with open(os.path.join(args.out, "convergence.md"), "w") as handle:
        handle.write(table + "\n")
    plot(results, summary, os.path.join(args.out, "convergence_loss.png"))
    if args.docs:
        plot(results, summary, DOC_PLOT)
        replace_table(DOC, table + f"\n\n![Validation loss of the best runs]({os.path.basename(DOC_PLOT)})")
    return table


def replace_table(doc: str, table: str, markers: tuple[str, str] = (TABLE_BEGIN, TABLE_END)) -> None:
    """Put `table` between the two `markers` of `doc` (default: TABLE_BEGIN and TABLE_END)."""
    with open(doc) as handle:
        text = handle.read()
    begin, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    with open(doc, "w") as handle:
        handle.write(text[:begin] + "\n" + table + "\n" + text[end:])


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    scale = QUICK if args.quick else FULL
    start = time.time()
    results = run_all(scale, args)
    print("\n" + report(results, scale, args))
    where = f"{args.out}" + (f", {DOC} and {DOC_PLOT}" if args.docs else "")
    print(f"> {len(results)} runs in {(time.time() - start) / 60:.1f} min; wrote summary.json, convergence.md "
          f"and convergence_loss.png to {where}")


if __name__ == "__main__":
    main()
