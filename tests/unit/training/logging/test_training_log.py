"""megatron_eopt/training/logging/training_log.py in-process: Megatron-LM's iteration line, its interval averaging and
counters, the progress bar, TensorBoard validation scalars and the plot.

The line is parsed with a regex written from Megatron-LM's `training_log` format strings
(megatron/training/training.py): ` [%Y-%m-%d %H:%M:%S.%f] iteration {:8d}/{:8d} | consumed
samples: {:12d} | elapsed time per iteration (ms): {:.1f} | [throughput per GPU (TFLOP/s/GPU):
{:.1f} |] learning rate: {:.6E} | global batch
size: {:5d} | lm loss: {:.6E} | loss scale: {:.1f} | grad norm: {:.3f} | ... | number of skipped
iterations: {:3d} | number of nan iterations: {:3d} |`.
"""

import argparse
import io
import math
import re
import sys

import pytest
import torch

from megatron_eopt.training.curves import read_metrics, validation_curve
from megatron_eopt.training.logging import training_log
from megatron_eopt.training.loop.evaluation import EvalResult
from megatron_eopt.training.logging.training_log import IntervalStats, Logger, Step, format_iteration_line

E = r"[0-9]\.[0-9]{6}E[+-][0-9]{2}"  # {:.6E}
MEGATRON_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"
    r" iteration (?P<iteration>[ \d]{8})/(?P<train_iters>[ \d]{8}) \|"
    r" consumed samples: (?P<consumed>[ \d]{12}) \|"
    r" elapsed time per iteration \(ms\): (?P<elapsed>\d+\.\d) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<throughput>\d+\.\d+) \|)?"  # --log-throughput
    rf" learning rate: (?P<lr>{E}) \|"
    r" global batch size: (?P<batch>[ \d]{5}) \|"
    rf"(?: lm loss: (?P<loss>{E}) \|)?"
    rf"(?: load_balancing_loss: (?P<load_balancing>{E}) \|)?"  # Megatron-LM's MoE total_loss_dict entry
    r" loss scale: (?P<scale>\d+\.\d) \|"
    r"(?: grad norm: (?P<grad_norm>\d+\.\d{3}) \|)?"
    r"(?: num zeros: (?P<zeros>[\d.]+) \|)?"
    r"(?: params norm: (?P<params_norm>\d+\.\d{3}) \|)?"
    r"(?: max attention logit: (?P<max_logit>\d+\.\d{3}) \|)?"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|$"
)


def test_line_parses_with_megatron_lm_format() -> None:
    stats = IntervalStats(iteration=20, train_iters=100, consumed_samples=320, elapsed_ms=41.25, learning_rate=9.75e-3,
                          global_batch_size=16, lm_loss=3.1234567, loss_scale=1.0, grad_norm=0.8125, skipped=1,
                          nan=0, num_zeros=3.0, params_norm=18.5, max_attention_logit=52.25, throughput=123.46,
                          other_losses={"load_balancing_loss": 1.0234567})
    match = MEGATRON_LINE.match(format_iteration_line(stats))
    assert match, format_iteration_line(stats)
    values = {key: value.strip() for key, value in match.groupdict().items()}
    assert values == {"iteration": "20", "train_iters": "100", "consumed": "320", "elapsed": "41.2", "throughput": "123.5",
                      "lr": "9.750000E-03", "batch": "16", "loss": "3.123457E+00",
                      "load_balancing": "1.023457E+00", "scale": "1.0",
                      "grad_norm": "0.812", "zeros": "3.0", "params_norm": "18.500", "max_logit": "52.250",
                      "skipped": "1", "nan": "0"}


def test_optional_fields_are_left_out() -> None:
    stats = IntervalStats(iteration=1, train_iters=5, consumed_samples=8, elapsed_ms=2.0, learning_rate=0.0,
                          global_batch_size=8, lm_loss=None, loss_scale=1.0, grad_norm=None, skipped=1, nan=1)
    line = format_iteration_line(stats)
    match = MEGATRON_LINE.match(line)
    assert match and match["loss"] is None and match["grad_norm"] is None and match["max_logit"] is None, line
    assert match["throughput"] is None and "TFLOP" not in line, line


