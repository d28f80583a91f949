"""Faults in Megatron-LM's own loop with ours installed (scripts/pretrain_gpt_megatron_lm.py), on
2 CPU ranks (gloo), under `torchrun --max-restarts` with `--save D --load D`.

Workers signal themselves (tests/functional/megatron_lm_fault_entry.py) at iterations and on ranks
drawn from a seeded RNG (FAULT_SEED, printed). Each restart meets in a store prefix of its own
(runtime/torchrun_store.py; without it the restarted ranks read the dead attempt's gloo keys and
fail or hang) and `--load`s the latest checkpoint. Every expectation comes from another run: the
same flags run without interruption in the harness's workers (tests/megatron_lm_in_process.py),
whose checkpoint at the same iteration must equal the faulted run's bitwise, every tensor
(parameters, optimizer state, RNG, scheduler, iteration), or megatron-core's own optimizer in the
same loop (`--megatron-core-optimizer`). `make test` runs one launch (a kill during a save, then
SIGTERM) and an inf loss under fp16; `make test-slow` the rest.
"""

import io
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import time

import numpy
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.functional.test_elastic_restart import TORCHRUN
from tests.functional.test_megatron_lm_loop import (BF16_MOMENTS, ITERATIONS, MEGATRON_CORE, MEGATRON_FSDP, MODEL, ROOT,
                                                    TORCH_FSDP2, _assert_equal_tensors, _column)
from tests.megatron_lm_faults_in_process import run_with_inf_loss
from tests.ports import free_port
from tests.megatron_lm_in_process import run_megatron_lm_many

TRAIN_ITERS, SAVE_INTERVAL = 8, 2
LONGER = ["--train-iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_INTERVAL)]  # after MODEL's ITERATIONS
SEED = int(os.environ.get("FAULT_SEED", "20251127"))
ENGINES = {  # the engine's flags with its checkpoint format; every engine trains in bf16
    "DDP distributed optimizer": ["--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--bf16"],
    "FSDP2": TORCH_FSDP2,
    "Megatron-FSDP": MEGATRON_FSDP + ["--clip-grad", "1e9"],  # megatron-core computes the norm only to clip
}
OPTIMIZERS = {"adam": ["--optimizer", "adam"], "muon": ["--optimizer", "muon"]}


def flags_of(engine: str, optimizer: str) -> list[str]:
    moments = BF16_MOMENTS if optimizer == "muon" and engine != "DDP distributed optimizer" else []
    return [*MODEL, *LONGER, *OPTIMIZERS[optimizer], *ENGINES[engine], *moments]


def launch(flags: list[str], directory: pathlib.Path, faults: list[dict] = (), restarts: int = 0,
           timeout: float = 900, load: bool = True, workers: int = 2) -> subprocess.CompletedProcess:
    """torchrun, `workers` workers of Megatron-LM's loop, --save `directory` (and --load it). The output
    goes to files: a SIGKILLed worker leaves megatron-core's spawned helpers behind (an async torch_dist
    save's result-queue manager, the persistent checkpoint worker), which would hold a pipe open; they
    are ended afterwards."""
    command = [TORCHRUN, "--nproc-per-node", str(workers), "--max-restarts", str(restarts), "--master-port", str(free_port()),
               "-m", "tests.functional.megatron_lm_fault_entry", *flags, "--save", str(directory),
               *(["--load", str(directory)] if load else [])]
    marker = f"{directory}/{time.time()}"
    env = {**os.environ, "MEGATRON_EOPT_FAULTS": json.dumps(list(faults)), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3",
           "MEGATRON_EOPT_FAULT_LAUNCH": marker}
    out, err = directory.with_suffix(".stdout"), directory.with_suffix(".stderr")
    try:
        with out.open("w") as stdout, err.open("w") as stderr:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, timeout=timeout)
    finally:
        end_processes_of(marker)
    return subprocess.CompletedProcess(command, done.returncode, out.read_text(), err.read_text())


