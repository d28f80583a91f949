"""`make convergence-range`: Muon's advantage over AdamW as a range; docs/convergence.md has the design.

One cell is a corpus x a model x a longest budget (iterations). _convergence_range_plan.py plans its
runs: sweeps at the longest budget (AdamW's; Muon's at each of its momenta), extensions where a best
value sits at an end, then whole schedules at every budget and seed. This script trains them, each
result in benchmarks/results/convergence-range/runs/CELL/NAME.json (a run whose file holds the same
command is not repeated, so an interrupted study resumes where it stopped), and reports the ratio:
the budget at which Muon's mean final held-out loss equals AdamW's at the longest budget,
interpolated between budgets, at each momentum. Final losses come from --final-eval-iters over the
whole held-out split (its standard error from disjoint halves); the old mid-schedule measure is kept
beside it, labelled. --quick: a tiny model, tiny sweeps (plumbing).
"""

import argparse
import json
import math
import os
import random
import statistics
import struct
import subprocess
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Optional

# the study's design and plan
from _convergence_range_plan import (FULL, QUICK, SHIPPED_MOMENTUM, STORED_MOMENTUM, Cell, Run, Setting, Study,
                                     _result_of, best_setting, budget_iterations, expected_runs, final_loss, muon_plan,
                                     optimizer_plan, plan, run_command, schedule_runs, setting_of, sweep_runs)
# make convergence's: a run's identity, the docs' table, the shared flags
from convergence import add_common_arguments, checked_common_arguments, command_key, replace_table
from megatron_eopt.training.corpus import TOKENIZER_FLAGS, prepare_corpus
from megatron_eopt.training.curves import read_metrics, validation_curve, validation_reach

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "convergence.md")
TABLE_BEGIN, TABLE_END = "<!-- convergence range: begin -->", "<!-- convergence range: end -->"
SPLIT = (0.6, 0.4)  # train, held out: by document (40%: the final loss's standard error under 0.005)


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
    """The swept values (lr, Muon's Adam lr factor and momentum, AdamW's weight decay) at which `best`
    is the lowest or highest tried with its other values: a wider sweep may do better (weight decay 0
    excepted)."""
    rows = [vars(setting_of(r)) for r in results.values() if r["setting"]["optimizer"] == best.optimizer
            and r["iterations"] == cell.iterations and r["seed"] == 1]
    flags = []
    for field in ("lr", "adam_lr_factor", "momentum", "weight_decay"):
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


def finished(runs: list[Run], results: dict[str, dict]) -> bool:
    """Whether `runs` (a plan or part of one) reach the budgets and all have results."""
    return any(r.stage == "budget" for r in runs) and all(r.name in results for r in runs)


def swept(study: Study, cell: Cell, results: dict[str, dict], optimizer: str,
          momentum: Optional[float] = None) -> bool:
    """Whether one optimizer's sweep (Muon's at `momentum`) has all its results: its own stages
    follow from them, whatever the rest of the sweep still lacks."""
    return all(r.name in results for r in sweep_runs(study, cell) if r.setting.optimizer == optimizer
               and (momentum is None or r.setting.momentum == momentum))


def schedule_finals(study: Study, cell: Cell, results: dict[str, dict], setting: Setting) -> list[list[float]]:
    """The final losses of `setting`'s whole schedules: one list per budget, one value per seed."""
    return [[final_loss(_result_of(results, setting, budget_iterations(cell, b), seed)) for seed in study.seeds]
            for b in study.budgets]


