"""The range study's design and plan (benchmarks/convergence_range.py runs it and reports).

A cell's runs, given the results so far, stage by stage: sweeps at the longest budget, seed 1
(AdamW over lr x beta2 x warm-up; Muon over its lr x --decoupled-lr's factor at each of its momenta,
the shipped default's first); a best lr at the end of its sweep extends it outward (up to
LR_EXTENSIONS steps of 2x, each momentum on its own), and so does Muon's best momentum (along
MOMENTUM_LADDER); AdamW's weight decay at its best point; then whole schedules: each best setting
(Muon's at each swept momentum, and at an extended momentum that wins) trained to each budget, its
cosine ending there, with every seed.
"""

import itertools
import math
import sys
from dataclasses import dataclass, replace
from typing import Optional

from arguments.optimizer_args import MEGATRON_LM_PARSER_DEFAULTS

LR_EXTENSIONS = 2
MUON = ("--optimizer", "muon", "--muon-match-adamw-rms", "--muon-momentum")  # + the setting's momentum
ADAMW = ("--optimizer", "adam")
# Muon's momentum: what `--optimizer muon` resolves to (Megatron-LM's parser default, which our trainer
# and Megatron-LM's loop both take), and megatron-core's OptimizerConfig default, which the study's
# first runs trained at and which their names leave out.
SHIPPED_MOMENTUM = MEGATRON_LM_PARSER_DEFAULTS["muon_momentum"]
STORED_MOMENTUM = 0.95
# The momenta an edge may extend to, outward from the swept ones, one step at a time.
MOMENTUM_LADDER = (0.8, 0.85, 0.9, 0.95, 0.975, 0.99)


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
    muon_momenta: tuple[float, ...]  # each a whole sweep and schedules; the shipped default's first
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
    muon_momenta=(SHIPPED_MOMENTUM, STORED_MOMENTUM), budgets=(0.25, 0.5, 0.75, 1.0), seeds=(1, 2, 3))
QUICK = Study(
    cells=(Cell("stdlib", TINY, 40), Cell("gnu-info", TINY, 40)),
    seq_length=32, global_batch=4, eval_iters=2, evaluations=4, corpus_bytes=600_000,
    adamw_lrs=(4e-3, 1.6e-2), adamw_beta2s=(0.95, 0.999), adamw_warmups=(0.05,), adamw_weight_decays=(0.1,),
    muon_lrs=(8e-3, 3.2e-2), muon_adam_lr_factors=(1.0, 2.0),
    muon_momenta=(SHIPPED_MOMENTUM, STORED_MOMENTUM), budgets=(0.5, 1.0), seeds=(1, 2), final_eval_cap=100)


@dataclass(frozen=True)
class Setting:
    """One optimizer's hyperparameters."""

    optimizer: str  # 'adamw' or 'muon'
    lr: float
    beta2: float = 0.999
    warmup: float = MUON_WARMUP
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    adam_lr_factor: float = 1.0
    momentum: float = STORED_MOMENTUM  # Muon's (AdamW's beta1 stays 0.9); stored runs without one trained at this

    @property
    def label(self) -> str:
        text = f"{self.optimizer}_lr{self.lr:g}_b2{self.beta2:g}_wu{self.warmup:g}_wd{self.weight_decay:g}"
        text += f"_alr{self.adam_lr_factor:g}" if self.adam_lr_factor != 1.0 else ""
        return text + (f"_mom{self.momentum:g}" if self.momentum != STORED_MOMENTUM else "")


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
            "--final-eval-iters", str(final_eval_iters),
            *((*MUON, f"{s.momentum:g}") if s.optimizer == "muon" else ADAMW),
            "--metrics-jsonl", metrics]


# The plan: which runs a cell needs, given the results so far (stage by stage) ---------------------

def sweep_runs(study: Study, cell: Cell) -> list[Run]:
    adamw = [Setting("adamw", lr, beta2, warmup) for lr, beta2, warmup in
             itertools.product(study.adamw_lrs, study.adamw_beta2s, study.adamw_warmups)]
    muon = [Setting("muon", lr, adam_lr_factor=factor, momentum=momentum) for momentum, lr, factor in
            itertools.product(study.muon_momenta, study.muon_lrs, study.muon_adam_lr_factors)]
    return [Run(s, cell.iterations, 1, "sweep") for s in adamw + muon]


def final_loss(result: Optional[dict]) -> float:
    """A result's final held-out loss; inf for a missing, failed or diverged run."""
    loss = result.get("final_loss") if result else None
    return loss if loss is not None and math.isfinite(loss) else math.inf


def setting_of(result: dict) -> Setting:
    return Setting(**result["setting"])  # a stored Muon run without a momentum trained at STORED_MOMENTUM


def best_setting(results: dict[str, dict], optimizer: str, iterations: int,
                 momentum: Optional[float] = None) -> Optional[Setting]:
    """The seed-1 run at the longest budget with the lowest final loss (Muon's: at `momentum` if given)."""
    rows = [r for r in results.values() if r["setting"]["optimizer"] == optimizer and r["seed"] == 1
            and r["iterations"] == iterations and momentum in (None, setting_of(r).momentum)]
    if not rows:
        return None
    return setting_of(min(rows, key=final_loss))


