"""Runs that survive faults, under `torchrun --max-restarts` with `--save D --load D`.

A worker SIGKILLs itself (tests/functional/fault_entry.py) at iterations and on ranks drawn
from a seeded RNG (the seed is printed), once on each of three attempts; torchrun restarts the
job each time and it resumes from its newest verified checkpoint. Its final checkpoint must
equal an uninterrupted run's tensor by tensor (parameters, optimizer state, scheduler, RNG, data
position), for layer-wise Muon at DP=2, TP=2, PP=2 and FSDP2. Kills during a save, at each of
its phases, on rank 0 and on rank 1, must leave the previous or the new checkpoint, never a
partial one, and so must kills during an --async-save save (written while iterations go on). A
stopped rank (SIGSTOP) makes the others fail in one line within
--distributed-timeout-minutes, and torchrun restarts the job. All of it is `make test-slow` (the
stop and one kill in one launch took 53 s of make test's budget): `make test` covers a torchrun
restart that resumes exactly in Megatron-LM's loop (test_megatron_lm_faults.py) and the bounded
wait that ends a stopped peer's collective in one line (tests/unit/library/ops/test_bounded_wait.py).
"""

import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.functional.test_pretrain_gpt import ROOT
from tests.ports import free_port
from tests.pretrain_gpt_in_process import run_pretrain_gpt_reporting

TORCHRUN = str(pathlib.Path(sys.executable).with_name("torchrun"))
TRAIN_ITERS, SAVE_INTERVAL = 12, 3
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-2",
         "--min-lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--log-interval", "1",
         "--seed", "1234", "--save-interval", str(SAVE_INTERVAL), "--eval-iters", "0"]  # no evaluation: not checked
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"]
LAYOUTS = {
    "DP2 layer-wise Muon": MUON + ["--use-distributed-optimizer"],
    "TP2": MUON + ["--tensor-model-parallel-size", "2"],
    "PP2": MUON + ["--pipeline-model-parallel-size", "2"],
    "FSDP2": ["--optimizer", "adam", "--use-torch-fsdp2"],
}
SEED = int(os.environ.get("FAULT_SEED", "20251124"))