def test_moe_load_balancing_loss_is_averaged_over_the_interval(monkeypatch, tmp_path) -> None:
    """After lm loss, in Megatron-LM's total_loss_dict format, averaged over the interval's
    successful iterations like lm loss; TensorBoard gets each iteration's value."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    log = Logger(_args(train_iters=3, log_interval=3, tensorboard_dir=str(tmp_path)), rank=0)
    for iteration, value, ok in [(1, 1.25, True), (2, 1.5, True), (3, 9.0, False)]:
        log.iteration(Step(iteration, 3.0, 1e-3, ok, grad_norm=1.0, other_losses={"load_balancing_loss": value}))
    log.close()
    lines = [MEGATRON_LINE.match(line) for line in stream.getvalue().splitlines()]
    assert all(lines), stream.getvalue()
    assert [float(m["load_balancing"]) for m in lines] == [1.25, 1.5]  # iteration 1, then 2-3 (3 skipped)
    assert [r["load_balancing_loss"] for r in log.records] == [1.25, 1.5]
    assert _scalars(tmp_path)["load_balancing_loss"] == [(1, 1.25), (2, 1.5), (3, 9.0)]


def test_throughput_is_flops_over_interval_seconds_and_world_size(monkeypatch, tmp_path) -> None:
    """Megatron-LM's TFLOP/s/GPU: FLOPs per iteration / (interval seconds per iteration x 1e12 x
    world size), on the line (after the elapsed time), in TensorBoard (`throughput`, at every
    printed line) and in the JSONL records."""
    import json

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    metrics = tmp_path / "metrics.jsonl"
    log = Logger(_args(train_iters=4, log_interval=2, tensorboard_dir=str(tmp_path), metrics_jsonl=str(metrics)),
                 rank=0, flops_per_sample=6e12 / 8, world_size=2)
    sizes = [8, 8, 16, 16]  # a growing global batch (--rampup-batch-size): FLOPs follow the logged step's
    for iteration, size in enumerate(sizes, 1):
        log.iteration(Step(iteration, 3.0, 1e-3, True, grad_norm=1.0, batch_size=size))
    log.close()
    records = log.records
    # 6e12 FLOPs (a batch of 8) over 2 ranks in t s: 3 / t TFLOP/s each, t = elapsed_ms / 1000.
    assert [r["throughput"] for r in records] == pytest.approx(
        [3000 * size / 8 / r["elapsed_ms"] for r, size in zip(records, (8, 8, 16))], rel=1e-12)
    assert [r["consumed_samples"] for r in records] == [8, 16, 48]
    lines = [MEGATRON_LINE.match(line) for line in stream.getvalue().splitlines()]
    assert all(lines), stream.getvalue()
    assert [m["throughput"] for m in lines] == [f"{r['throughput']:.1f}" for r in records]
    assert [json.loads(line)["throughput"] for line in metrics.read_text().splitlines()] == [
        r["throughput"] for r in records]
    scalars = _scalars(tmp_path)["throughput"]
    assert [step for step, _ in scalars] == [1, 2, 4]
    assert [value for _, value in scalars] == pytest.approx([r["throughput"] for r in records], rel=1e-6)  # float32


def _args(**overrides) -> argparse.Namespace:
    values = dict(train_iters=6, global_batch_size=8, log_interval=3, metrics_jsonl=None, tensorboard_dir=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_interval_mean_and_counters_reset(monkeypatch) -> None:
    """lm loss is the mean over the interval's successful iterations (a skipped step's loss is
    not averaged; a non-finite one is a nan iteration); counters restart after each line."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    log = Logger(_args(), rank=0)
    steps = [(1, 4.0, True), (2, 3.0, True), (3, float("nan"), False), (4, 2.0, True), (5, 1.0, True),
             (6, 0.5, False)]
    for iteration, loss, ok in steps:
        log.iteration(Step(iteration, loss, 1e-3, ok, grad_norm=1.0))
    log.close()
    lines = [MEGATRON_LINE.match(line) for line in stream.getvalue().splitlines()]
    assert all(lines), stream.getvalue()
    got = [(int(m["iteration"]), int(m["consumed"]), float(m["loss"]), int(m["skipped"]), int(m["nan"]))
           for m in lines]
    # Iteration 1 is printed on its own (Megatron-LM logs the first iteration), then 2-3 and 4-6.
    assert got == [(1, 8, 4.0, 0, 0), (3, 24, 3.0, 1, 1), (6, 48, 1.5, 1, 0)]
    assert [r["loss"] for r in log.records] == [4.0, 3.0, 1.5]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream_type,rank,bar", [(_Terminal, 0, True), (io.StringIO, 0, False), (_Terminal, 1, False)],
                         ids=["terminal-rank0", "pipe-rank0", "terminal-rank1"])