def summarize_cell(study: Study, cell: Cell, results: dict[str, dict]) -> dict:
    """Everything the report shows of one cell: AdamW, and Muon at each momentum reported
    (`muon_momentum_summary`); `complete` only when every planned run is done."""
    planned = plan(study, cell, results)
    summary = {"cell": cell.key, "corpus": cell.corpus, "model": cell.model.name, "iterations": cell.iterations,
               "runs_done": len(results),
               "runs_expected": max(expected_runs(study, cell), len({r.name for r in planned} | set(results))),
               "complete": finished(planned, results), "noise": noise(list(results.values())),
               "wall_s": sum(r.get("wall_s", 0) for r in results.values()),
               "devices": sorted({r.get("device", "cpu") for r in results.values()}),
               "budgets": [budget_iterations(cell, b) / cell.iterations for b in study.budgets], "target": None}
    adamw = best_setting(results, "adamw", cell.iterations)
    summary["adamw"] = None if adamw is None else {"setting": vars(adamw), "edges": edges(results, adamw, cell),
                                                   "complete": swept(study, cell, results, "adamw") and finished(
                                                       optimizer_plan(study, cell, results, "adamw"), results)}
    if summary["adamw"] and summary["adamw"]["complete"]:
        finals = schedule_finals(study, cell, results, adamw)
        summary["adamw"]["final_loss"] = [spread(per_seed) for per_seed in finals]
        summary["target"] = statistics.fmean(finals[-1])
    muon_swept = swept(study, cell, results, "muon")
    muon = muon_plan(study, cell, results) if muon_swept else []
    best = best_setting(results, "muon", cell.iterations)
    known = muon_swept and all(r.name in results for r in muon if r.stage != "budget")  # no extension to come
    best_momentum = best.momentum if known else None
    momenta = list(study.muon_momenta) + ([best_momentum] if known and best_momentum not in study.muon_momenta
                                          else [])
    summary["best_momentum"] = best_momentum
    summary["muon"] = [muon_momentum_summary(study, cell, results, summary, momentum, best_momentum)
                       for momentum in momenta]
    return summary


def muon_momentum_summary(study: Study, cell: Cell, results: dict[str, dict], summary: dict, momentum: float,
                          best_momentum: Optional[float]) -> dict:
    """Muon at one momentum: its best setting, and once its runs and AdamW's are done, its final
    losses, the ratio with its spread over seeds, and the mid-curve measure."""
    best = best_setting(results, "muon", cell.iterations, momentum)
    runs = (optimizer_plan(study, cell, results, "muon", momentum) if momentum in study.muon_momenta
            else schedule_runs(study, cell, best) if best else [])
    entry = {"momentum": momentum, "shipped_default": momentum == SHIPPED_MOMENTUM,
             "best": momentum == best_momentum, "setting": vars(best) if best else None,
             "edges": edges(results, best, cell) if best else [],
             "complete": (swept(study, cell, results, "muon", momentum) and summary["target"] is not None
                          and finished(runs, results))}
    if not entry["complete"]:
        return entry
    finals = schedule_finals(study, cell, results, best)
    budgets, target = summary["budgets"], summary["target"]
    ratio, why = crossing(budgets, [statistics.fmean(per_seed) for per_seed in finals], target)
    per_seed = [crossing(budgets, [finals[i][k] for i in range(len(budgets))], target)
                for k in range(len(study.seeds))]
    seeds = spread([r for r, _ in per_seed if r is not None])
    entry.update(final_loss=[spread(per_seed) for per_seed in finals], ratio=ratio, ratio_note=why,
                 ratio_per_seed=[r for r, _ in per_seed], ratio_per_seed_notes=[w for _, w in per_seed],
                 ratio_standard_error=seeds["std"] / math.sqrt(seeds["n"]) if seeds else None,
                 mid_curve=mid_curve(results, Setting(**summary["adamw"]["setting"]), best, cell, study))
    return entry


def mid_curve(results: dict[str, dict], adamw: Setting, muon: Setting, cell: Cell, study: Study) -> Optional[dict]:
    """The old measure, kept for comparison: where Muon's periodic validation curve (mid-schedule,
    10 moving batches) reaches AdamW's periodic validation at its last iteration (mean over seeds),
    as a fraction of the longest budget, per Muon seed."""
    runs = {opt: [_result_of(results, setting, cell.iterations, seed) for seed in study.seeds]
            for opt, setting in (("adamw", adamw), ("muon", muon))}
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


def momentum_text(momentum: float) -> str:
    """A momentum with what it is: the shipped default, or megatron-core's (the study's first runs)."""
    names = {SHIPPED_MOMENTUM: "the shipped default", STORED_MOMENTUM: "megatron-core's default"}
    return f"{momentum:g}" + (f" ({names[momentum]})" if momentum in names else "")


