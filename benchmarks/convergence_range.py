"""`make convergence-range`: Muon's advantage over AdamW as a range; docs/convergence.md has the design.

One cell is a corpus x a model x a longest budget (iterations). In each cell: sweeps at the longest
budget, seed 1 (AdamW over lr x beta2 x warm-up, Muon over its lr x --decoupled-lr's factor); a
winning lr at the end of its sweep extends it outward (up to LR_EXTENSIONS steps of 2x), an optimum
still at an end is flagged; AdamW's weight decay at its best point; then whole schedules: each best
setting trained to each budget (its cosine ending there), seeds 1-3. The ratio: the budget at which
Muon's mean final held-out loss equals AdamW's at the longest budget, interpolated between budgets.
Final losses come from --final-eval-iters over the whole held-out split (its standard error from
disjoint halves). The old mid-schedule measure is kept beside it, labelled.

Each run's result is benchmarks/results/convergence-range/runs/CELL/NAME.json; a run whose file
holds the same command is not repeated, so an interrupted study resumes where it stopped.
--quick: a tiny model, tiny sweeps (plumbing).
"""

import argparse
import itertools
import json
import math
import os
import random
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Optional

# make convergence's: a run's identity, the docs' table, the shared flags
from convergence import add_common_arguments, checked_common_arguments, command_key, replace_table
from megatron_eopt.training.corpus import TOKENIZER_FLAGS, prepare_corpus
from megatron_eopt.training.curves import read_metrics, validation_curve, validation_reach

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "convergence.md")
TABLE_BEGIN, TABLE_END = "<!-- convergence range: begin -->", "<!-- convergence range: end -->"
SPLIT = (0.6, 0.4)  # train, held out: by document (40%: the final loss's standard error under 0.005)
LR_EXTENSIONS = 2
MUON = ("--optimizer", "muon", "--muon-match-adamw-rms", "--muon-momentum", "0.95")  # as the stored runs trained
ADAMW = ("--optimizer", "adam")


@dataclass(frozen=True)
class Model:
    name: str
    flags: tuple[str, ...]
    parameters: int
    cost: float  # seconds per iteration relative to the 1.0M model (the time estimate): the FLOP ratio


BASE = Model("1.0M", ("--num-layers", "3", "--hidden-size", "160", "--num-attention-heads", "5"), 999_840, 1.0)
LARGE = Model("4.1M", ("--num-layers", "4", "--hidden-size", "288", "--num-attention-heads", "6"), 4_116_096, 4.3)
TINY = Model("tiny", ("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"), 37_312, 0.1)


@dataclass(frozen=True)
class Cell:
    corpus: str
    model: Model
    iterations: int  # the longest budget

    @property
    def key(self) -> str:
        return f"{self.corpus}_{self.model.name}_{self.iterations}"


@dataclass(frozen=True)
class Study:
    cells: tuple[Cell, ...]
    seq_length: int
    global_batch: int
    eval_iters: int  # periodic evaluations: cheap, moving through the held-out split
    evaluations: int  # periodic evaluations per run
    corpus_bytes: int
    adamw_lrs: tuple[float, ...]
    adamw_beta2s: tuple[float, ...]
    adamw_warmups: tuple[float, ...]  # fractions of the run
    adamw_weight_decays: tuple[float, ...]  # at AdamW's best point; the grid runs at DEFAULT_WEIGHT_DECAY
    muon_lrs: tuple[float, ...]
    muon_adam_lr_factors: tuple[float, ...]  # --decoupled-lr = Muon's lr x this (1: not given)
    budgets: tuple[float, ...]  # fractions of the longest
    seeds: tuple[int, ...]
    final_eval_cap: Optional[int] = None  # at most this many final evaluation batches (--quick only)


DEFAULT_WEIGHT_DECAY = 0.01  # megatron-core's
MUON_WARMUP = 0.05
FULL = Study(
    cells=(Cell("stdlib", BASE, 1000), Cell("gnu-info", BASE, 1000), Cell("manpages", BASE, 1000),
           Cell("stdlib", BASE, 3000), Cell("stdlib", LARGE, 1000)),
    seq_length=64, global_batch=8, eval_iters=10, evaluations=20, corpus_bytes=3_000_000,
    adamw_lrs=(1e-3, 2e-3, 4e-3, 8e-3), adamw_beta2s=(0.95, 0.999), adamw_warmups=(0.05, 0.2),
    adamw_weight_decays=(0.0, 0.1), muon_lrs=(2.5e-3, 5e-3, 1e-2, 2e-2), muon_adam_lr_factors=(0.5, 1.0, 2.0),
    budgets=(0.25, 0.5, 0.75, 1.0), seeds=(1, 2, 3))