def test_progress_bar_only_on_rank0_terminal(stream_type, rank: int, bar: bool, monkeypatch) -> None:
    """Iterations 1-4 logged every 2."""
    stream = stream_type()
    monkeypatch.setattr(sys, "stdout", stream)
    log = Logger(_args(train_iters=4, log_interval=2), rank)
    for iteration in range(1, 5):
        log.iteration(Step(iteration, 3.0, 1e-3, True, grad_norm=1.0))
    log.close()
    out = stream.getvalue()
    assert ("\r" in out) == bar, repr(out)
    assert out.count("elapsed time per iteration (ms)") == (0 if rank else 3), repr(out)  # iterations 1, 2, 4
    if bar:
        assert f"[{'#' * training_log.ProgressBar.WIDTH}] 4/4 | loss 3.0000" in out and out.endswith("\n")
        assert out.count("\r [") == 2, repr(out)  # the bar is wiped before each later log line


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_evaluations_write_megatron_lm_tags_and_metrics_records(tmp_path, monkeypatch) -> None:
    """What the eval loop calls: `lm loss validation` and its perplexity, exp(min(20, loss)), for
    validation only; every evaluation is a record of the metrics file, which read_metrics tells
    apart from the training records."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    metrics = tmp_path / "metrics.jsonl"
    log = Logger(_args(tensorboard_dir=str(tmp_path / "tb"), metrics_jsonl=str(metrics)), rank=0)
    log.iteration(Step(1, 4.0, 1e-3, True))
    log.evaluation(EvalResult("valid", 1, 2.5))
    log.evaluation(EvalResult("valid", 2, 25.0, final=True))
    log.evaluation(EvalResult("test", 2, 3.0, final=True))
    log.close()
    train, evaluations = read_metrics(str(metrics))
    assert [r["iteration"] for r in train] == [1] and train[0]["loss"] == 4.0
    assert [(r["split"], r["iteration"], r["final"], r["eval_loss"]) for r in evaluations] == [
        ("valid", 1, False, 2.5), ("valid", 2, True, 25.0), ("test", 2, True, 3.0)]
    assert evaluations[0]["eval_ppl"] == pytest.approx(math.exp(2.5))
    assert validation_curve(evaluations) == [(1, 2.5)]  # periodic validations only
    scalars = _scalars(tmp_path / "tb")
    assert scalars["lm loss validation"] == [(1, 2.5), (2, 25.0)]
    assert [step for step, _ in scalars["lm loss validation ppl"]] == [1, 2]
    ppl = [value for _, value in scalars["lm loss validation ppl"]]
    assert ppl == pytest.approx([math.exp(2.5), math.exp(20.0)], rel=1e-6)  # TensorBoard stores float32
    assert scalars["lm loss validation vs samples"] == [(8, 2.5), (8, 25.0)]


def test_tensorboard_options_follow_megatron_lm(tmp_path, monkeypatch) -> None:
    """--log-world-size-to-tensorboard adds `world-size`, --no-log-loss-scale-to-tensorboard drops
    `loss-scale`, --log-memory-to-tensorboard writes Megatron-LM's four torch.cuda.memory_stats()
    tags (on CUDA; the stats are stubbed here), --tensorboard-queue-size reaches the writer."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    stats = {"reserved_bytes.all.current": 4096, "allocated_bytes.all.current": 1024,
             "allocated_bytes.all.peak": 2048, "allocation.all.current": 7}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    args = _args(tensorboard_dir=str(tmp_path / "on"), tensorboard_queue_size=5, log_world_size_to_tensorboard=True,
                 log_loss_scale_to_tensorboard=False, log_memory_to_tensorboard=True)
    log = Logger(args, rank=0, world_size=4, on_cuda=True)
    assert log.tensorboard.writer.max_queue == 5
    log.iteration(Step(1, 4.0, 1e-3, True, loss_scale=2.0))
    log.close()
    scalars = _scalars(tmp_path / "on")
    assert scalars["world-size"] == [(1, 4.0)] and scalars["world-size vs samples"] == [(8, 4.0)]
    assert "loss-scale" not in scalars
    assert {tag: scalars[tag] for tag in ("mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
                                          "mem-allocated-count")} == {
        "mem-reserved-bytes": [(1, 4096.0)], "mem-allocated-bytes": [(1, 1024.0)],
        "mem-max-allocated-bytes": [(1, 2048.0)], "mem-allocated-count": [(1, 7.0)]}
    log = Logger(_args(tensorboard_dir=str(tmp_path / "off")), rank=0, world_size=4)  # Megatron-LM's defaults
    log.iteration(Step(1, 4.0, 1e-3, True, loss_scale=2.0))
    log.close()
    scalars = _scalars(tmp_path / "off")
    assert scalars["loss-scale"] == [(1, 2.0)] and "world-size" not in scalars and "mem-reserved-bytes" not in scalars


