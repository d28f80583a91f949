"""What the trainer reports: Megatron-LM's iteration line, TensorBoard scalars, JSONL, plots.

Rank 0 prints Megatron-LM's iteration line (megatron/training/training.py `training_log`) after
the first iteration and every `--log-interval`, with its fields, spelling and number formats.
`lm loss` is the mean over the interval's successful iterations; the elapsed time is the
interval's wall time per iteration; the skipped and nan counters restart after each line.
Optional fields (`num zeros`, `params norm`, `max attention logit`, `load_balancing_loss`,
`throughput per GPU (TFLOP/s/GPU)`) appear when their flags ask for them.

`--tensorboard-dir` writes Megatron-LM's scalar tags with torch's SummaryWriter,
`--metrics-jsonl` one JSON object per printed line, `--plot` the loss curve with matplotlib.
On a terminal rank 0 also redraws a progress bar below the log lines.
"""

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, Optional, Sequence, TextIO

import torch
import torch.distributed as dist

# Matplotlib's default colour cycle ("tab:blue", "tab:orange", ...), as RGB.
Color = tuple[int, int, int]
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
GREY: Color = (150, 150, 150)
PLOT_SIZE = (640, 400)  # pixels
# The iteration number in a printed line, for readers of the log (e.g. scripts/demo.py).
ITERATION_IN_LINE = re.compile(r"\] iteration +(\d+)/ *\d+ \|")


# ------------------------------------------------------------------------------------------------
# The iteration line
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntervalStats:
    """One printed line's values: the interval that ends at `iteration`."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float  # per iteration, over the interval
    learning_rate: float
    global_batch_size: int
    lm_loss: Optional[float]  # mean over the interval's successful iterations; None if there were none
    loss_scale: float
    grad_norm: Optional[float]
    skipped: int
    nan: int
    num_zeros: Optional[float] = None
    params_norm: Optional[float] = None
    max_attention_logit: Optional[float] = None
    throughput: Optional[float] = None  # TFLOP/s per GPU (per process on CPU), with --log-throughput
    # Losses besides the lm loss (Megatron-LM's other total_loss_dict entries, e.g. MoE's
    # load_balancing_loss): means over the interval's successful iterations.
    other_losses: dict[str, float] = field(default_factory=dict)


def throughput_text(tflops: float) -> str:
    """Megatron-LM's one decimal from 1 TFLOP/s up; below it three significant digits (a CPU's
    0.00412 would print as 0.0)."""
    if not math.isfinite(tflops) or tflops <= 0 or float(f"{tflops:.3g}") >= 1:
        return f"{tflops:.1f}"
    rounded = float(f"{tflops:.3g}")  # 0.0009996 has the digits of 0.00100, not of 0.000999
    return f"{tflops:.{2 - math.floor(math.log10(rounded))}f}"


def format_iteration_line(stats: IntervalStats, now: Optional[datetime] = None) -> str:
    """Megatron-LM's line for `stats` (the fields this trainer has, in Megatron-LM's order)."""
    now = datetime.now() if now is None else now
    line = f" [{now.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += " iteration {:8d}/{:8d} |".format(stats.iteration, stats.train_iters)
    line += " consumed samples: {:12d} |".format(stats.consumed_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(stats.elapsed_ms)
    if stats.throughput is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput_text(stats.throughput)} |"
    line += f" learning rate: {stats.learning_rate:.6E} |"
    line += f" global batch size: {stats.global_batch_size:5d} |"
    if stats.lm_loss is not None and stats.lm_loss >= 0.0:  # Megatron-LM prints non-negative means only
        line += " lm loss: {:.6E} |".format(stats.lm_loss)
    for name, value in stats.other_losses.items():
        if value >= 0.0:
            line += f" {name}: {value:.6E} |"
    line += f" loss scale: {stats.loss_scale:.1f} |"
    if stats.grad_norm is not None:
        line += f" grad norm: {stats.grad_norm:.3f} |"
    if stats.num_zeros is not None:
        line += f" num zeros: {stats.num_zeros} |"
    if stats.params_norm is not None:
        line += f" params norm: {stats.params_norm:.3f} |"
    if stats.max_attention_logit is not None:
        line += f" max attention logit: {stats.max_attention_logit:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(stats.skipped)
    line += " number of nan iterations: {:3d} |".format(stats.nan)
    return line


@dataclass
class IntervalTotals:
    """Megatron-LM's total_loss_dict: sums since the last printed line."""

    loss_sum: float = 0.0
    other_loss_sums: dict[str, float] = field(default_factory=dict)
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: float, ok: bool, other_losses: dict[str, float]) -> None:
        if ok:
            self.advanced += 1
            self.loss_sum += loss
            for name, value in other_losses.items():
                self.other_loss_sums[name] = self.other_loss_sums.get(name, 0.0) + value
        else:  # a skipped step's loss is not averaged; a non-finite one counts as a nan iteration
            self.skipped += 1
            self.nan += int(not math.isfinite(loss))

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped

    @property
    def mean_loss(self) -> Optional[float]:
        return self.loss_sum / self.advanced if self.advanced else None

    @property
    def mean_other_losses(self) -> dict[str, float]:
        return {name: total / self.advanced for name, total in self.other_loss_sums.items()}