def end_processes_of(marker: str) -> None:
    """SIGKILL the processes this launch left behind, found by the marker in their environment."""
    needle = f"MEGATRON_EOPT_FAULT_LAUNCH={marker}".encode()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass  # gone, or not ours to read


def report(result: subprocess.CompletedProcess) -> str:
    return result.stdout[-3000:] + result.stderr[-5000:]


LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


def printed_losses(text: str) -> dict[int, float]:
    """The losses Megatron-LM printed, by iteration."""
    return {int(i): float(loss) for i, loss in LOG_LINE.findall(text)}


def loaded_iterations(stdout: str) -> list[int]:
    return [int(n) for n in re.findall(r"successfully loaded checkpoint from \S+ .*? at iteration (\d+)", stdout)]


def saved_state(directory: pathlib.Path, iteration: int, scratch: pathlib.Path) -> dict:
    """Everything a checkpoint holds (megatron-core's DCP formats) but the run's arguments (they
    name the run's own directories) and the CPU generator's state: Megatron-LM builds its data
    iterators after a load, and the DataLoader draws its seed from the restored CPU generator, so
    a resumed run's CPU generator is one draw ahead (with megatron-core's optimizer too). Nothing
    in training draws from it afterwards: dropout draws from the "CUDA" generator, compared here."""
    out = scratch / f"{directory.name}_{iteration}.pt"
    dcp_to_torch_save(str(directory / f"iter_{iteration:07d}"), str(out))
    return _comparable(torch.load(out, weights_only=False))


# Left out wherever a format puts them (torch_dist: in common_state/...). Also Megatron-LM's FLOP
# counter: its fsdp_dtensor load never asks for it (generate_state_dict without it), so a resumed
# run counts from 0 there, with any optimizer; a logged number, not training state.
LEFT_OUT = {"args", "torch_rng_state", "num_floating_point_operations_so_far"}


def _comparable(value):
    """Streams as their bytes, numpy arrays (numpy's RNG state) as tensors, through dicts and lists;
    the entries of LEFT_OUT left out."""
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, numpy.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items() if key not in LEFT_OUT}
    if isinstance(value, (list, tuple)):
        return type(value)(_comparable(item) for item in value)
    return value


def assert_same_checkpoint(expected: pathlib.Path, actual: pathlib.Path, iteration: int, scratch: pathlib.Path) -> None:
    mine, reference = saved_state(actual, iteration, scratch), saved_state(expected, iteration, scratch)
    assert optimizer_state_tensors(reference) > 0, sorted(reference)  # the optimizer's state is there
    _assert_equal_tensors(mine, reference, f"iteration {iteration}")