def ratio_text(entry: dict) -> str:
    """Muon's ratio at one momentum: from the seeds' mean curve, with the per-seed range, their
    standard deviation and the standard error of their mean."""
    if entry["ratio"] is None:
        return {"below": "≤ the smallest budget", "never": "> 1 (Muon never reaches it)"}[entry["ratio_note"]]
    seeds = [r for r in entry["ratio_per_seed"] if r is not None]
    text = f"**{entry['ratio']:.2f}**"
    if seeds:
        values = spread(seeds)
        text += (f" (seeds: {values['min']:.2f}-{values['max']:.2f}, std {values['std']:.2f}, "
                 f"standard error {entry['ratio_standard_error']:.3f}")
        missing = len(entry["ratio_per_seed"]) - len(seeds)
        text += f"; {missing} outside the budgets)" if missing else ")"
    return text


def markdown(summaries: list[dict], study: Study) -> str:
    """One row per cell and Muon momentum (the shipped default's first); a momentum whose runs or
    AdamW's are not all done is pending."""
    budgets = " / ".join(f"{b:g}" for b in study.budgets)
    lines = [f"| corpus | model | iterations | AdamW best | AdamW final loss | Muon momentum | Muon best | "
             f"Muon final loss (budget {budgets}) | Muon reaches AdamW's final loss at (whole schedules) | "
             f"mid-curve (old measure) | runs |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        head = f"| {s['corpus']} | {s['model']} | {s['iterations']} |"
        adamw = s["adamw"] if s["adamw"] and s["adamw"]["complete"] else None
        adamw_text = (f"{_setting_text(adamw['setting'])}{' ⚠ edge' if adamw['edges'] else ''} | "
                      f"{_spread_text(adamw['final_loss'][-1])}" if adamw else "pending | pending")
        runs = f"{s['runs_done']} of {s['runs_expected']}"
        for entry in s["muon"]:
            momentum = momentum_text(entry["momentum"]) + (", **best**" if entry["best"] else "")
            if not entry["complete"]:
                lines.append(f"{head} {adamw_text} | {momentum} | pending | pending | pending | pending | {runs} |")
                continue
            best = _setting_text(entry["setting"]) + (" ⚠ edge" if entry["edges"] else "")
            losses = " / ".join(_spread_text(v) for v in entry["final_loss"])
            middle = entry["mid_curve"]
            mid = _spread_text(middle["fraction"], "{:.2f}") if middle and middle["fraction"] else "-"
            lines.append(f"{head} {adamw_text} | {momentum} | {best} | {losses} | {ratio_text(entry)} | {mid} | "
                         f"{runs} |")
    lines += ["", *notes(summaries), *range_text(summaries, study)]
    return "\n".join(lines)


def notes(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        for flag in s["adamw"]["edges"] if s["adamw"] and s["adamw"]["complete"] else []:
            lines.append(f"- {s['cell']}: adamw's best {flag}; a wider sweep may do better.")
        for entry in s["muon"]:
            for flag in entry["edges"] if entry["complete"] else []:
                lines.append(f"- {s['cell']}: muon's best at momentum {entry['momentum']:g}: {flag}; a wider sweep "
                             f"may do better.")
        if s["devices"] and s["devices"] != ["cpu"]:
            lines.append(f"- {s['cell']}: trained on {' and '.join(s['devices'])} (the trainer's default where "
                         f"torch sees a GPU); its GPU runs' times are left out of the CPU time below.")
        if s["noise"]:
            n = s["noise"]
            lines.append(f"- {s['cell']}: final held-out loss's standard error {n['halves']:.4f} (disjoint halves, "
                         f"root mean square over {n['runs']} runs; {n['batches']:.4f} from the spread of its "
                         f"{n['batches_per_evaluation']} batches).")
    return lines


def ratio_range(entries: list[dict]) -> tuple[str, str, str]:
    """The lowest and highest ratio of `entries` (one per cell; a ratio outside the budgets counts
    as its bound, '≤ the smallest budget', '> 1'), and the range over their seeds."""
    def bound(ratio: Optional[float], note: str, smallest: float) -> tuple[float, str]:
        return (ratio, "") if ratio is not None else (smallest, "≤ ") if note == "below" else (1.0, "> ")

    values = sorted(bound(e["ratio"], e["ratio_note"], e["smallest_budget"]) for e in entries)
    seeds = sorted(bound(r, note, e["smallest_budget"]) for e in entries
                   for r, note in zip(e["ratio_per_seed"], e["ratio_per_seed_notes"]))
    low, high, seed_low, seed_high = (f"{sign}{value:.2f}" for value, sign in
                                      (values[0], values[-1], seeds[0], seeds[-1]))
    return low, high, f"{seed_low}{' to ' if seeds[0][1] or seeds[-1][1] else '-'}{seed_high}"


def range_text(summaries: list[dict], study: Study) -> list[str]:
    """The ratio's range over the cells complete at each swept momentum, and at each cell's best."""
    lines = []
    labelled = [(f"At momentum {momentum_text(m)}", lambda e, m=m: e["momentum"] == m) for m in study.muon_momenta]
    labelled.append(("At each cell's best momentum (its lowest seed-1 final loss at the longest budget)",
                     lambda e: e["best"]))
    for label, chosen in labelled:
        entries = [{**e, "smallest_budget": s["budgets"][0]} for s in summaries for e in s["muon"]
                   if chosen(e) and e["complete"]]
        if not entries:
            lines.append(f"- {label}: no cell is complete yet (0 of {len(summaries)}): no ratio to report.")
            continue
        low, high, seeds = ratio_range(entries)
        lines.append(f"- {label}: range over the {len(entries)} complete cells of {len(summaries)}: {low} to {high} "
                     f"(seeds {seeds}).")
    best = [f"{s['cell']} {s['best_momentum']:g}" for s in summaries if s["best_momentum"] is not None]
    if best:
        lines.append(f"- Best momentum: {', '.join(best)} (the shipped default is {SHIPPED_MOMENTUM:g}).")
    return lines


def plot_cell(summary: dict, path: str) -> None:
    """Final held-out loss against budget, AdamW and Muon at each complete momentum (mean over
    seeds), and the target."""
    from megatron_eopt.training.logging.training_log import GREY, PALETTE, Curve, plot_curves

    iterations = [b * summary["iterations"] for b in summary["budgets"]]
    lines = [("AdamW", summary["adamw"])] + [(f"Muon, momentum {e['momentum']:g}", e) for e in summary["muon"]
                                            if e["complete"]]
    curves = [Curve(f"{name} (mean of seeds)", iterations, [v["mean"] for v in entry["final_loss"]],
                    PALETTE[i % len(PALETTE)]) for i, (name, entry) in enumerate(lines)]
    curves.append(Curve("AdamW's final loss at the longest budget", [iterations[0], iterations[-1]],
                        [summary["target"]] * 2, GREY, dashed=True))
    plot_curves(path, curves, x_label=f"budget (iterations), {summary['cell']}", y_label="final held-out loss",
                log_y=False)


def cell_iterations(study: Study, cell: Cell) -> list[int]:
    """The training iterations of each run of a complete cell without extensions."""
    sweep = [cell.iterations] * (len(sweep_runs(study, cell)) + len(study.adamw_weight_decays))
    budgets = []
    for _ in range(1 + len(study.muon_momenta)):  # AdamW's schedules and Muon's at each swept momentum
        budgets += [budget_iterations(cell, b) for b in study.budgets for _ in study.seeds]
        budgets.remove(cell.iterations)  # its longest budget, seed 1, is a sweep run
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
        if any(entry["complete"] for entry in summary["muon"]):
            name = f"convergence_range_{summary['cell']}.png"
            plot_cell(summary, os.path.join(args.out, name))
            plots.append(name)
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"shipped_momentum": SHIPPED_MOMENTUM, "cells": summaries, "time": timing}, handle, indent=1)
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