# ------------------------------------------------------------------------------------------------
# Progress bar
# ------------------------------------------------------------------------------------------------


class ProgressBar:
    """One line redrawn in place (carriage return) on a terminal; cleared before each log line."""

    WIDTH = 30

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.start, self.shown, self.first = time.perf_counter(), 0, 0

    def draw(self, iteration: int, loss: float) -> None:
        done = self.WIDTH * iteration // self.total
        seconds_per_iteration = (time.perf_counter() - self.start) / max(iteration - self.first, 1)
        eta = seconds_per_iteration * (self.total - iteration)
        line = (f"[{'#' * done}{'.' * (self.WIDTH - done)}] {iteration}/{self.total} | loss {loss:.4f} | "
                f"{1000 * seconds_per_iteration:.0f} ms/it | eta {eta:.0f} s")
        self.stream.write("\r" + line.ljust(self.shown))
        self.stream.flush()
        self.shown = len(line)

    def start_at(self, iteration: int) -> None:
        self.start, self.first = time.perf_counter(), iteration

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.shown = 0

    def finish(self) -> None:
        """Keep the last state on screen, ending its line."""
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = 0


# ------------------------------------------------------------------------------------------------
# TensorBoard
# ------------------------------------------------------------------------------------------------


class TensorBoardWriter:
    """Megatron-LM's scalar tags (each also `<tag> vs samples`, against consumed samples)."""

    def __init__(self, log_dir: str, max_queue: int = 1000) -> None:
        from torch.utils.tensorboard import (
            SummaryWriter,  # needs the tensorboard package
        )

        self.writer = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def scalar(self, tag: str, value: float, iteration: int, consumed_samples: Optional[int] = None) -> None:
        self.writer.add_scalar(tag, value, iteration)
        if consumed_samples is not None:
            self.writer.add_scalar(f"{tag} vs samples", value, consumed_samples)

    def close(self) -> None:
        self.writer.close()


# torch.cuda.memory_stats() keys Megatron-LM writes with --log-memory-to-tensorboard, by tag.
CUDA_MEMORY_TAGS = {"mem-reserved-bytes": "reserved_bytes.all.current",
                    "mem-allocated-bytes": "allocated_bytes.all.current",
                    "mem-max-allocated-bytes": "allocated_bytes.all.peak",
                    "mem-allocated-count": "allocation.all.current"}


def tensorboard_option_lines(args: argparse.Namespace, on_cuda: bool) -> list[str]:
    """A start-up line for each TensorBoard option given that cannot write anything here."""
    given = [flag for flag, on in (("--log-world-size-to-tensorboard", args.log_world_size_to_tensorboard),
                                   ("--log-memory-to-tensorboard", args.log_memory_to_tensorboard),
                                   ("--no-log-loss-scale-to-tensorboard", not args.log_loss_scale_to_tensorboard))
             if on]
    if not args.tensorboard_dir:
        return [f"{flag}: no effect without --tensorboard-dir" for flag in given]
    if args.log_memory_to_tensorboard and not on_cuda:
        return ["--log-memory-to-tensorboard: no effect on CPU (it writes torch.cuda.memory_stats())"]
    return []