QUICK = Study(
    cells=(Cell("stdlib", TINY, 40), Cell("gnu-info", TINY, 40)),
    seq_length=32, global_batch=4, eval_iters=2, evaluations=4, corpus_bytes=600_000,
    adamw_lrs=(4e-3, 1.6e-2), adamw_beta2s=(0.95, 0.999), adamw_warmups=(0.05,), adamw_weight_decays=(0.1,),
    muon_lrs=(8e-3, 3.2e-2), muon_adam_lr_factors=(1.0, 2.0), budgets=(0.5, 1.0), seeds=(1, 2), final_eval_cap=100)


@dataclass(frozen=True)
class Setting:
    """One optimizer's hyperparameters."""

    optimizer: str  # 'adamw' or 'muon'
    lr: float
    beta2: float = 0.999
    warmup: float = MUON_WARMUP
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    adam_lr_factor: float = 1.0

    @property
    def label(self) -> str:
        text = f"{self.optimizer}_lr{self.lr:g}_b2{self.beta2:g}_wu{self.warmup:g}_wd{self.weight_decay:g}"
        return text + (f"_alr{self.adam_lr_factor:g}" if self.adam_lr_factor != 1.0 else "")


@dataclass(frozen=True)
class Run:
    setting: Setting
    iterations: int
    seed: int
    stage: str

    @property
    def name(self) -> str:
        return f"{self.setting.label}_it{self.iterations}_seed{self.seed}"


