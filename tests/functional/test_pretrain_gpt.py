"""`scripts/pretrain_gpt.py` end to end on CPU: TP/DP layouts against one process, bad flags.

No stored losses: every layout is checked against the one-process run (TP=1, DP=1) of the same
command, launched in the same session. A tiny GPT (2 layers, hidden 32, 4 heads, 2 query groups,
ffn 64, SwiGLU, seq 16, global batch 16 of micro-batches of 2, 20 iterations, cosine lr 1e-2 ->
1e-3 after 2 warmup iterations) trains on the same global batches in every layout, so splitting
matmuls and the vocab-parallel softmax over TP ranks, the batch over DP ranks (with gradient
accumulation: 8, 4 or 2 micro-batches), or whole parameters over the layer-wise optimizer's
owners must leave the loss sequence unchanged up to the order of floating-point reductions.

Tolerance 1e-4 (absolute, on losses ~3-4): reduction order moves the losses by ~5e-7 over 20
iterations here, while a wrong TP slice, a wrong DP slice or gradient average, or a state the
optimizer loses moves them by >1e-3 within a few steps. The one-process run itself must learn
(its loss falls by > 0.5), so the layouts are not compared with a run that does nothing.

Layouts: each launch costs ~20 s of imports per process on 2 cores, so TP2 x DP2 with layer-wise
Muon runs here, against the one-process run; the other layouts (TP2 x DP2 Adam,
TP2 Muon, DP2 Muon without the distributed optimizer, pipelines, experts) run in the test
workers' processes (tests/unit/training/test_pretrain_gpt_in_process.py and the pipeline/MoE
tests). --bf16, --exit-interval, --plot and --tensorboard-dir are checked on one more run;
--data-path/--split/--tokenizer-type with evaluation on another (a corpus written by the test and
converted by tools/preprocess_data.py), which is also launched under torchrun at DP=2; the log line
and progress bar in-process (tests/unit/training/logging/test_training_log.py); flag errors
in-process and once under torchrun. TP2 x DP2 and the one-process runs (the reference, the flags
run, the data run) go through the script's `main` on workers of the shared distributed harness,
which has paid the imports once per session (tests/pretrain_gpt_in_process.py); torchrun launches
new processes for the DP=2 data run (and its warnings) and for a bad flag. Two torchrun "nodes" with
the TP group across them: tests/functional/test_golden_cases.py runs a TP=4 case through the
functional-test launcher as 2 nodes x 2 processes.
"""

import json
import math
import pathlib
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from megatron_eopt.training.curves import read_metrics
from megatron_eopt.training.logging.training_log import PALETTE, PLOT_SIZE
from tests.pretrain_gpt_in_process import run_pretrain_gpt_reporting
from tests.unit.training.logging.test_training_log import MEGATRON_LINE

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--swiglu", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "16", "--train-iters", "20", "--lr", "1e-2", "--min-lr", "1e-3",
    "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--log-interval", "1", "--seed", "1234",
    "--eval-iters", "0",  # no evaluation (the trainer's default: 100 + 100 batches at the end) unless a test asks
]
# Muon pinned to fp32 Newton-Schulz: the layouts are compared at fp32 round-off, and the default
# precision is chosen from the hardware.
FP32_NS = ["--muon-fp32-matmul-prec", "highest"]
OPTIMIZER_FLAGS = {
    "adam": ["--optimizer", "adam"],
    "muon": ["--optimizer", "muon", "--use-distributed-optimizer", *FP32_NS],  # layer-wise at DP > 1
    "muon-replicated": ["--optimizer", "muon", *FP32_NS],  # every DP rank steps every parameter
}
TORCHRUN = str(pathlib.Path(sys.executable).with_name("torchrun"))


def _command(nproc: int, optimizer: str, extra: list[str]) -> list[str]:
    if nproc == 1:
        launcher = [sys.executable, "scripts/pretrain_gpt.py"]
    else:
        launcher = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "scripts/pretrain_gpt.py"]
    return launcher + MODEL_FLAGS + OPTIMIZER_FLAGS[optimizer] + extra