# ------------------------------------------------------------------------------------------------
# The logger
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What one training iteration reports."""

    iteration: int
    loss: float  # the global batch's mean loss
    learning_rate: float  # the lr the step used
    ok: bool  # the update was applied (not skipped)
    grad_norm: Optional[float] = None
    loss_scale: float = 1.0
    num_zeros: Optional[float] = None
    params_norm: Optional[float] = None
    max_attention_logit: Optional[float] = None
    other_losses: dict[str, float] = field(default_factory=dict)  # e.g. MoE's load_balancing_loss
    batch_size: Optional[int] = None  # the step's global batch (None: args.global_batch_size)


class Logger:
    """Rank 0's log lines, progress bar (terminal only), metrics file and TensorBoard events.

    `args` gives train_iters, global_batch_size, log_interval, metrics_jsonl and (optional)
    tensorboard_dir / tensorboard_log_interval. Every rank keeps the records (for tests and
    --plot); only rank 0 prints and writes files. With `flops_per_sample` (--log-throughput: one
    sample's FLOPs, forward and backward) each line carries Megatron-LM's throughput per GPU over
    `world_size` ranks, for the logged step's global batch. TensorBoard options (optional in
    `args`, Megatron-LM's defaults): tensorboard_queue_size, log_loss_scale_to_tensorboard,
    log_world_size_to_tensorboard, log_memory_to_tensorboard (written `on_cuda` only).
    """

    def __init__(self, args, rank: int, flops_per_sample: Optional[float] = None, world_size: int = 1,
                 on_cuda: bool = False) -> None:
        self.args, self.is_first = args, rank == 0
        self.flops_per_sample, self.world_size = flops_per_sample, world_size
        self.records: list[dict] = []
        self.totals = IntervalTotals()
        self.consumed_samples = 0
        self.metrics = open(args.metrics_jsonl, "w") if args.metrics_jsonl and self.is_first else None
        tensorboard_dir = getattr(args, "tensorboard_dir", None)
        self.tensorboard = (TensorBoardWriter(tensorboard_dir, getattr(args, "tensorboard_queue_size", 1000))
                            if tensorboard_dir and self.is_first else None)
        self.log_memory = getattr(args, "log_memory_to_tensorboard", False) and on_cuda
        # Redirected output (files, pipes, tests) gets no bar, so logs hold only the log lines.
        self.bar = ProgressBar(args.train_iters, sys.stdout) if self.is_first and sys.stdout.isatty() else None

    def start_at(self, iteration: int, consumed_samples: int) -> None:
        """Resuming: samples, timings and the progress bar count from `iteration`, after
        `consumed_samples` (megatron_eopt/training/data/batch_schedule.py: the batch can grow)."""
        self.consumed_samples = consumed_samples
        self.totals = IntervalTotals()
        if self.bar:
            self.bar.start_at(iteration)

    def _print(self, line: str) -> None:
        if self.bar:
            self.bar.clear()
        print(line, flush=True)

    def say(self, message: str) -> None:
        if self.is_first:
            self._print(f"> {message}")

    def print_line(self, text: str) -> None:
        """Rank 0 prints `text` (e.g. the validation lines) below the progress bar."""
        if self.is_first:
            self._print(text)

    def _batch_size(self, step: Step) -> int:
        return self.args.global_batch_size if step.batch_size is None else step.batch_size

    def iteration(self, step: Step) -> None:
        self.consumed_samples += self._batch_size(step)
        self.totals.add(step.loss, step.ok, step.other_losses)
        if self.tensorboard and step.iteration % getattr(self.args, "tensorboard_log_interval", 1) == 0:
            self._tensorboard_step(step)
        if step.iteration % self.args.log_interval == 0 or step.iteration == 1:
            self._end_interval(step)
        if self.bar:
            self.bar.draw(step.iteration, step.loss)

    def _tensorboard_step(self, step: Step) -> None:
        """Megatron-LM writes these every --tensorboard-log-interval iterations, the loss unaveraged."""
        at, samples = step.iteration, self.consumed_samples
        self.tensorboard.scalar("learning-rate", step.learning_rate, at, samples)
        self.tensorboard.scalar("batch-size", self._batch_size(step), at, samples)
        if step.ok:
            self.tensorboard.scalar("lm loss", step.loss, at, samples)
        for name, value in step.other_losses.items():  # Megatron-LM's MoE tags, without "vs samples"
            self.tensorboard.scalar(name, value, at)
        if getattr(self.args, "log_loss_scale_to_tensorboard", True):
            self.tensorboard.scalar("loss-scale", step.loss_scale, at, samples)
        if getattr(self.args, "log_world_size_to_tensorboard", False):
            self.tensorboard.scalar("world-size", self.world_size, at, samples)
        if step.grad_norm is not None:
            self.tensorboard.scalar("grad-norm", step.grad_norm, at, samples)
        if step.num_zeros is not None:
            self.tensorboard.scalar("num-zeros", step.num_zeros, at, samples)
        if step.params_norm is not None:
            self.tensorboard.scalar("params-norm", step.params_norm, at, samples)
        if step.max_attention_logit is not None:
            self.tensorboard.scalar("max_attention_logit", step.max_attention_logit, at)
        if self.log_memory:
            stats = torch.cuda.memory_stats()
            for tag, key in CUDA_MEMORY_TAGS.items():
                self.tensorboard.scalar(tag, stats.get(key, 0), at)

    def _end_interval(self, step: Step) -> None:
        totals, self.totals = self.totals, IntervalTotals()
        elapsed_ms = (time.perf_counter() - totals.started) * 1000 / totals.iterations
        stats = IntervalStats(
            iteration=step.iteration, train_iters=self.args.train_iters, consumed_samples=self.consumed_samples,
            elapsed_ms=elapsed_ms, learning_rate=step.learning_rate, global_batch_size=self._batch_size(step),
            lm_loss=totals.mean_loss, loss_scale=step.loss_scale, grad_norm=step.grad_norm, skipped=totals.skipped,
            nan=totals.nan, num_zeros=step.num_zeros, params_norm=step.params_norm,
            max_attention_logit=step.max_attention_logit, throughput=self._throughput(elapsed_ms, self._batch_size(step)),
            other_losses=totals.mean_other_losses)
        record = _record(stats)
        self.records.append(record)
        if not self.is_first:
            return
        if self.tensorboard and step.iteration > 1:  # Megatron-LM: not the first, set-up-laden one
            self.tensorboard.scalar("iteration-time", elapsed_ms / 1000, step.iteration)
        if self.tensorboard and stats.throughput is not None:  # Megatron-LM writes it at every line
            self.tensorboard.scalar("throughput", stats.throughput, step.iteration)
        self._print(format_iteration_line(stats))
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def _throughput(self, elapsed_ms: float, batch_size: int) -> Optional[float]:
        """Megatron-LM's: the logged step's FLOPs / (seconds per iteration over the interval x
        1e12 x world size)."""
        if self.flops_per_sample is None:
            return None
        return self.flops_per_sample * batch_size / (elapsed_ms / 1000 * 1e12 * self.world_size)

    def evaluation(self, result) -> None:
        """An evaluation's record (an EvalResult: split, iteration, loss, ppl, final) in the metrics
        file, and for validation Megatron-LM's scalars `lm loss validation` and `lm loss
        validation ppl`; the evaluator prints its own line."""
        if self.metrics:
            record = {"iteration": result.iteration, "split": result.split, "final": result.final,
                      "eval_loss": result.loss, "eval_ppl": result.ppl}
            if result.batch_losses is not None:
                record["batch_losses"] = list(result.batch_losses)
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard and result.split == "valid":
            self.tensorboard.scalar("lm loss validation", result.loss, result.iteration, self.consumed_samples)
            self.tensorboard.scalar("lm loss validation ppl", result.ppl, result.iteration, self.consumed_samples)

    def close(self) -> None:
        if self.bar:
            self.bar.finish()
        if self.metrics:
            self.metrics.close()
        if self.tensorboard:
            self.tensorboard.close()


def _record(stats: IntervalStats) -> dict:
    """The JSONL object of a printed line (the line's values, snake_case)."""
    record = {"iteration": stats.iteration, "consumed_samples": stats.consumed_samples,
              "global_batch_size": stats.global_batch_size,
              "loss": stats.lm_loss, "lr": stats.learning_rate, "grad_norm": stats.grad_norm,
              "loss_scale": stats.loss_scale, "skipped": stats.skipped, "nan": stats.nan,
              "elapsed_ms": stats.elapsed_ms}
    optional = {"num_zeros": stats.num_zeros, "params_norm": stats.params_norm,
                "max_attention_logit": stats.max_attention_logit, "throughput": stats.throughput}
    record.update({key: value for key, value in optional.items() if value is not None})
    record.update(stats.other_losses)
    return record


def params_norm(model: torch.nn.Module, tensor_parallel_rank: int, model_parallel_group,
                expert_tensor_parallel_rank: int = 0, expert_model_parallel_group=None) -> float:
    """L2 norm of all parameters, each counted once (Megatron-LM's calc_params_l2_norm): dense
    parameters summed over the model-parallel group (TP x PP), expert parameters (megatron's
    `allreduce=False`, split over expert parallelism) over the expert model-parallel group
    (expert TP x EP x PP; to be given on every rank when EP > 1), which holds each expert once.
    Parameters replicated over (expert) TP are counted on its rank 0 only, and the last stage's
    copy of a tied embedding (megatron's `param.shared`) not at all."""
    params = [p for p in model.parameters() if not getattr(p, "shared", False)]
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    if experts and expert_model_parallel_group is None:
        raise ValueError(f"params_norm: the model has {len(experts)} expert parameters (allreduce=False); "
                         f"pass expert_model_parallel_group, the group that holds each expert once.")
    device = next(model.parameters()).device
    square = _sum_of_squares(dense, tensor_parallel_rank, model_parallel_group, device)
    if expert_model_parallel_group is not None:  # on every rank, with or without experts (a stage without layers)
        square = square + _sum_of_squares(experts, expert_tensor_parallel_rank, expert_model_parallel_group, device)
    return square.sqrt().item()


def _sum_of_squares(params: list[torch.nn.Parameter], tensor_parallel_rank: int, group,
                    device: torch.device) -> torch.Tensor:
    """Sum of squares of `params` over `group`, TP-replicated ones counted on TP rank 0 only.
    Every rank of the group joins the all-reduce, with or without parameters of its own."""
    counted = [p for p in params if getattr(p, "tensor_model_parallel", False) or tensor_parallel_rank == 0]
    square = torch.zeros((), dtype=torch.float32, device=device)
    for param in counted:
        square += param.detach().float().square().sum()
    dist.all_reduce(square, group=group)
    return square


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


class Curve(NamedTuple):
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: Color
    dashed: bool = False


def plot_curves(path: str, curves: Sequence[Curve], x_label: str = "iteration", y_label: str = "loss",
                log_y: bool = True) -> None:
    """Write `curves` as a PLOT_SIZE PNG at `path` (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    dpi = 100
    figure, axes = pyplot.subplots(figsize=(PLOT_SIZE[0] / dpi, PLOT_SIZE[1] / dpi), dpi=dpi)
    try:
        for curve in curves:
            axes.plot(curve.xs, curve.ys, label=curve.label, color=[c / 255 for c in curve.color],
                      linewidth=2, linestyle="--" if curve.dashed else "-")
        if log_y:
            axes.set_yscale("log")
            # Plain numbers (0.1, 2) rather than powers of ten; of the minor ticks only the 2s
            # and 5s of each decade are labelled, so the labels do not overlap.
            axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axes.yaxis.set_minor_formatter(ticker.FuncFormatter(_two_or_five))
            narrow_log_ticks(axes)
        axes.set_xlabel(x_label)
        axes.set_ylabel(y_label)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=dpi)
    finally:
        pyplot.close(figure)


def narrow_log_ticks(axes) -> None:
    """A log y-axis spanning less than a decade shows no power of ten and at most one 2 or 5 (a
    loss from 1.56 to 4.17 got the single label '2'): label evenly spaced round values in view
    instead (1.5, 2, 2.5, ..., 4 there)."""
    from matplotlib import ticker

    low, high = axes.get_ylim()
    if low <= 0 or high / low >= 10:
        return
    ticks = [t for t in ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high) if low <= t <= high]
    axes.yaxis.set_major_locator(ticker.FixedLocator(ticks))
    axes.yaxis.set_minor_formatter(ticker.NullFormatter())


def _two_or_five(value: float, _position) -> str:
    mantissa = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0.0
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""