def optimizer_state_tensors(value, path: str = "") -> int:
    """How many tensors lie under a path naming the optimizer (its state: `optimizer.state...`, the
    DistributedOptimizer's `optimizer.distributed...exp_avg`; every format nests it)."""
    if isinstance(value, dict):
        return sum(optimizer_state_tensors(item, f"{path}.{key}") for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(optimizer_state_tensors(item, path) for item in value)
    return int(torch.is_tensor(value) and "optimizer" in path)


def straight_runs(run_distributed, *command_lines: list[str]) -> list:
    """Each command line in the harness's 2 workers: per run, each rank's Run."""
    per_rank = run_distributed(run_megatron_lm_many, 2, args=(list(command_lines),), timeout=900)
    return [list(runs) for runs in zip(*per_rank)]


# ---------------------------------------------------------------- make test: one launch, several faults


def test_a_kill_in_a_save_and_sigterm_resume_exactly_and_an_inf_loss_skips_as_megatron_core(run_distributed,
                                                                                            tmp_path) -> None:
    """DDP with layer-wise Muon (bf16, torch_dist), one launch of two attempts: a drawn rank is
    SIGKILLed after writing its shards of the save at 4 (item 1: the restart loads 2, the
    incomplete 4 is never named by `latest`); in the next attempt a drawn rank gets SIGTERM
    with --exit-signal-handler as 6 starts (item 3: the loop saves at 6 and exits 0). Both
    checkpoints equal the uninterrupted run's at 6, and a --load of 6 continues to the
    uninterrupted run's 8, bitwise; the restarted attempt prints the uninterrupted run's losses
    as Megatron-LM prints them after a resume (to 1e-6: 7 printed digits). Then (item 4) an inf
    in one rank's loss at 3 under fp16: our Adam skips the step and halves the loss scale as
    megatron-core's Adam does, and no parameter or optimizer-state tensor changes in that step."""
    rng = random.Random(f"{SEED}/kill in a save, then SIGTERM")
    faults = [{"attempt": 0, "rank": rng.randrange(2), "iteration": 4, "phase": "write"},
              {"attempt": 1, "rank": rng.randrange(2), "iteration": 6, "phase": "step", "signal": "TERM"}]
    print(f"FAULT_SEED={SEED}: {faults}")
    flags = flags_of("DDP distributed optimizer", "muon")
    straight_dir, directory = tmp_path / "straight", tmp_path / "faulted"
    result = launch(flags + ["--exit-signal-handler"], directory, faults, restarts=1)
    assert result.returncode == 0, report(result)
    assert len(re.findall(r"fault_entry: attempt \d rank \d SIG(KILL|TERM)", result.stderr)) == 2, report(result)
    assert loaded_iterations(result.stdout) == [2], report(result)  # the save at 4 was cut: its predecessor
    assert "exiting program after receiving SIGTERM" in result.stdout, report(result)
    assert (directory / "latest_checkpointed_iteration.txt").read_text().strip() == "6"

    fp16 = [*MODEL, "--optimizer", "adam", "--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"]
    (straight, _), (resumed, _) = straight_runs(run_distributed, flags + ["--save", str(straight_dir)],
                                                flags + ["--save", str(directory), "--load", str(directory)])
    assert [r["iteration"] for r in resumed.records] == [7, 8]
    # What the restarted attempt printed, as Megatron-LM prints it: its first iteration as it is, the
    # second the mean of both (its averages are not reset after the first), then each as it is.
    losses = straight.losses()
    printed = printed_losses(result.stdout.split("successfully loaded checkpoint", 1)[1])
    assert printed == pytest.approx({3: losses[3], 4: (losses[3] + losses[4]) / 2, 5: losses[5], 6: losses[6]},
                                    rel=1e-6), (printed, losses)
    assert _column(resumed, "lm loss", [7, 8]) == _column(straight, "lm loss", [7, 8])
    for iteration in (6, 8):
        assert_same_checkpoint(straight_dir, directory, iteration, tmp_path)

    ours = run_distributed(run_with_inf_loss, 2, args=(fp16, 1, 3), timeout=600)
    theirs = run_distributed(run_with_inf_loss, 2, args=(fp16 + MEGATRON_CORE, 1, 3), timeout=600)
    assert_skipped_as_megatron_core(ours, theirs, 3)


def assert_skipped_as_megatron_core(ours: list, theirs: list, iteration: int) -> None:
    for rank, (mine, reference) in enumerate(zip(ours, theirs)):
        assert (mine.run.optimizer_package, reference.run.optimizer_package) == ("megatron_eopt", "megatron")
        every = range(1, ITERATIONS + 1)  # MODEL's
        skipped = _column(reference.run, "skipped", every)
        assert skipped == [int(i == iteration) for i in every], skipped  # megatron-core skips that one step
        assert _column(mine.run, "skipped", every) == skipped, rank
        scales = _column(reference.run, "loss scale", every)
        assert scales[iteration - 1] == scales[iteration - 2] / 2, scales  # and halves the scale (--hysteresis 1)
        assert _column(mine.run, "loss scale", every) == scales, rank
        # The scale itself is ours' state (halved, as checked above); the rest must not move.
        _assert_equal_tensors(without_scaler(mine.after), without_scaler(mine.before),
                              f"rank {rank}: ours across the skipped step")
        _assert_equal_tensors(reference.after, reference.before, f"rank {rank}: megatron-core's across it")


def without_scaler(state):
    """`state` without the loss scaler's own entry (ours keeps it in the optimizer's state_dict)."""
    if isinstance(state, dict):
        return {key: without_scaler(value) for key, value in state.items() if key != "grad_scaler"}
    return state


# ---------------------------------------------------------------- make test-slow


def draw_kills(rng: random.Random) -> list[dict]:
    """Three increasing iterations in 2..TRAIN_ITERS, one per attempt, each on a drawn rank; one
    (drawn) kill hits the save of a save iteration after the rank wrote its shards. Each attempt
    resumes before its kill, so each happens."""
    while True:
        iterations = sorted(rng.sample(range(2, TRAIN_ITERS + 1), 3))
        in_save = rng.randrange(3)
        if iterations[in_save] % SAVE_INTERVAL == 0:
            break
    return [{"attempt": a, "rank": rng.randrange(2), "iteration": i, "phase": "write" if a == in_save else "step"}
            for a, i in enumerate(iterations)]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
def test_three_kills_one_in_a_save_resume_exactly(engine: str, optimizer: str, run_distributed, tmp_path) -> None:
    """Item 1 on each engine with its format, Adam and Muon: three SIGKILLs under
    `torchrun --max-restarts 3`; the end equals the uninterrupted run bitwise."""
    rng = random.Random(f"{SEED}/{engine}/{optimizer}")
    kills = draw_kills(rng)
    print(f"FAULT_SEED={SEED} {engine}, {optimizer}: kills {kills}")
    flags = flags_of(engine, optimizer)
    result = launch(flags, tmp_path / "faulted", kills, restarts=len(kills))
    assert result.returncode == 0, report(result)
    assert len(re.findall(r"fault_entry: attempt \d rank \d SIGKILL", result.stderr)) == len(kills), report(result)
    expected = [newest_complete_save(kill) for kill in kills]  # each restart loads the newest complete save
    assert loaded_iterations(result.stdout) == [e for e in expected if e], (expected, report(result))
    straight_runs(run_distributed, flags + ["--save", str(tmp_path / "straight")])
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "faulted", TRAIN_ITERS, tmp_path)