def run_command(run: Run, cell: Cell, study: Study, data_flags: list[str], final_eval_iters: int,
                metrics: str) -> list[str]:
    s, iterations = run.setting, run.iterations
    decoupled = (["--decoupled-lr", f"{s.lr * s.adam_lr_factor:g}", "--decoupled-min-lr",
                  f"{s.lr * s.adam_lr_factor / 10:g}"] if s.adam_lr_factor != 1.0 else [])
    return [sys.executable, "-m", "megatron_eopt.training.pretrain", *cell.model.flags, *data_flags,
            "--seq-length", str(study.seq_length), "--micro-batch-size", str(study.global_batch),
            "--global-batch-size", str(study.global_batch), "--train-iters", str(iterations),
            "--lr-warmup-iters", str(max(1, round(s.warmup * iterations))), "--lr-decay-style", "cosine",
            "--lr", f"{s.lr:g}", "--min-lr", f"{s.lr / 10:g}", *decoupled, "--adam-beta2", f"{s.beta2:g}",
            "--weight-decay", f"{s.weight_decay:g}", "--seed", str(run.seed), "--log-interval", "1",
            "--eval-interval", str(max(1, cell.iterations // study.evaluations)), "--eval-iters", str(study.eval_iters),
            "--final-eval-iters", str(final_eval_iters), *(MUON if s.optimizer == "muon" else ADAMW),
            "--metrics-jsonl", metrics]


# The plan: which runs a cell needs, given the results so far (stage by stage) ---------------------

def sweep_runs(study: Study, cell: Cell) -> list[Run]:
    adamw = [Setting("adamw", lr, beta2, warmup) for lr, beta2, warmup in
             itertools.product(study.adamw_lrs, study.adamw_beta2s, study.adamw_warmups)]
    muon = [Setting("muon", lr, adam_lr_factor=factor) for lr, factor in
            itertools.product(study.muon_lrs, study.muon_adam_lr_factors)]
    return [Run(s, cell.iterations, 1, "sweep") for s in adamw + muon]


def final_loss(result: Optional[dict]) -> float:
    """A result's final held-out loss; inf for a missing, failed or diverged run."""
    loss = result.get("final_loss") if result else None
    return loss if loss is not None and math.isfinite(loss) else math.inf


def best_setting(results: dict[str, dict], optimizer: str, iterations: int) -> Optional[Setting]:
    """The seed-1 run at the longest budget with the lowest final loss."""
    rows = [r for r in results.values() if r["setting"]["optimizer"] == optimizer and r["seed"] == 1
            and r["iterations"] == iterations]
    if not rows:
        return None
    return Setting(**min(rows, key=final_loss)["setting"])


def lr_extension(results: dict[str, dict], optimizer: str, study: Study, cell: Cell) -> Optional[Run]:
    """The next lr outward (x2 or /2) with the best setting's other values, if the best lr is the
    lowest or highest tried and fewer than LR_EXTENSIONS lrs lie beyond the grid there."""
    best = best_setting(results, optimizer, cell.iterations)
    grid = study.adamw_lrs if optimizer == "adamw" else study.muon_lrs
    tried = sorted({r["setting"]["lr"] for r in results.values() if r["setting"]["optimizer"] == optimizer})
    if best is None or not math.isfinite(final_loss(_result_of(results, best, cell.iterations, 1))):
        return None
    if best.lr == tried[0] and sum(lr < min(grid) for lr in tried) < LR_EXTENSIONS:
        return Run(replace(best, lr=best.lr / 2), cell.iterations, 1, "lr extension")
    if best.lr == tried[-1] and sum(lr > max(grid) for lr in tried) < LR_EXTENSIONS:
        return Run(replace(best, lr=best.lr * 2), cell.iterations, 1, "lr extension")
    return None


def _result_of(results: dict[str, dict], setting: Setting, iterations: int, seed: int) -> Optional[dict]:
    return results.get(Run(setting, iterations, seed, "").name)


def plan(study: Study, cell: Cell, results: dict[str, dict]) -> list[Run]:
    """The runs of `cell` up to the first stage that `results` (by run name) do not complete, each
    optimizer on its own after the sweep (`optimizer_plan`); [] when the cell is done."""
    runs = sweep_runs(study, cell)
    if any(r.name not in results for r in runs):
        return runs
    return runs + [run for optimizer in ("adamw", "muon") for run in optimizer_plan(study, cell, results, optimizer)]


def optimizer_plan(study: Study, cell: Cell, results: dict[str, dict], optimizer: str) -> list[Run]:
    """One optimizer's runs after the sweep: lr extensions one at a time, AdamW's weight decay,
    then its best setting at every budget and seed; up to its first stage not in `results`."""
    runs = []
    while (extension := lr_extension(results, optimizer, study, cell)) is not None:
        runs.append(extension)
        if extension.name not in results:
            return runs
    if optimizer == "adamw":
        best = best_setting(results, optimizer, cell.iterations)
        decay = [Run(replace(best, weight_decay=wd), cell.iterations, 1, "weight decay")
                 for wd in study.adamw_weight_decays]
        runs += decay
        if any(r.name not in results for r in decay):
            return runs
    best = best_setting(results, optimizer, cell.iterations)
    return runs + [Run(best, budget_iterations(cell, budget), seed, "budget")
                   for budget in study.budgets for seed in study.seeds]


def budget_iterations(cell: Cell, budget: float) -> int:
    return round(cell.iterations * budget)


def expected_runs(study: Study, cell: Cell) -> int:
    """Runs of a complete cell without lr extensions (the budgets' longest seed 1 is a sweep run)."""
    return (len(sweep_runs(study, cell)) + len(study.adamw_weight_decays)
            + 2 * (len(study.budgets) * len(study.seeds) - 1))


# The held-out split and its evaluation size -------------------------------------------------------

def sequence_lengths(prefix: str) -> list[int]:
    """Each document's tokens (with its end-of-document token) from a Megatron .idx file."""
    with open(prefix + ".idx", "rb") as handle:
        header = handle.read(9 + 8 + 1 + 8 + 8)
        magic, _version, _dtype, count, _documents = struct.unpack("<9sQBQQ", header)
        if magic != b"MMIDIDX\x00\x00":
            raise ValueError(f"{prefix}.idx is not a Megatron indexed dataset (magic {magic!r}).")
        return list(struct.unpack(f"<{count}i", handle.read(4 * count)))


def held_out_batches(lengths: list[int], seq_length: int, global_batch: int) -> tuple[int, int]:
    """(tokens, whole global batches) of the held-out split, as megatron-core splits documents:
    documents round(SPLIT[0] n) to n; one epoch holds (tokens - 1) // seq_length samples."""
    begin = int(round(SPLIT[0] * float(len(lengths))))
    tokens = sum(lengths[begin:])
    return tokens, (tokens - 1) // seq_length // global_batch


# Running ------------------------------------------------------------------------------------------

def training_device() -> str:
    """Where the trainer runs (its default: CUDA when torch sees a GPU): 'cpu' or the GPU's name."""
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_one(run: Run, cell: Cell, study: Study, data_flags: list[str], final_eval_iters: int, runs_dir: str,
            progress: str, threads: int = 1, device: str = "cpu") -> tuple[Optional[dict], bool]:
    """Train `run` unless runs_dir holds its result for the same command; returns the result (None:
    the run failed, see `failed`) and whether it was trained now."""
    path, metrics, log_path = (os.path.join(runs_dir, f"{run.name}.{ext}") for ext in ("json", "jsonl", "log"))
    command = run_command(run, cell, study, data_flags, final_eval_iters, metrics)
    if os.path.exists(path):
        with open(path) as handle:
            done = json.load(handle)
        if portable(done.get("command", [])) == portable(command_key(command)):
            return done, False
    print(f"{progress} {cell.key}/{run.name} ({run.stage})", flush=True)
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "w") as log:
        process = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    measured = measure(metrics, run.iterations)
    if failed(process.returncode, measured["final_loss"], log_path):
        with open(log_path, errors="replace") as log:
            tail = "".join(f"      {line}" for line in log.readlines()[-8:])
        print(f"    {run.name}: FAILED (exit code {process.returncode}, neither a final loss nor a NaN stop); "
              f"not recorded, its log {log_path} ends:\n{tail}", flush=True)
        return None, True
    result = {"name": run.name, "setting": vars(run.setting), "iterations": run.iterations, "seed": run.seed,
              "stage": run.stage, **measured, "command": portable(command_key(command)),
              "wall_s": round(time.time() - start, 1), "device": device, "exit_code": process.returncode}
    with open(path + ".partial", "w") as handle:  # whole or absent: the planner reads results meanwhile
        json.dump(result, handle)
    os.replace(path + ".partial", path)
    os.remove(metrics) if os.path.exists(metrics) else None  # the result keeps what the report reads
    loss = result["final_loss"]
    print(f"    {run.name}: {'final held-out loss %.4f' % loss if loss is not None else 'no final loss'} "
          f"in {result['wall_s']:.0f} s", flush=True)
    return result, True


NAN_STOP = "found NaN in the"  # the trainer's stop on a diverged run (loop/train.py's stop_on_nan)


def failed(exit_code: int, final_loss: Optional[float], log_path: str) -> bool:
    """A run that ended without its final evaluation and not by diverging (a crash, a kill): no
    result, so the study neither takes its setting for diverged nor skips it when resumed."""
    if exit_code == 0 and final_loss is not None:
        return False
    with open(log_path, errors="replace") as log:
        return NAN_STOP not in log.read()


def measure(metrics: str, iterations: int) -> dict:
    """A run's periodic validation points, its final held-out loss and per-batch losses, and its
    seconds per iteration (median, validation excluded)."""
    rows, evaluations = read_metrics(metrics) if os.path.exists(metrics) else ([], [])
    final = [e for e in evaluations if e["split"] == "valid" and e["final"] and e["iteration"] == iterations]
    speeds = [r["elapsed_ms"] for r in rows[1:]]
    return {"validation": validation_curve(evaluations),
            "final_loss": final[-1]["eval_loss"] if final else None,
            "batch_losses": final[-1].get("batch_losses") if final else None,
            "seconds_per_iteration": statistics.median(speeds) / 1000 if speeds else None}


def read_results(runs_dir: str) -> dict[str, dict]:
    results = {}
    if os.path.isdir(runs_dir):
        for name in sorted(os.listdir(runs_dir)):
            if name.endswith(".json"):
                with open(os.path.join(runs_dir, name)) as handle:
                    result = json.load(handle)
                results[result["name"]] = result
    return results


def portable(command: list[str]) -> list[str]:
    """A run's command key with paths inside the checkout relative to it (the corpus's --data-path),
    so that a result stays valid in another checkout of the repository."""
    return [os.path.relpath(part, ROOT) if part.startswith(ROOT + os.sep) else part for part in command]


def current_results(results: dict[str, dict], cell: Cell, study: Study, data_flags: list[str],
                    final_eval_iters: int) -> dict[str, dict]:
    """The results whose command is the one the study would run now (others are run again)."""
    def command(r: dict) -> list[str]:
        run = Run(Setting(**r["setting"]), r["iterations"], r["seed"], "")
        return command_key(run_command(run, cell, study, data_flags, final_eval_iters, "metrics"))
    return {name: r for name, r in results.items() if portable(r.get("command", [])) == portable(command(r))}


def run_cell(study: Study, cell: Cell, args: argparse.Namespace) -> dict[str, dict]:
    """Plan, run what is missing, plan again, until the cell is done."""
    corpus = prepare_corpus(cell.corpus, args.corpus_dir, study.corpus_bytes)
    tokens, batches = held_out_batches(sequence_lengths(corpus.prefix), study.seq_length, study.global_batch)
    batches = min(batches, study.final_eval_cap or batches)
    data_flags = ["--data-path", corpus.prefix, "--split", ",".join(f"{100 * f:g}" for f in SPLIT) + ",0",
                  *TOKENIZER_FLAGS]
    runs_dir = os.path.join(args.out, "runs", cell.key)
    os.makedirs(runs_dir, exist_ok=True)
    with open(os.path.join(runs_dir, "..", f"{cell.key}.corpus.json"), "w") as handle:
        json.dump({"corpus": cell.corpus, "documents": corpus.documents, "bytes": corpus.bytes,
                   "held_out_tokens": tokens, "final_eval_batches": batches}, handle)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    device = training_device()
    running, lost = {}, []  # run name: its future; runs that failed without a result
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # plan again whenever a run ends, so that a free worker takes the next stage's runs; the runs
        # that gate a later stage first, then the longest (the cell's wall time is its longest chain)
        while True:
            results = current_results(read_results(runs_dir), cell, study, data_flags, batches)
            missing = sorted((r for r in plan(study, cell, results) if r.name not in results | running.keys()
                              and r.name not in lost), key=lambda r: (r.stage == "budget", -r.iterations))
            if not missing and not running:
                break
            expected = max(expected_runs(study, cell), len(results) + len(running) + len(missing))
            for run in missing[:args.jobs - len(running)]:
                progress = f"[{cell.key} {len(results) + len(running) + 1}/~{expected}]"
                running[run.name] = pool.submit(run_one, run, cell, study, data_flags, batches, runs_dir, progress,
                                                threads, device)
            ended, _ = wait(running.values(), return_when=FIRST_COMPLETED)
            for name in [name for name, future in running.items() if future in ended]:
                if running.pop(name).result()[0] is None:
                    lost.append(name)
    if lost:
        raise SystemExit(f"{cell.key}: {len(lost)} runs failed without a result ({', '.join(lost)}); their logs "
                         f"are in {runs_dir}. Fix the cause and run again: the study resumes with them.")
    return results


# Analysis: the crossing budget, noise, edges, one cell's summary ----------------------------------

def crossing(budgets: list[float], losses: list[float], target: float) -> tuple[Optional[float], str]:
    """The budget at which `losses` (one per budget, ascending budgets) first fall to `target`,
    linear between the two budgets around the crossing. Returns (budget, '') or (None, why):
    'below' if the smallest budget is already at or below the target (the crossing is at most
    that budget), 'never' if no budget reaches it."""
    previous = None
    for budget, loss in zip(budgets, losses):
        if loss <= target:
            if previous is None:
                return None, "below"
            before_budget, before_loss = previous
            return before_budget + (before_loss - target) / (before_loss - loss) * (budget - before_budget), ""
        previous = (budget, loss)
    return None, "never"


def halves_standard_error(batch_losses: list[float], bisections: int = 64) -> float:
    """The standard error of the mean of `batch_losses` from disjoint halves: half the difference
    of the two halves' means (each half's mean has sqrt(2) times the full set's error), root mean
    square over `bisections` random splits into halves (seeded; the first is first half against
    second), so that no one split's luck decides it."""
    half = len(batch_losses) // 2
    order, squares = list(range(2 * half)), []
    shuffle = random.Random(0).shuffle
    for split in range(bisections):
        if split:
            shuffle(order)
        first = statistics.fmean(batch_losses[i] for i in order[:half])
        second = statistics.fmean(batch_losses[i] for i in order[half:])
        squares.append(((first - second) / 2) ** 2)
    return math.sqrt(statistics.fmean(squares))


def noise(results: list[dict]) -> Optional[dict]:
    """The final held-out loss's standard error, pooled over runs: from disjoint halves
    (root mean square of each run's), and from the batches' spread (std / sqrt(n))."""
    batches = [r["batch_losses"] for r in results if r.get("batch_losses") and len(r["batch_losses"]) > 1
               and all(math.isfinite(x) for x in r["batch_losses"])]
    if not batches:
        return None
    halves = [halves_standard_error(b) for b in batches]
    spread = [statistics.stdev(b) / math.sqrt(len(b)) for b in batches]
    return {"halves": math.sqrt(statistics.fmean(h * h for h in halves)), "batches": statistics.fmean(spread),
            "runs": len(batches), "batches_per_evaluation": len(batches[0])}


def at_edge(value: float, values: list[float], floor: Optional[float] = None) -> Optional[str]:
    """'low' or 'high' when `value` is the lowest or highest of 2+ distinct `values`; a value at
    `floor` (the least the setting can take) is no edge: there is nothing below it to try."""
    distinct = sorted(set(values))
    if len(distinct) < 2 or value == floor:
        return None
    return "low" if value == distinct[0] else "high" if value == distinct[-1] else None


def edges(results: dict[str, dict], best: Setting, cell: Cell) -> list[str]:
    """The swept values (lr, Muon's Adam lr factor, AdamW's weight decay) at which `best` is the
    lowest or highest tried with its other values: a wider sweep may do better (weight decay 0 excepted)."""
    rows = [r["setting"] for r in results.values() if r["setting"]["optimizer"] == best.optimizer
            and r["iterations"] == cell.iterations and r["seed"] == 1]
    flags = []
    for field in ("lr", "adam_lr_factor", "weight_decay"):
        others = {k: v for k, v in vars(best).items() if k != field}
        values = [s[field] for s in rows if all(s[k] == v for k, v in others.items())]
        floor = 0.0 if field == "weight_decay" else None
        if (end := at_edge(getattr(best, field), values, floor)) is not None:
            flags.append(f"{field} {getattr(best, field):g} at the {end} end of {sorted(set(values))}")
    return flags


def spread(values: list[float]) -> Optional[dict]:
    if not values:
        return None
    finite = all(math.isfinite(v) for v in values)  # a diverged seed: mean and std are inf
    return {"mean": statistics.fmean(values),
            "std": (statistics.stdev(values) if finite else math.inf) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarize_cell(study: Study, cell: Cell, results: dict[str, dict]) -> dict:
    """Everything the report shows of one cell; `complete` only when every planned run is done."""
    planned = plan(study, cell, results)
    complete = all(r.name in results for r in planned) and any(r.stage == "budget" for r in planned)
    summary = {"cell": cell.key, "corpus": cell.corpus, "model": cell.model.name, "iterations": cell.iterations,
               "runs_done": len(results),
               "runs_expected": max(expected_runs(study, cell), len({r.name for r in planned} | set(results))),
               "complete": complete, "noise": noise(list(results.values())),
               "wall_s": sum(r.get("wall_s", 0) for r in results.values()),
               "devices": sorted({r.get("device", "cpu") for r in results.values()})}
    for optimizer in ("adamw", "muon"):
        best = best_setting(results, optimizer, cell.iterations)
        summary[optimizer] = None if best is None else {"setting": vars(best), "edges": edges(results, best, cell)}
    if not complete:
        return summary
    budgets = [budget_iterations(cell, b) / cell.iterations for b in study.budgets]
    finals = {}
    for optimizer in ("adamw", "muon"):
        best = Setting(**summary[optimizer]["setting"])
        finals[optimizer] = [[final_loss(_result_of(results, best, budget_iterations(cell, b), seed))
                              for seed in study.seeds] for b in study.budgets]
        summary[optimizer]["final_loss"] = [spread(per_seed) for per_seed in finals[optimizer]]
    target = statistics.fmean(finals["adamw"][-1])
    mean_curve = [statistics.fmean(per_seed) for per_seed in finals["muon"]]
    ratio, why = crossing(budgets, mean_curve, target)
    per_seed = [crossing(budgets, [finals["muon"][i][k] for i in range(len(budgets))], target)
                for k in range(len(study.seeds))]
    summary.update(budgets=budgets, target=target, ratio=ratio, ratio_note=why,
                   ratio_per_seed=[r for r, _ in per_seed], ratio_per_seed_notes=[w for _, w in per_seed],
                   mid_curve=mid_curve(results, summary, cell, study))
    return summary


def mid_curve(results: dict[str, dict], summary: dict, cell: Cell, study: Study) -> Optional[dict]:
    """The old measure, kept for comparison: where Muon's periodic validation curve (mid-schedule,
    10 moving batches) reaches AdamW's periodic validation at its last iteration (mean over seeds),
    as a fraction of the longest budget, per Muon seed."""
    runs = {opt: [_result_of(results, Setting(**summary[opt]["setting"]), cell.iterations, seed)
                  for seed in study.seeds] for opt in ("adamw", "muon")}
    ends = [r["validation"][-1][1] for r in runs["adamw"] if r and r["validation"]]
    if len(ends) != len(study.seeds):
        return None
    target = statistics.fmean(ends)
    reach = [validation_reach([tuple(p) for p in r["validation"]], target) if r else None for r in runs["muon"]]
    reached = [x / cell.iterations for x in reach if x is not None]
    return {"target": target, "fraction": spread(reached), "not_reached": len(reach) - len(reached)}


# Report: the table, the plots, the time, the docs -------------------------------------------------

def _setting_text(setting: dict) -> str:
    if setting["optimizer"] == "adamw":
        return (f"lr {setting['lr']:g}, beta2 {setting['beta2']:g}, warm-up {setting['warmup']:g}, "
                f"wd {setting['weight_decay']:g}")
    return f"lr {setting['lr']:g}, Adam lr x{setting['adam_lr_factor']:g}"


def _spread_text(values: Optional[dict], number: str = "{:.3f}") -> str:
    if values is None:
        return "-"
    text = number.format(values["mean"])
    if values["n"] > 1:
        text += f" ± {number.format(values['std'])}"
    return text


def ratio_text(summary: dict) -> str:
    """The cell's ratio: from the seeds' mean curve, with the per-seed range."""
    if summary["ratio"] is None:
        return {"below": f"≤ {summary['budgets'][0]:g} (already at the smallest budget)",
                "never": "> 1 (Muon never reaches it)"}[summary["ratio_note"]]
    seeds = [r for r in summary["ratio_per_seed"] if r is not None]
    text = f"**{summary['ratio']:.2f}**"
    if seeds:
        values = spread(seeds)
        text += f" (seeds: {values['min']:.2f}-{values['max']:.2f}, std {values['std']:.2f}"
        missing = len(summary["ratio_per_seed"]) - len(seeds)
        text += f"; {missing} outside the budgets)" if missing else ")"
    return text


def markdown(summaries: list[dict], study: Study) -> str:
    budgets = " / ".join(f"{b:g}" for b in study.budgets)
    lines = [f"| corpus | model | iterations | AdamW best | Muon best | AdamW final loss | Muon final loss "
             f"(budget {budgets}) | Muon reaches AdamW's final loss at (whole schedules) | "
             f"mid-curve (old measure) | runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        head = f"| {s['corpus']} | {s['model']} | {s['iterations']} |"
        runs = f"{s['runs_done']} of {s['runs_expected']}"
        if not s["complete"]:
            lines.append(f"{head} pending | pending | pending | pending | pending | pending | {runs} |")
            continue
        best = {o: _setting_text(s[o]["setting"]) + "".join(" ⚠ edge" for _ in s[o]["edges"][:1])
                for o in ("adamw", "muon")}
        muon = " / ".join(_spread_text(v) for v in s["muon"]["final_loss"])
        middle = s["mid_curve"]
        mid = _spread_text(middle["fraction"], "{:.2f}") if middle and middle["fraction"] else "-"
        lines.append(f"{head} {best['adamw']} | {best['muon']} | {_spread_text(s['adamw']['final_loss'][-1])} | "
                     f"{muon} | {ratio_text(s)} | {mid} | {runs} |")
    lines += ["", *notes(summaries)]
    return "\n".join(lines)


def notes(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        for optimizer in ("adamw", "muon"):
            for flag in (s[optimizer] or {}).get("edges", []) if s["complete"] else []:
                lines.append(f"- {s['cell']}: {optimizer}'s best {flag}; a wider sweep may do better.")
        if s["devices"] and s["devices"] != ["cpu"]:
            lines.append(f"- {s['cell']}: trained on {' and '.join(s['devices'])} (the trainer's default where "
                         f"torch sees a GPU); its runs' times are left out of the CPU time below.")
        if s["noise"]:
            n = s["noise"]
            lines.append(f"- {s['cell']}: final held-out loss's standard error {n['halves']:.4f} (disjoint halves, "
                         f"root mean square over {n['runs']} runs; {n['batches']:.4f} from the spread of its "
                         f"{n['batches_per_evaluation']} batches).")
    lines.append(range_text(summaries))
    return lines


def range_text(summaries: list[dict]) -> str:
    """The ratio's range over the complete cells; a cell outside the budgets counts as its bound
    ('≤ the smallest budget', '> 1')."""
    complete = [s for s in summaries if s["complete"]]
    if not complete:
        return f"- No cell is complete yet (0 of {len(summaries)}): no ratio to report."
    values = sorted((s["ratio"], "") if s["ratio"] is not None else (s["budgets"][0], "≤ ")
                    if s["ratio_note"] == "below" else (1.0, "> ") for s in complete)
    low, high = (f"{sign}{value:.2f}" for value, sign in (values[0], values[-1]))
    return f"- Range over the {len(complete)} complete cells of {len(summaries)}: {low} to {high}."


def plot_cell(summary: dict, path: str) -> None:
    """Final held-out loss against budget, AdamW and Muon (mean over seeds), and the target."""
    from megatron_eopt.training.logging.training_log import GREY, PALETTE, Curve, plot_curves

    iterations = [b * summary["iterations"] for b in summary["budgets"]]
    curves = [Curve(f"{name} (mean of seeds)", iterations, [v["mean"] for v in summary[o]["final_loss"]], color)
              for o, name, color in (("adamw", "AdamW", PALETTE[0]), ("muon", "Muon", PALETTE[1]))]
    curves.append(Curve("AdamW's final loss at the longest budget", [iterations[0], iterations[-1]],
                        [summary["target"]] * 2, GREY, dashed=True))
    plot_curves(path, curves, x_label=f"budget (iterations), {summary['cell']}", y_label="final held-out loss",
                log_y=False)


def cell_iterations(study: Study, cell: Cell) -> list[int]:
    """The training iterations of each run of a complete cell without lr extensions."""
    sweep = [cell.iterations] * (len(sweep_runs(study, cell)) + len(study.adamw_weight_decays))
    budgets = [budget_iterations(cell, b) for _ in ("adamw", "muon") for b in study.budgets for _ in study.seeds]
    budgets.remove(cell.iterations)  # each optimizer's longest budget, seed 1, is its sweep run
    budgets.remove(cell.iterations)
    return sweep + budgets


def projected_seconds(study: Study, results: dict[str, dict[str, dict]]) -> Optional[dict]:
    """A run's time as start-up and evaluations plus its iterations, both times its model's cost,
    from medians over the finished runs (the trainer's median iteration, so a paused run does not
    count its pause as training; CPU runs only); the study's total, and what its missing runs still need."""
    cells = {c.key: c for c in study.cells}
    finished = [(r, cells[key].model.cost) for key, rs in results.items() if key in cells for r in rs.values()
                if r.get("wall_s") and r.get("seconds_per_iteration")]
    rows = [(r, cost) for r, cost in finished if r.get("device", "cpu") == "cpu"]
    if not rows:
        return None
    per_iteration = statistics.median(r["seconds_per_iteration"] / cost for r, cost in rows)
    overhead = statistics.median((r["wall_s"] - r["seconds_per_iteration"] * r["iterations"]) / cost
                                 for r, cost in rows)
    total = sum((overhead + per_iteration * iterations) * cell.model.cost
                for cell in study.cells for iterations in cell_iterations(study, cell))
    done = sum((overhead + per_iteration * r["iterations"]) * cost for r, cost in finished)
    return {"seconds_per_iteration": per_iteration, "overhead_s": overhead, "runs": len(rows),
            "total_s": total, "remaining_s": max(0.0, total - done)}


def report(study: Study, args: argparse.Namespace, results: dict[str, dict[str, dict]]) -> str:
    summaries = [summarize_cell(study, cell, results.get(cell.key, {})) for cell in study.cells]
    table = markdown(summaries, study)
    timing = projected_seconds(study, results)
    if timing:
        table += (f"\n- Time, from the medians of {timing['runs']} runs so far (one thread each): "
                  f"{timing['seconds_per_iteration'] * 1000:.0f} ms per iteration of the 1.0M model and "
                  f"{timing['overhead_s']:.0f} s per run for start-up and evaluations. The whole study: about "
                  f"{timing['total_s'] / 3600:.1f} CPU-hours, {timing['total_s'] / 3600 / 2:.1f} h of wall time at 2 "
                  f"runs on 2 cores; {timing['remaining_s'] / 3600:.1f} CPU-hours still to run.")
    plots = []
    for summary in summaries:
        if summary["complete"]:
            name = f"convergence_range_{summary['cell']}.png"
            plot_cell(summary, os.path.join(args.out, name))
            plots.append(name)
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"cells": summaries, "time": timing}, handle, indent=1)
    with open(os.path.join(args.out, "convergence_range.md"), "w") as handle:
        handle.write(table + "\n")
    if args.docs:
        for name in plots:
            plot_cell(next(s for s in summaries if name.endswith(f"_{s['cell']}.png")),
                      os.path.join(ROOT, "docs", name))
        images = "".join(f"\n\n![{name[:-4]}]({name})" for name in plots)
        replace_table(DOC, table + images, (TABLE_BEGIN, TABLE_END))
    return table


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "convergence-range")
    parser.add_argument("--threads", type=int, default=None, help="threads per run (default: CPUs / jobs)")
    parser.add_argument("--cells", default=None, help="comma-separated cell keys to run (default: all, in order)")
    parser.add_argument("--report-only", action="store_true", help="no training: the report from the runs so far")
    return checked_common_arguments(parser, parser.parse_args(argv), "convergence-range")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    study = QUICK if args.quick else FULL
    chosen = args.cells.split(",") if args.cells else [c.key for c in study.cells]
    unknown = set(chosen) - {c.key for c in study.cells}
    if unknown:
        raise SystemExit(f"unknown cells {sorted(unknown)}; the study's: {[c.key for c in study.cells]}")
    start = time.time()
    if not args.report_only:
        for cell in study.cells:
            if cell.key in chosen:
                run_cell(study, cell, args)
    results = {c.key: read_results(os.path.join(args.out, "runs", c.key)) for c in study.cells}
    print("\n" + report(study, args, results))
    print(f"> {(time.time() - start) / 60:.1f} min; wrote summary.json and convergence_range.md to {args.out}"
          + (f" and the table to {DOC}" if args.docs else ""))


if __name__ == "__main__":
    main()