def lr_extension(results: dict[str, dict], optimizer: str, study: Study, cell: Cell,
                 momentum: Optional[float] = None) -> Optional[Run]:
    """The next lr outward (x2 or /2) with the best setting's other values, if the best lr is the
    lowest or highest tried and fewer than LR_EXTENSIONS lrs lie beyond the grid there (Muon's at
    `momentum`: each swept momentum extends its own lr)."""
    best = best_setting(results, optimizer, cell.iterations, momentum)
    grid = study.adamw_lrs if optimizer == "adamw" else study.muon_lrs
    tried = sorted({r["setting"]["lr"] for r in results.values() if r["setting"]["optimizer"] == optimizer
                    and momentum in (None, setting_of(r).momentum)})
    if best is None or not math.isfinite(final_loss(_result_of(results, best, cell.iterations, 1))):
        return None
    if best.lr == tried[0] and sum(lr < min(grid) for lr in tried) < LR_EXTENSIONS:
        return Run(replace(best, lr=best.lr / 2), cell.iterations, 1, "lr extension")
    if best.lr == tried[-1] and sum(lr > max(grid) for lr in tried) < LR_EXTENSIONS:
        return Run(replace(best, lr=best.lr * 2), cell.iterations, 1, "lr extension")
    return None


def momentum_extension(results: dict[str, dict], cell: Cell) -> Optional[Run]:
    """The next momentum of MOMENTUM_LADDER outward with Muon's best setting's other values, if its
    momentum is the lowest or highest of 2+ tried and the ladder goes on there."""
    best = best_setting(results, "muon", cell.iterations)
    tried = sorted({setting_of(r).momentum for r in results.values() if r["setting"]["optimizer"] == "muon"})
    if best is None or len(tried) < 2 or not math.isfinite(final_loss(_result_of(results, best, cell.iterations, 1))):
        return None
    lower, higher = [m for m in MOMENTUM_LADDER if m < tried[0]], [m for m in MOMENTUM_LADDER if m > tried[-1]]
    if best.momentum == tried[0] and lower:
        return Run(replace(best, momentum=lower[-1]), cell.iterations, 1, "momentum extension")
    if best.momentum == tried[-1] and higher:
        return Run(replace(best, momentum=higher[0]), cell.iterations, 1, "momentum extension")
    return None


def _result_of(results: dict[str, dict], setting: Setting, iterations: int, seed: int) -> Optional[dict]:
    return results.get(Run(setting, iterations, seed, "").name)


def plan(study: Study, cell: Cell, results: dict[str, dict]) -> list[Run]:
    """The runs of `cell` up to the first stage that `results` (by run name) do not complete, each
    optimizer on its own after the sweep (`optimizer_plan`, `muon_plan`); [] when the cell is done."""
    runs = sweep_runs(study, cell)
    if any(r.name not in results for r in runs):
        return runs
    return runs + optimizer_plan(study, cell, results, "adamw") + muon_plan(study, cell, results)


def optimizer_plan(study: Study, cell: Cell, results: dict[str, dict], optimizer: str,
                   momentum: Optional[float] = None) -> list[Run]:
    """One optimizer's runs after the sweep (Muon's at one momentum): lr extensions one at a time,
    AdamW's weight decay, then its best setting at every budget and seed; up to its first stage not
    in `results`."""
    runs = []
    while (extension := lr_extension(results, optimizer, study, cell, momentum)) is not None:
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
    return runs + schedule_runs(study, cell, best_setting(results, optimizer, cell.iterations, momentum))


def muon_plan(study: Study, cell: Cell, results: dict[str, dict]) -> list[Run]:
    """Muon's runs after the sweep: at each swept momentum its own lr extensions and schedules;
    once every lr extension is done, momentum extensions one at a time from the best setting, and
    the schedules of an extended momentum that wins."""
    runs = [run for momentum in study.muon_momenta for run in optimizer_plan(study, cell, results, "muon", momentum)]
    if any(r.stage == "lr extension" and r.name not in results for r in runs):
        return runs
    while (extension := momentum_extension(results, cell)) is not None:
        runs.append(extension)
        if extension.name not in results:
            return runs
    best = best_setting(results, "muon", cell.iterations)
    return runs + (schedule_runs(study, cell, best) if best.momentum not in study.muon_momenta else [])


def schedule_runs(study: Study, cell: Cell, setting: Setting) -> list[Run]:
    """`setting` trained to every budget with every seed (the longest budget's seed 1 is its sweep run)."""
    return [Run(setting, budget_iterations(cell, budget), seed, "budget")
            for budget in study.budgets for seed in study.seeds]


def budget_iterations(cell: Cell, budget: float) -> int:
    return round(cell.iterations * budget)


def expected_runs(study: Study, cell: Cell) -> int:
    """Runs of a complete cell without extensions (each schedule's longest seed 1 is a sweep run)."""
    schedules = 1 + len(study.muon_momenta)  # AdamW's and Muon's at each swept momentum
    return (len(sweep_runs(study, cell)) + len(study.adamw_weight_decays)
            + schedules * (len(study.budgets) * len(study.seeds) - 1))