def newest_complete_save(kill: dict) -> int:
    """The save a restart after `kill` loads: the last save interval before a step kill's
    iteration, or before a save kill's own save (0: none yet, the restart starts afresh)."""
    iteration = kill["iteration"] - (1 if kill["phase"] == "step" else SAVE_INTERVAL)
    return iteration - iteration % SAVE_INTERVAL


# engine: optimizer (megatron-core's own optimizer takes Adam only on FSDP2 and Megatron-FSDP).
NAN_CASES = {"DDP distributed optimizer": "muon", "FSDP2": "adam", "Megatron-FSDP": "adam"}


def nan_outcome(result: subprocess.CompletedProcess) -> list[str]:
    """What each rank said of its state, what megatron-core's checks logged, the workers' exit codes."""
    said = sorted(re.findall(r"fault_entry: attempt 0 rank (\d (state unchanged: .*?)) at t=", result.stderr))
    said = [statement for statement, _ in said]
    checks = re.findall(r"ERROR:megatron\.core\.rerun_state_machine:(.*)", result.stdout + result.stderr)
    return said + sorted(set(checks)) + sorted(set(re.findall(r"failed \((exitcode: -?\d+)\)", result.stderr)))


@pytest.mark.slow
@pytest.mark.parametrize("engine", NAN_CASES)
def test_a_nan_gradient_on_one_rank_ends_as_with_megatron_cores_optimizer(engine: str, tmp_path) -> None:
    """Item 4: iteration 3's gradient of the word embeddings is NaN on rank 1 (NaN checks on, as by
    default). Ours and megatron-core's optimizer in the same loop end alike (the messages of
    megatron-core's checks, the exit codes), and ours changes no parameter or optimizer-state tensor
    on any rank in that iteration. On DDP megatron-core's rerun state machine finds the NaN before
    the gradients are reduced, reruns the iteration, finds it again, saves and exits with status 16,
    and neither optimizer's state changes. On FSDP2 and Megatron-FSDP (measured 2026-11-27) no check
    of the loop finds it and the loop goes on: megatron-core's optimizer in bf16 (no loss scaler)
    steps with it, and NaN enters its state on every rank; ours skips the step (any inf or NaN in
    the gradients skips it, wrappers/base.py) and its state stays as it was."""
    fault = {"attempt": 0, "rank": 1, "iteration": 3, "phase": "nan gradient"}
    flags = flags_of(engine, NAN_CASES[engine])
    ours = launch(flags, tmp_path / "ours", [fault], load=False)  # megatron-core's fails on FSDP2 with --load
    theirs = launch(flags + MEGATRON_CORE, tmp_path / "theirs", [fault], load=False)
    mine, outcome = nan_outcome(ours), nan_outcome(theirs)
    print(f"{engine}: megatron-core's optimizer: exit {theirs.returncode}, {outcome}; ours: exit {ours.returncode}, "
          f"{mine}")
    stopped = engine == "DDP distributed optimizer"  # by megatron-core's checks; elsewhere its step takes the NaN
    said = [f"{rank} state unchanged: {stopped}, finite: {stopped}" for rank in (0, 1)]
    assert [s.split(";")[0] for s in outcome[:2]] == said, report(theirs)
    assert [s.split(";")[0] for s in mine[:2]] == [f"{rank} state unchanged: True, finite: True" for rank in (0, 1)]
    assert [s.split(";")[1] for s in mine[:2]] == [s.split(";")[1] for s in outcome[:2]], (mine, outcome)
    assert mine[2:] == outcome[2:], report(ours)  # the checks' messages, the exit codes
    assert ours.returncode == theirs.returncode