def _launch(nproc: int, optimizer: str, metrics: pathlib.Path, extra: list[str] = (),
            run_distributed=None) -> tuple[list[dict], str]:
    """Train 20 logged iterations; returns the metrics records and rank 0's stdout. With
    `run_distributed`, the run goes through the script's `main` on `nproc` harness workers."""
    result = _start(nproc, optimizer, [*extra, "--metrics-jsonl", str(metrics)], run_distributed)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    log_lines = [line for line in result.stdout.splitlines() if MEGATRON_LINE.match(line)]
    assert len(log_lines) == 20, result.stdout
    return read_metrics(str(metrics))[0], result.stdout


def _start(nproc: int, optimizer: str, extra: list[str], run_distributed=None) -> subprocess.CompletedProcess:
    if run_distributed is None:
        return subprocess.run(_command(nproc, optimizer, extra), cwd=ROOT, capture_output=True, text=True, timeout=600)
    argv = MODEL_FLAGS + OPTIMIZER_FLAGS[optimizer] + extra
    results = run_distributed(run_pretrain_gpt_reporting, nproc, args=(argv,), timeout=600)
    failed = [result for result in results if result.returncode != 0]
    return failed[0] if failed else results[0]  # rank 0 prints the log, as under torchrun


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, run_distributed) -> dict[str, list[dict]]:
    """optimizer -> metrics of its TP=1/DP=1 run (in a harness worker), run once for the module."""
    runs: dict[str, list[dict]] = {}

    def records(optimizer: str) -> list[dict]:
        if optimizer not in runs:
            metrics = tmp_path_factory.mktemp(f"one_process_{optimizer}") / "metrics.jsonl"
            runs[optimizer] = _launch(1, optimizer, metrics, run_distributed=run_distributed)[0]
        return runs[optimizer]

    return records


def _assert_same_losses(layout: list[dict], reference: list[dict], what: str) -> None:
    losses, expected = _losses(layout), _losses(reference)
    assert len(losses) == len(expected) == 20
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst <= TOLERANCE, (
        f"{what}: max |loss - one-process loss| = {worst:.2e} > {TOLERANCE}: {losses} vs {expected}")


