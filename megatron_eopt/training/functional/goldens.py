"""Golden values: read a run's TensorBoard events into Megatron-LM's golden-values schema, compare, record.

A golden file `golden_values_<environment>_<platform>.json` maps each metric to `start_step`,
`end_step`, `step_interval` and `values` ({"step": value rounded to 5 decimals, or "nan" for a
step that logged none}). `compare` follows Megatron-LM's functional tests: a deterministic check
wants equal values, an approximate one |actual - golden| <= atol + rtol |golden| at all but a few
steps, and `iteration-time` compares the medians over a steady window. `mem-*` are CUDA-allocator
statistics: a CPU run has none, and a CPU golden leaves them out (CPU_UNMEASURED). A ckpt-resume
case's golden is its first, whole run; the second run is checked against the first's second half.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import statistics
from typing import Any, Optional

from megatron_eopt.training.functional.cases import METRIC_NAMES, Case, Check, RunPaths

DECIMALS = 5
CPU_UNMEASURED = ("mem-allocated-bytes", "mem-max-allocated-bytes")
GOLDEN_METRIC_KEYS = ("start_step", "end_step", "step_interval", "values")
ENVIRONMENT = "dev"  # Megatron-LM's name for the newest stack (ours: requirements.lock), beside its 'lts'


def platform_name(device: Optional[str] = None) -> str:
    """This machine's platform in golden file names: the GPU's name on CUDA, else the CPU model,
    lower-case with (R)/(TM), 'CPU' and the clock left out: 'nvidia_h100_80gb_hbm3', 'amd_epyc_7b13'."""
    import torch

    from megatron_eopt.runtime.hardware import cpu_model

    on_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    return platform_slug(torch.cuda.get_device_name() if on_cuda else cpu_model())


def platform_slug(name: str) -> str:
    """'AMD EPYC 7B13 64-Core Processor' -> 'amd_epyc_7b13'; 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    name = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$|\d+-core processor", " ", name.lower())
    return "_".join(re.findall(r"[a-z0-9]+", name)) or "unknown"


def golden_path(case: Case, platform: str, environment: str = ENVIRONMENT) -> pathlib.Path:
    return case.directory / f"golden_values_{environment}_{platform}.json"


def find_golden(case: Case, platform: str, on_cuda: bool, cpu_reference: Optional[str],
                environment: str = ENVIRONMENT, record_command: Optional[str] = None) -> pathlib.Path:
    """This platform's golden file; on a CPU without one, the CPU reference platform's (CPU goldens hold
    across CPU kinds: docs/functional-tests.md). ValueError naming the files there and how to record:
    `record_command`, the launcher's command line for the case as its user gave it (a copied folder
    records into that folder), else the launcher with the case's name."""
    path = golden_path(case, platform, environment)
    if path.is_file():
        return path
    if not on_cuda and cpu_reference:
        reference = golden_path(case, cpu_reference, environment)
        if reference.is_file():
            return reference
    present = sorted(p.name for p in case.directory.glob("golden_values_*.json")) or ["none"]
    raise ValueError(f"case {case.name!r}: no golden file {path.name} for platform {platform!r} "
                     f"(present: {', '.join(present)}); record one with "
                     f"`{record_command or f'python tools/run_functional_case.py {case.name} --record'}`")


def read_tensorboard(directories: list[pathlib.Path], train_iters: int, start_step: int = 1,
                     step_interval: int = 1) -> dict[str, dict[str, Any]]:
    """The scalars of the event files in `directories` (in order; a step logged in an earlier one wins),
    in the golden schema for steps start_step..train_iters, "nan" where none."""
    from tensorboard.backend.event_processing import event_accumulator

    logged: dict[str, dict[int, float]] = {}
    for directory in directories:
        files = sorted(pathlib.Path(directory).glob("events*tfevents*"), key=lambda p: p.stat().st_mtime)
        if not files:
            raise ValueError(f"no TensorBoard event file in {directory}: the run wrote none (--tensorboard-dir?)")
        for file in files:
            events = event_accumulator.EventAccumulator(str(file), size_guidance={event_accumulator.SCALARS: 0})
            events.Reload()
            for tag in events.Tags()["scalars"]:
                for event in events.Scalars(tag):
                    logged.setdefault(tag, {}).setdefault(event.step, round(event.value, DECIMALS))
    steps = [s for s in range(start_step, train_iters + 1) if s == start_step or s % step_interval == 0]
    return {tag: {"start_step": steps[0], "end_step": steps[-1], "step_interval": step_interval,
                  "values": {str(s): values.get(s, "nan") for s in steps}}
            for tag, values in sorted(logged.items())}


def check_golden(golden: Any, where: str) -> None:
    """The golden-values schema (Megatron-LM's GoldenValues): metric -> start_step, end_step,
    step_interval, values {step: number or "nan"}, with the steps the first three describe."""
    if not isinstance(golden, dict) or not golden:
        raise ValueError(f"{where}: a golden file maps metric names to their values; got {type(golden).__name__}")
    for metric, entry in golden.items():
        if metric not in METRIC_NAMES:
            raise ValueError(f"{where}: unknown metric {metric!r}; metrics: {', '.join(METRIC_NAMES)}")
        if not isinstance(entry, dict) or sorted(entry) != sorted(GOLDEN_METRIC_KEYS):
            raise ValueError(f"{where}: {metric!r} must hold exactly {', '.join(GOLDEN_METRIC_KEYS)}")
        start, end, interval = (entry[k] for k in GOLDEN_METRIC_KEYS[:3])
        if not all(isinstance(v, int) and v > 0 for v in (start, end, interval)) or end < start:
            raise ValueError(f"{where}: {metric!r}: start_step, end_step, step_interval must be positive "
                             f"integers with end >= start; got {start}, {end}, {interval}")
        steps = [str(s) for s in range(start, end + 1) if s == start or s % interval == 0]
        if list(entry["values"]) != steps:
            raise ValueError(f"{where}: {metric!r}: values must be keyed by steps {steps[:3]}...{steps[-1:]}")
        bad = [v for v in entry["values"].values() if v != "nan" and not isinstance(v, (int, float))]
        if bad:
            raise ValueError(f"{where}: {metric!r}: values must be numbers or \"nan\"; got {bad[:3]}")