# megatron-core's own async strategy (Megatron-LM's default, "nvrx", needs nvidia-resiliency-ext).
ASYNC_SAVES = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
NON_PERSISTENT = ["--save-interval", "4", "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global"]
DEAD_WORKER = re.compile(r"^rank (\d): megatron-core's persistent checkpoint worker .* ended with exit code -9 before "
                         r"finishing its save; the save fails on every rank", re.MULTILINE)  # the line, not its echo


@pytest.mark.slow
def test_killed_checkpoint_workers_leave_the_previous_checkpoint_and_async_saves_resume_exactly(run_distributed,
                                                                                              tmp_path) -> None:
    """Item 2: DDP with layer-wise Muon (bf16, torch_dist), every save written by megatron-core's
    persistent checkpoint worker (--async-save --use-persistent-ckpt-worker): persistent saves at 4
    and 8, non-persistent ones (global) at each iteration between. A drawn rank's worker is SIGKILLed
    after writing its first file of the non-persistent save at 2 (attempt 0), then of the persistent
    save at 4 (attempt 1). Each time the dead worker's rank says so in one line, the save fails on
    every rank (megatron-core's CheckpointException) and the job restarts; the restarts load the
    newest complete checkpoints, 1 and 3 (non-persistent), never the cut ones. The end at 8 equals
    the uninterrupted run's (synchronous saves) bitwise."""
    rng = random.Random(f"{SEED}/killed checkpoint workers")
    faults = [{"attempt": a, "rank": rng.randrange(2), "iteration": i, "phase": "worker write"}
              for a, i in enumerate((2, 4))]
    print(f"FAULT_SEED={SEED}: {faults}")
    flags = flags_of("DDP distributed optimizer", "muon")
    result = launch(flags + ASYNC_SAVES + NON_PERSISTENT, tmp_path / "faulted", faults, restarts=2)
    assert result.returncode == 0, report(result)
    assert [int(rank) for rank in DEAD_WORKER.findall(result.stderr)] == [f["rank"] for f in faults], report(result)
    assert result.stderr.count("CheckpointException") >= 2, report(result)  # every rank failed each cut save
    assert loaded_iterations(result.stdout) == [1, 3], report(result)
    assert (tmp_path / "faulted" / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    straight_runs(run_distributed, flags + ["--save", str(tmp_path / "straight")])
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "faulted", TRAIN_ITERS, tmp_path)