def test_one_process_run_learns(one_process) -> None:
    """The reference the launches below are compared with (Muon; Adam's one-process runs learn in
    the in-process tests, tests/unit/training/test_pretrain_gpt_in_process.py: one launch fewer here)."""
    records = one_process("muon")
    assert set(records[0]) == {"iteration", "consumed_samples", "global_batch_size", "loss", "lr", "grad_norm",
                               "loss_scale", "skipped", "nan", "elapsed_ms"}
    assert [r["consumed_samples"] for r in records] == [16 * i for i in range(1, 21)]
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert all(r["skipped"] == 0 and math.isfinite(r["loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(64)) < 0.3, records[0]  # untrained, over 64 tokens
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, _losses(records)


LAYOUTS = [  # (processes, TP, optimizer)
    (4, 2, "muon"),
]


@pytest.mark.parametrize(
    "nproc,tp,optimizer", [pytest.param(n, tp, opt, id=f"tp{tp}-dp{n // tp}-{opt}") for n, tp, opt in LAYOUTS])
def test_layout_matches_one_process(nproc: int, tp: int, optimizer: str, one_process, run_distributed,
                                    tmp_path: pathlib.Path) -> None:
    """On the harness's workers (the DP=2 data run launches torchrun)."""
    records, _ = _launch(nproc, optimizer, tmp_path / "metrics.jsonl", ["--tensor-model-parallel-size", str(tp)],
                         run_distributed)
    reference = one_process(optimizer.removesuffix("-replicated"))  # the same update, computed once per rank
    # The learning-rate schedule does not depend on the layout: the same lr at every iteration.
    assert [r["lr"] for r in records] == [r["lr"] for r in reference]
    _assert_same_losses(records, reference, f"TP{tp} x DP{nproc // tp} {optimizer}")


# --bf16, --exit-interval, --plot and --tensorboard-dir (with --log-params-norm and
# --log-num-zeros-in-grad) share one launch (each launch costs ~16 s of imports): 40 iterations
# asked for, an exit after 20, in bf16, on the generated task.
CURVE_PIXELS = 300  # a curve across the plot covers thousands; the legend swatch alone ~70


@dataclass(frozen=True)
class FlagsRun:
    records: list[dict]
    stdout: str
    plot: pathlib.Path
    tensorboard: pathlib.Path


@pytest.fixture(scope="module")
def flags_run(tmp_path_factory: pytest.TempPathFactory, run_distributed) -> FlagsRun:
    folder = tmp_path_factory.mktemp("flags")
    extra = ["--bf16", "--train-iters", "40", "--exit-interval", "20", "--plot", str(folder / "loss.png"),
             "--tensorboard-dir", str(folder / "tb"), "--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput"]
    records, stdout = _launch(1, "adam", folder / "metrics.jsonl", extra, run_distributed)
    return FlagsRun(records, stdout, folder / "loss.png", folder / "tb")


def test_bf16_runs_with_finite_losses(flags_run: FlagsRun) -> None:
    assert "parameters on rank 0, torch.bfloat16" in flags_run.stdout
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in flags_run.records)


def test_exit_interval_stops_at_that_iteration(flags_run: FlagsRun) -> None:
    assert [r["iteration"] for r in flags_run.records] == list(range(1, 21))
    assert "> exiting after iteration 20 (--exit-interval 20)" in flags_run.stdout
    assert " validation loss at " not in flags_run.stdout  # as Megatron-LM: no final evaluation then


# --data-path, --split, --tokenizer-type and evaluation share one launch: a corpus of sentences
# drawn from a small vocabulary of words (a distribution a byte-level model learns within a few
# dozen iterations), converted by tools/preprocess_data.py, split 90/8/2, trained 40 iterations
# with 2 validation batches every 10, then the final validation and test.
WORDS = "the a quick brown lazy fox dog cat jumps runs over under and sleeps".split()
# Megatron-LM's evaluate_and_print_results line: ' validation loss at {prefix} | ' + for each key
# '{key} value: {:.6E} | {key} PPL: {:.6E} | ', between rows of len(line) + 1 dashes.
VALIDATION_LINE = re.compile(
    r"^ validation loss at (?P<at>[^|]+) \| lm loss value: (?P<loss>\d\.\d{6}E[+-]\d\d) \| "
    r"lm loss PPL: (?P<ppl>\d\.\d{6}E[+-]\d\d) \| $")


@dataclass(frozen=True)
class DataRun:
    records: list[dict]
    validations: list[tuple[str, float, float]]  # (at, loss, ppl)
    stdout: str
    stderr: str
    folder: pathlib.Path
    prefix: str


@pytest.fixture(scope="module")
def data_run(tmp_path_factory: pytest.TempPathFactory, run_distributed) -> DataRun:
    import random

    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    documents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30))) + "." for _ in range(400)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    preprocess = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(folder / "docs.jsonl"), "--output-prefix",
         str(folder / "corpus"), "--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--workers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert preprocess.returncode == 0, preprocess.stderr[-3000:]
    prefix = str(folder / "corpus_text_document")
    assert f"wrote {prefix}.bin/.idx: 400 documents" in preprocess.stdout, preprocess.stdout
    return _data_launch(1, folder, prefix, run_distributed)


def _data_launch(nproc: int, folder: pathlib.Path, prefix: str, run_distributed=None) -> DataRun:
    extra = ["--data-path", prefix, "--split", "90,8,2", "--tokenizer-type", "ByteLevelTokenizer",
             "--data-cache-path", str(folder / "cache"), "--train-iters", "40", "--eval-interval", "10",
             "--eval-iters", "2"]
    metrics = folder / f"metrics_{nproc}.jsonl"
    extra += ["--tensorboard-dir", str(folder / f"tb_{nproc}")]
    result = _start(nproc, "adam", [*extra, "--metrics-jsonl", str(metrics)], run_distributed)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    validations = []
    for number, line in enumerate(lines):
        if line.startswith(" validation loss at "):
            match = VALIDATION_LINE.match(line)
            assert match, line
            assert lines[number - 1] == lines[number + 1] == "-" * (len(line) + 1), lines[number - 1:number + 2]
            validations.append((match["at"], float(match["loss"]), float(match["ppl"])))
    records, evaluations = read_metrics(str(metrics))
    # The metrics file has each printed evaluation, in order (the printed loss has 7 digits).
    assert [r["eval_loss"] for r in evaluations] == pytest.approx([loss for _, loss, _ in validations], rel=1e-6)
    return DataRun(records, validations, result.stdout, result.stderr, folder, prefix)