def test_tensorboard_options_that_cannot_write_say_so() -> None:
    flags = dict(log_world_size_to_tensorboard=True, log_memory_to_tensorboard=True, log_loss_scale_to_tensorboard=True)
    assert training_log.tensorboard_option_lines(_args(**flags), on_cuda=True) == [
        "--log-world-size-to-tensorboard: no effect without --tensorboard-dir",
        "--log-memory-to-tensorboard: no effect without --tensorboard-dir"]
    assert training_log.tensorboard_option_lines(_args(tensorboard_dir="tb", **flags), on_cuda=False) == [
        "--log-memory-to-tensorboard: no effect on CPU (it writes torch.cuda.memory_stats())"]
    assert training_log.tensorboard_option_lines(_args(tensorboard_dir="tb", **flags), on_cuda=True) == []


def test_validation_without_tensorboard_writes_nothing(monkeypatch, tmp_path) -> None:
    # The caller prints the validation line; without --tensorboard-dir the logger adds nothing:
    # no output, no file, no record.
    stdout = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.chdir(tmp_path)
    log = Logger(_args(), rank=0)
    log.evaluation(EvalResult("valid", 1, 2.5))
    log.close()
    assert log.tensorboard is None
    assert stdout.getvalue() == "" and list(tmp_path.iterdir()) == [] and log.records == []


def test_plot_is_a_png_of_the_size_with_the_curve(tmp_path) -> None:
    from PIL import Image

    path = tmp_path / "plot.png"
    training_log.plot_curves(str(path), [training_log.Curve("a", [1, 2, 3], [3.0, 2.0, 1.5], training_log.PALETTE[0])])
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == training_log.PLOT_SIZE
        colors = dict((color[:3], count) for count, color in image.convert("RGBA").getcolors(1 << 20))
    assert colors.get(training_log.PALETTE[0], 0) > 300, sorted(colors.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("tflops,text", [(123.46, "123.5"), (1.0, "1.0"), (0.5, "0.500"), (0.0412, "0.0412"),
                                         (0.00412345, "0.00412"), (0.0, "0.0"), (0.0009996, "0.00100"),
                                         (0.99996, "1.0")])
def test_throughput_keeps_three_significant_digits_below_one(tflops: float, text: str) -> None:
    assert training_log.throughput_text(tflops) == text


def _labelled_ticks(ys: list[float], path) -> list[str]:
    """The y tick labels plot_curves' log axis shows in view for a curve through `ys`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    captured = {}
    original_close = pyplot.close
    pyplot.close = lambda figure: captured.setdefault("figure", figure)
    try:
        training_log.plot_curves(str(path), [
            training_log.Curve("a", list(range(len(ys))), ys, training_log.PALETTE[0])])
    finally:
        pyplot.close = original_close
    figure = captured["figure"]
    axes = figure.axes[0]
    figure.canvas.draw()
    low, high = axes.get_ylim()
    labels = [t.get_text() for t in axes.yaxis.get_ticklabels(which="both")
              if t.get_text() and low <= t.get_position()[1] <= high]
    original_close(figure)
    return labels


def test_a_log_axis_within_one_decade_has_readable_ticks(tmp_path) -> None:
    labels = _labelled_ticks([4.17, 3.0, 2.2, 1.8, 1.56], tmp_path / "plot.png")
    values = [float(label) for label in labels]
    assert len(values) >= 4 and values == sorted(values), labels  # was ['2'] alone
    assert all(1.4 <= v <= 4.5 for v in values) and len(set(labels)) == len(labels), labels
    steps = {round(b - a, 6) for a, b in zip(values, values[1:])}
    assert len(steps) == 1, labels  # evenly spaced round values


def test_a_log_axis_over_decades_keeps_powers_of_ten(tmp_path) -> None:
    labels = _labelled_ticks([50.0, 5.0, 0.5], tmp_path / "plot.png")
    assert {"1", "10"} <= set(labels), labels