def load_golden(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    with open(path) as stream:
        try:
            golden = json.load(stream)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON: {error}") from None
    check_golden(golden, str(path))
    return golden


def record(actual: dict[str, dict[str, Any]], case: Case, path: pathlib.Path, on_cuda: bool) -> pathlib.Path:
    """Write the case's METRICS (those the platform measures) of `actual` as a golden file."""
    golden = {m: actual[m] for m in measured_metrics(case, on_cuda)}
    check_golden(golden, str(path))
    path.write_text(json.dumps(golden, indent=4) + "\n")
    return path


def measured_metrics(case: Case, on_cuda: bool) -> list[str]:
    return [m for m in case.metrics if on_cuda or m not in CPU_UNMEASURED]


@dataclasses.dataclass(frozen=True)
class Verdict:
    metric: str
    passed: bool
    message: str


def _number(value: Any) -> float:
    return math.inf if value == "nan" else float(value)


def steady_window(last_step: int) -> range:
    """Megatron-LM's window for iteration-time's median: past start-up, before any resume."""
    return range(5, 21) if last_step <= 25 else range(30, 46)


def compare_metric(metric: str, check: Check, golden: dict[str, Any], actual: dict[str, Any]) -> Verdict:
    steps = list(golden["values"])
    if metric == "iteration-time":
        window = [s for s in steps if int(s) in steady_window(int(steps[-1]))]
        pairs = [(statistics.median(_number(golden["values"][s]) for s in window),
                  statistics.median(_number(actual["values"].get(s, "nan")) for s in window))]
        labels = ["median"]
    else:
        pairs = [(_number(golden["values"][s]), _number(actual["values"].get(s, "nan"))) for s in steps]
        labels = steps
    if check.type == "deterministic":
        bad = [(label, g, a) for label, (g, a) in zip(labels, pairs) if g != a]
        allowed = 0
    else:
        bad = [(label, g, a) for label, (g, a) in zip(labels, pairs)
               if not (math.isfinite(a) and abs(a - g) <= check.atol + check.rtol * abs(g)) and g != a]
        allowed = (check.failing_steps if check.failing_steps is not None
                   else min(max(len(pairs) // 100, 1), 50)) if len(pairs) > 1 else 0
    tolerance = "exact" if check.type == "deterministic" else f"rtol {check.rtol:g}, atol {check.atol:g}"
    worst = max((abs(a - g) for _, g, a in bad), default=0.0)
    message = (f"{metric} ({check.type}, {tolerance}): {len(bad)} of {len(pairs)} step(s) off, "
               f"{allowed} allowed; worst |actual - golden| {worst:.3g}; first off: {bad[:3]}")
    return Verdict(metric, len(bad) <= allowed, message)


def read_runs(case: Case, paths: RunPaths) -> list[dict[str, dict[str, Any]]]:
    """Each run's metrics in the golden schema: the first run's over every step; a ckpt-resume's second
    run's over the steps after half, where it resumed."""
    runs = [read_tensorboard([paths.tensorboard(1)], case.train_iters)]
    if len(case.phases()) > 1:
        runs.append(read_tensorboard([paths.tensorboard(2)], case.train_iters, start_step=case.train_iters // 2 + 1))
    return runs


def check_runs(case: Case, golden: dict[str, dict[str, Any]], runs: list[dict[str, dict[str, Any]]],
               on_cuda: bool) -> list[Verdict]:
    """The first run against the golden file, and a ckpt-resume's second run against the first run's
    second half (Megatron-LM's two checks of such a case)."""
    verdicts = compare(case, golden, runs[0], on_cuda)
    if len(runs) > 1:
        verdicts += compare_resumed(case, runs[0], runs[1], on_cuda)
    return verdicts


def compare_resumed(case: Case, first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]],
                    on_cuda: bool) -> list[Verdict]:
    """The resumed run's steps after half against the first run's same steps, under the case's checks."""
    half = case.train_iters // 2
    verdicts = []
    for metric in measured_metrics(case, on_cuda):
        if metric not in first or metric not in second:
            verdicts.append(Verdict(metric, False, f"{metric}: not in the {'first' if metric not in first else 'second'} "
                                                   f"run's TensorBoard events (METRICS lists it)"))
            continue
        reference = {**first[metric], "start_step": half + 1,
                     "values": {step: value for step, value in first[metric]["values"].items() if int(step) > half}}
        verdict = compare_metric(metric, case.checks[metric], reference, second[metric])
        verdicts.append(Verdict(metric, verdict.passed, f"resumed at {half}, against the first run: {verdict.message}"))
    return verdicts


def compare(case: Case, golden: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]],
            on_cuda: bool) -> list[Verdict]:
    """One verdict per metric the case checks and the platform measures; a metric missing from the
    golden file or from the run's events is a failed verdict that says so."""
    verdicts = []
    for metric in measured_metrics(case, on_cuda):
        if metric not in golden or metric not in actual:
            where = "the golden file" if metric not in golden else "the run's TensorBoard events"
            verdicts.append(Verdict(metric, False, f"{metric}: not in {where} (METRICS lists it)"))
            continue
        verdicts.append(compare_metric(metric, case.checks[metric], golden[metric], actual[metric]))
    return verdicts