def launch(flags: list[str], directory: pathlib.Path, faults: list[dict] = (), restarts: int = 0,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """torchrun, 2 workers, --save and --load both `directory` (the run owns it)."""
    command = [TORCHRUN, "--nproc-per-node", "2", "--max-restarts", str(restarts), "--master-port",
               str(free_port()), "-m", "tests.functional.fault_entry", *MODEL, *flags,
               "--save", str(directory), "--load", str(directory)]
    # A stopped (SIGSTOP) worker ignores torchrun's SIGTERM: SIGKILL after 3 s, not torchrun's 30.
    env = {**os.environ, "MEGATRON_EOPT_FAULTS": json.dumps(list(faults)), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def checkpoint(path: pathlib.Path, out: pathlib.Path) -> dict:
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def assert_same_checkpoint(expected_dir: pathlib.Path, actual_dir: pathlib.Path, tmp: pathlib.Path) -> None:
    name = f"iter_{TRAIN_ITERS:07d}"
    assert (actual_dir / "latest").read_text().strip() == name
    expected = checkpoint(expected_dir / name, tmp / "expected.pt")
    actual = checkpoint(actual_dir / name, tmp / "actual.pt")
    assert set(expected) == set(actual)
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert value.dtype == actual[key].dtype and torch.equal(value, actual[key]), key
        else:
            assert value == actual[key], key
    manifests = [json.loads((d / name / "megatron_eopt.json").read_text())["extra"] for d in (expected_dir, actual_dir)]
    assert manifests[0] == manifests[1]  # consumed samples: the data position


def fault_times(stderr: str) -> dict:
    """Seconds from each fault to the next attempt's first start line (restart time)."""
    events = re.findall(r"fault_entry: attempt (\d+) rank \d+ (.*?) at t=([\d.]+)", stderr)
    faults = {int(a): float(t) for a, what, t in events if what.startswith("SIG")}
    starts = {}
    for a, what, t in events:
        if what == "starts":
            starts[int(a)] = min(starts.get(int(a), float("inf")), float(t))
    return {a: round(starts[a + 1] - t, 1) for a, t in faults.items() if a + 1 in starts}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, run_distributed):
    """The uninterrupted run of a layout: the reference, so it runs on the harness's 2 workers
    (OMP_NUM_THREADS=1 and gloo as under torchrun) instead of paying a launch's imports."""
    runs = {}

    def run(layout: str) -> pathlib.Path:
        if layout not in runs:
            directory = tmp_path_factory.mktemp("straight") / "ckpt"
            argv = [*MODEL, *LAYOUTS[layout], "--save", str(directory), "--load", str(directory)]
            for result in run_distributed(run_pretrain_gpt_reporting, 2, args=(argv,), timeout=600):
                assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
            runs[layout] = directory
        return runs[layout]

    return run


def draw_kills(rng: random.Random, count: int = 3, first_iteration: int = 2) -> list[dict]:
    """`count` increasing iterations in first_iteration..TRAIN_ITERS, one per attempt, each on a
    drawn rank: every attempt resumes before its kill, so each kill happens."""
    iterations = sorted(rng.sample(range(first_iteration, TRAIN_ITERS + 1), count))
    return [{"attempt": a, "rank": rng.randrange(2), "iteration": i, "phase": "step"} for a, i in enumerate(iterations)]


# Each layout takes some minutes of restarts on two cores: `make test-slow`. The layer-wise DP=2 layout has
# one kill in `make test` too, in one launch with a stopped rank (the last test here).
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_three_kills_resume_exactly(layout: str, straight, tmp_path: pathlib.Path) -> None:
    rng = random.Random(f"{SEED}/{layout}")
    kills = draw_kills(rng)
    print(f"FAULT_SEED={SEED} {layout}: kills {kills}")
    result = launch(LAYOUTS[layout], tmp_path / "ckpt", kills, restarts=len(kills))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stderr.count("fault_entry: attempt") >= 2 * (len(kills) + 1), result.stderr[-3000:]
    assert len(re.findall(r"SIGKILL in phase step", result.stderr)) == len(kills)
    print(f"{layout}: seconds from kill to restart {fault_times(result.stderr)}")
    assert_same_checkpoint(straight(layout), tmp_path / "ckpt", tmp_path)


SAVE_FAULTS = [  # (phase, rank, save iteration), one per attempt: each resumes before the next save killed
    ("write", 0, 6), ("write", 1, 6), ("rename", 0, 6), ("rename", 1, 9), ("latest", 0, 9), ("latest", 1, 12)]


@pytest.mark.slow
def test_kills_during_saves_leave_the_previous_or_the_new_checkpoint(straight, tmp_path: pathlib.Path) -> None:
    layout = "DP2 layer-wise Muon"
    faults = [{"attempt": a, "rank": r, "iteration": i, "phase": p} for a, (p, r, i) in enumerate(SAVE_FAULTS)]
    result = launch(LAYOUTS[layout], tmp_path / "ckpt", faults, restarts=len(faults))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    loaded = [int(n) for n in re.findall(r"loaded checkpoint \S*iter_(\d+)", result.stdout)]
    assert len(loaded) == len(faults), (loaded, result.stdout[-3000:])
    for (phase, _, iteration), resumed_at in zip(SAVE_FAULTS, loaded):
        assert resumed_at in (iteration - SAVE_INTERVAL, iteration), (phase, iteration, loaded)
    print(f"save faults {SAVE_FAULTS}: resumed at {loaded}; seconds from kill to restart {fault_times(result.stderr)}")
    assert not list((tmp_path / "ckpt").glob(".*.incomplete"))
    assert_same_checkpoint(straight(layout), tmp_path / "ckpt", tmp_path)


ASYNC_SAVE_FAULTS = [("write", 1, 6), ("latest", 0, 9)]  # in the background thread, iterations running meanwhile


@pytest.mark.slow
def test_kills_during_async_saves_leave_the_previous_or_the_new_checkpoint(straight, tmp_path: pathlib.Path) -> None:
    layout = "DP2 layer-wise Muon"
    faults = [{"attempt": a, "rank": r, "iteration": i, "phase": p} for a, (p, r, i) in enumerate(ASYNC_SAVE_FAULTS)]
    result = launch(LAYOUTS[layout] + ["--async-save"], tmp_path / "ckpt", faults, restarts=len(faults))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert len(re.findall(r"SIGKILL in phase \w+ of iteration", result.stderr)) == len(faults), result.stderr[-3000:]
    loaded = [int(n) for n in re.findall(r"loaded checkpoint \S*iter_(\d+)", result.stdout)]
    assert len(loaded) == len(faults), (loaded, result.stdout[-3000:])
    for (phase, _, iteration), resumed_at in zip(ASYNC_SAVE_FAULTS, loaded):
        assert resumed_at in (iteration - SAVE_INTERVAL, iteration), (phase, iteration, loaded)
    print(f"async save faults {ASYNC_SAVE_FAULTS}: resumed at {loaded}; seconds from kill to restart "
          f"{fault_times(result.stderr)}")
    assert "(in the background, --async-save)" in result.stdout
    assert not list((tmp_path / "ckpt").glob(".*.incomplete"))
    assert_same_checkpoint(straight(layout), tmp_path / "ckpt", tmp_path)


STOP_TIMEOUT_MINUTES = 0.25  # short, so the test is quick; long enough for a loaded machine's start-up
STOP = {"attempt": 0, "rank": 1, "iteration": 5, "phase": "step", "signal": "STOP"}


@pytest.mark.slow
def test_a_stopped_rank_ends_the_others_in_one_line_and_the_job_restarts(straight, tmp_path: pathlib.Path) -> None:
    """One launch, three attempts: rank 1 stops (SIGSTOP) in the first; a drawn rank is killed in the
    second, at a later iteration, so it happens; the third ends equal to the uninterrupted run."""
    layout = "DP2 layer-wise Muon"
    rng = random.Random(f"{SEED}/{layout}/after a stop")
    kills = [{**kill, "attempt": kill["attempt"] + 1}
             for kill in draw_kills(rng, count=1, first_iteration=STOP["iteration"] + 1)]
    print(f"FAULT_SEED={SEED} {layout}: stop {STOP}, kills {kills}")
    flags = LAYOUTS[layout] + ["--distributed-timeout-minutes", str(STOP_TIMEOUT_MINUTES)]
    result = launch(flags, tmp_path / "ckpt", [STOP, *kills], restarts=1 + len(kills))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    # The stop: rank 0 fails in one line that names the collective and the timeout.
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("pretrain_gpt.py: error: rank 0:") and "did not complete within" in line]
    assert len(lines) == 1, result.stderr[-4000:]
    assert re.search(r"torch.distributed \w+ (called from \w+ \(megatron|of )", lines[0]), lines[0]
    assert f"--distributed-timeout-minutes {STOP_TIMEOUT_MINUTES:g}" in lines[0], lines[0]
    events = dict(re.findall(r"fault_entry: attempt 0 rank \d (SIGSTOP|fails).*? at t=([\d.]+)", result.stderr))
    detected = float(events["fails"]) - float(events["SIGSTOP"])
    print(f"{lines[0]}\nstop detected after {detected:.1f} s (timeout {STOP_TIMEOUT_MINUTES * 60:g} s)")
    assert detected < STOP_TIMEOUT_MINUTES * 60 + 20

    # The kills: each restarts the job, which resumes; the end equals the uninterrupted run's.
    assert len(re.findall(r"SIGKILL in phase step", result.stderr)) == len(kills), result.stderr[-3000:]
    assert result.stderr.count("fault_entry: attempt") >= 2 * (len(kills) + 2), result.stderr[-3000:]
    print(f"seconds from each fault to the restart {fault_times(result.stderr)}")
    assert_same_checkpoint(straight(layout), tmp_path / "ckpt", tmp_path)