def test_data_path_trains_on_the_corpus(data_run: DataRun) -> None:
    losses = [r["loss"] for r in data_run.records]
    assert len(losses) == 40
    # Untrained: uniform over the model's vocabulary, ByteLevelTokenizer's 257 padded to 384.
    assert abs(losses[0] - math.log(384)) < 0.3, losses
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses


def test_validation_every_interval_then_final_validation_and_test(data_run: DataRun) -> None:
    ats = [at for at, _, _ in data_run.validations]
    assert ats == ["iteration 10", "iteration 20", "iteration 30", "iteration 40",
                   "iteration 40 on validation set", "iteration 40 on test set"], data_run.stdout
    for _, loss, ppl in data_run.validations:
        assert ppl == pytest.approx(math.exp(loss), rel=1e-5)  # both printed to 7 significant digits
    periodic = [loss for _, loss, _ in data_run.validations[:4]]
    assert periodic[-1] < periodic[0] - 0.5, periodic  # the held-out loss falls as training goes on
    # Held-out text from the training distribution: its loss is close to the training loss.
    final_train = sum(r["loss"] for r in data_run.records[-5:]) / 5
    assert abs(data_run.validations[4][1] - final_train) < 0.5, (data_run.validations, final_train)


def test_validation_losses_reach_tensorboard(data_run: DataRun) -> None:
    """`lm loss validation` (and its ppl) hold the printed validation losses, test excluded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(data_run.folder / "tb_1"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("lm loss validation")]
    printed = [loss for at, loss, _ in data_run.validations if not at.endswith("test set")]
    assert [step for step, _ in logged] == [10, 20, 30, 40, 40], logged
    assert [value for _, value in logged] == pytest.approx(printed, rel=1e-6)  # printed to 7 digits
    ppl = [e.value for e in events.Scalars("lm loss validation ppl")]
    assert ppl == pytest.approx([math.exp(loss) for loss in printed], rel=1e-5)


def test_plot_is_a_png_with_the_curve(flags_run: FlagsRun) -> None:
    from PIL import Image

    with Image.open(flags_run.plot) as image:
        assert image.format == "PNG" and image.size == PLOT_SIZE
        colors = {color[:3]: count for count, color in image.convert("RGBA").getcolors(1 << 20)}
    assert colors.get(PALETTE[0], 0) > CURVE_PIXELS, sorted(colors.items(), key=lambda kv: -kv[1])[:6]


TENSORBOARD_TAGS = ("lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size", "iteration-time",
                    "num-zeros", "params-norm", "throughput")


def test_tensorboard_holds_megatron_lm_scalars(flags_run: FlagsRun) -> None:
    """Read back with TensorBoard's own reader: every tag, finite, at the iterations run, and the
    loss / lr equal to the metrics file's (log interval 1, so the interval means are single values)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(flags_run.tensorboard))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert set(TENSORBOARD_TAGS) <= set(scalars), sorted(scalars)
    for tag in TENSORBOARD_TAGS:
        steps = [step for step, _ in scalars[tag]]
        assert steps == list(range(2 if tag == "iteration-time" else 1, 21)), (tag, steps)  # not the set-up one
        assert all(math.isfinite(value) for _, value in scalars[tag]), (tag, scalars[tag])
    records = flags_run.records
    assert [v for _, v in scalars["lm loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)  # float32
    assert [v for _, v in scalars["learning-rate"]] == pytest.approx([r["lr"] for r in records], rel=1e-6)
    assert {v for _, v in scalars["batch-size"]} == {16.0} and {v for _, v in scalars["loss-scale"]} == {1.0}
    assert all(v > 0 for _, v in scalars["params-norm"])
    assert [r["params_norm"] for r in records] == pytest.approx([v for _, v in scalars["params-norm"]], rel=1e-6)
    assert [r["throughput"] for r in records] == pytest.approx([v for _, v in scalars["throughput"]], rel=1e-6)


def test_bad_optimizer_name_exits_with_argparse_error() -> None:
    # --lr given: without it, "--lr is required" comes first (checked before torch; the installed
    # optimizers' names only after it).
    result = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", "--optimizer", "nope", "--lr", "1e-3"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: argument --optimizer")


MAX_POSITIONS_TOO_SMALL = ["--max-position-embeddings", "32", "--seq-length", "64", "--lr", "1e-3"]
MAX_POSITIONS_ERROR = "pretrain_gpt.py: error: --max-position-embeddings 32 must be >= --seq-length 64."


def _our_lines(stderr: str) -> list[str]:
    # torch may log a "No CUDA runtime" warning when emerging_optimizers loads.
    return [line for line in stderr.strip().splitlines() if "No CUDA runtime" not in line]


@pytest.mark.parametrize(
    "argv,world_size,message",
    [
        (["--fp16", "--optimizer", "muon", "--lr", "1e-3"], "1", "--fp16 is not supported with --optimizer muon"),
        (["--tensor-model-parallel-size", "3", "--lr", "1e-3"], "2", "--tensor-model-parallel-size 3 must divide"),
        (["--micro-batch-size", "3", "--global-batch-size", "8", "--lr", "1e-3"], "2", "--global-batch-size 8"),
        (["--hidden-size", "48", "--num-attention-heads", "3", "--group-query-attention", "--num-query-groups", "1",
          "--tensor-model-parallel-size", "2",
          "--lr", "1e-3"], "2", "--num-attention-heads 3 must be divisible by --tensor-model-parallel-size 2."),
        (MAX_POSITIONS_TOO_SMALL, "1", MAX_POSITIONS_ERROR),
        (["--hidden-size", "30", "--lr", "1e-3"], "1", "--hidden-size 30 must be divisible by --num-attention-heads 4."),
        ([], "1", "--lr is required"),
    ],
    ids=["fp16-muon", "tp3-on-2-ranks", "global-batch", "heads-tp", "max-positions", "hidden-heads", "no-lr"],
)
def test_bad_flags_exit_with_one_line(argv, world_size, message, monkeypatch, capsys) -> None:
    """Checked in-process (the checks run before any process group; a subprocess costs ~16 s)."""
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    lines = _our_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines


@pytest.mark.parametrize("argv", [["--optimizer", "nope"], MAX_POSITIONS_TOO_SMALL, ["--help"]],
                         ids=["argparse-error", "settings-error", "help"])
def test_other_ranks_exit_alike_in_silence(argv, monkeypatch, capsys) -> None:
    """Rank 1 of 2 exits with rank 0's status and prints nothing (rank 0 says it once), after
    waiting long enough for rank 0 to have said it."""
    from megatron_eopt.runtime import rank_exit as errors
    from megatron_eopt.training.arguments.parser import parse_args

    waits, exits = [], []

    def sleep(seconds: float) -> None:  # torchrun's SIGTERM arrives during the wait
        waits.append(seconds)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    monkeypatch.setattr(errors.time, "sleep", sleep)
    monkeypatch.setattr(errors.os, "_exit", exits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == (0 if argv == ["--help"] else 2)
    captured = capsys.readouterr()
    assert captured.out == "" and _our_lines(captured.err) == [], captured
    # A failing rank lets rank 0 print before torchrun stops the workers, and exits with rank 0's
    # status when stopped; SIGTERM's handler is as before afterwards.
    assert waits == ([] if argv == ["--help"] else [errors.OTHER_RANKS_WAIT_S])
    assert exits == ([] if argv == ["--help"] else [2]) and signal.getsignal(signal.SIGTERM) is handler


def test_bad_flag_under_torchrun_is_one_line_without_a_worker_traceback() -> None:
    """What a user sees. torchrun's launcher raises ChildFailedError whenever a worker exits
    non-zero, so its own traceback (frames in torch/distributed only) and failure summary follow;
    nothing else may: no line per rank, no traceback from a worker."""
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", "scripts/pretrain_gpt.py",
                             *MAX_POSITIONS_TOO_SMALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    stderr = result.stderr
    assert [line for line in stderr.splitlines() if "error: " in line] == [MAX_POSITIONS_ERROR], stderr
    assert stderr.count("Traceback (most recent call last)") <= 1, stderr
    frames = re.findall(r'File "([^"]+)"', stderr)
    assert all("torch/distributed/" in f or f.endswith("torchrun") for f in frames), frames
    # Rank 0 exits first, with our status; torchrun then stops the other. Had it reached the same
    # error (it waits there), it exits with rank 0's status (test_other_ranks_exit_alike_in_silence);
    # stopped while still importing, it dies of the SIGTERM (-15). Which one is timing: measured
    # under ATEN_CPU_CAPABILITY=default, rank 1 was still importing twice in two runs.
    assert re.search(r"Root Cause.*?rank\s*:\s*0 .*?exitcode\s*:\s*2\b", stderr, re.S), stderr
    exits = dict(re.findall(r"^\s*rank\s*:\s*(\d+) .*?^\s*exitcode\s*:\s*(-?\d+)", stderr, re.S | re.M))
    assert exits["0"] == "2" and exits.get("1", "2") in ("2", "-15"), stderr


@pytest.fixture(scope="module")
def dp2_data_run(data_run: DataRun) -> DataRun:
    """The data run on two ranks (torchrun, DP=2)."""
    return _data_launch(2, data_run.folder, data_run.prefix)


def test_data_parallel_ranks_read_their_rows_and_evaluate_together(data_run: DataRun, dp2_data_run: DataRun) -> None:
    """DP=2 (torchrun, each rank reading its half of every global batch and evaluating its half
    of every validation batch) against the one-process run: the same losses to 1e-4 (reduction
    order; seen: 1e-6) and the same validation values (printed to 7 digits: 1e-5 relative)."""
    dp2 = dp2_data_run
    losses, expected = _losses(dp2.records), _losses(data_run.records)
    assert len(losses) == len(expected) == 40
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= TOLERANCE, (losses, expected)
    assert [at for at, _, _ in dp2.validations] == [at for at, _, _ in data_run.validations]
    for (_, loss, _), (_, expected, _) in zip(dp2.validations, data_run.validations):
        assert loss == pytest.approx(expected, rel=1e-5, abs=1e-4), (dp2.validations, data_run.validations)


# Warnings print as one line each (training/logging/warning_policy.py); Python's own format
# ("file.py:12: UserWarning: ...", then the source line) must not appear.
WARNING_LINE = re.compile(r"^pretrain_gpt\.py: warning: (?P<text>.*) \((?P<category>\w*Warning)\)$")
PYTHON_WARNING_LINE = re.compile(r"^\S+\.py:\d+: \w*Warning: ")
# Warnings megatron-core prints about the calls we make (as of megatron-core 0.16): none may show.
WARNINGS_ABOUT_OUR_CALLS = ("full scope is deprecated", "is deprecated. Please use `torch.distributed.")


def test_two_ranks_print_each_third_party_warning_once_and_none_of_ours(dp2_data_run: DataRun) -> None:
    """A 2-rank run's output (both streams): each warning one line; only the known harmless
    third-party ones (so none from megatron_eopt, and none that megatron-core or torch raises
    about our calls), each at most once (rank 0's); torch's "No CUDA runtime" line at most once."""
    from megatron_eopt.training.logging.warning_policy import KNOWN_HARMLESS

    output = dp2_data_run.stdout + dp2_data_run.stderr
    assert not [line for line in output.splitlines() if PYTHON_WARNING_LINE.match(line)], output
    found = [match for match in map(WARNING_LINE.match, output.splitlines()) if match]
    unknown = [match[0] for match in found
               if not any(re.match(pattern, match["text"], re.I) for _, pattern, _ in KNOWN_HARMLESS)]
    assert unknown == [], output
    assert not [text for text in WARNINGS_ABOUT_OUR_CALLS if text in output], output
    texts = [(match["category"], match["text"]) for match in found]
    assert len(texts) == len(set(texts)), output
    assert output.count("No CUDA runtime is found") <= 1, output
