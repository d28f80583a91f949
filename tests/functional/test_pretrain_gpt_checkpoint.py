"""`pretrain_gpt.py --save/--load` end to end, in other processes than the saving run's (CPU, gloo).

One 20-iteration run (layer-wise Muon, DP=2) saves at iterations 10 and 20. Resuming it at 10
in new processes must reproduce iterations 11-20 exactly: the same losses, and a checkpoint at
20 equal to the straight run's key by key (parameters, optimizer state, scheduler, RNG; every
tensor bitwise). Loading the same checkpoint in one process without the distributed optimizer
(DP 2 -> 1, layer-wise -> replicated) continues with the same losses to 1e-4 (the gradient is
averaged in another order), and `--no-load-optim` lets AdamW start from Muon's model with a
fresh lr schedule from step 0 (Megatron-LM's semantics), which the run spells out.

A resume with a changed `--lr` is refused (exit 2, nothing trained) naming the value and the two
scheduler flags; with `--override-opt_param-scheduler` it follows the new schedule from the
checkpoint's step, and a directory without `latest` resumes from its newest checkpoint, saying
so. Expected learning rates come from the cosine formula written out here.

The resumed DP=2 run launches new processes under torchrun (`make test-slow`); the straight run and the one-process
runs that load its checkpoints run in workers of the shared distributed harness (imports paid
once per session, not ~20 s a launch).
"""

import math
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_eopt.training.curves import read_metrics
from tests.functional.test_pretrain_gpt import MODEL_FLAGS, ROOT, TOLERANCE
from tests.pretrain_gpt_in_process import run_pretrain_gpt_reporting

# fp32 Newton-Schulz (the default is chosen from the hardware): layouts are compared to 1e-4.
FP32_MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"]
MUON = FP32_MUON + ["--use-distributed-optimizer"]
# No evaluation: these tests check training and checkpoints, and the final validation and test
# would take most of each run.
RUN_FLAGS = MODEL_FLAGS  # no evaluation (--eval-iters 0 there)


def _launch(nproc: int, flags: list[str], metrics: pathlib.Path, run_distributed=None) -> subprocess.CompletedProcess:
    """`nproc` new processes under torchrun; with `run_distributed` (nproc 1), the run in a harness
    worker instead (still a new process's view of the checkpoint: nothing of the saving run is in it)."""
    if run_distributed is not None:
        assert nproc == 1, "a harness worker runs one process's job"
        argv = RUN_FLAGS + flags + ["--metrics-jsonl", str(metrics)]
        (result,) = run_distributed(run_pretrain_gpt_reporting, 1, args=(argv,), timeout=600)
        return result
    launcher = [str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={nproc}",
                "scripts/pretrain_gpt.py"]
    command = launcher + RUN_FLAGS + flags + ["--metrics-jsonl", str(metrics)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _run(nproc: int, flags: list[str], metrics: pathlib.Path, output: dict | None = None,
         run_distributed=None) -> list[dict]:
    result = _launch(nproc, flags, metrics, run_distributed)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    if output is not None:
        output["stdout"] = result.stdout
    return read_metrics(str(metrics))[0]


def _cosine_lr(steps_done: int, max_lr: float, min_lr: float = 1e-3, warmup: int = 2, decay: int = 20) -> float:
    """MODEL_FLAGS' schedule (--lr-warmup-iters 2, cosine over --train-iters 20) after `steps_done` iterations."""
    if steps_done <= warmup:
        return max_lr * steps_done / warmup
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * (steps_done - warmup) / (decay - warmup)) + 1)


def _checkpoint(path: pathlib.Path, tmp_path: pathlib.Path) -> dict:
    out = tmp_path / f"{path.parent.name}_{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory, run_distributed) -> tuple[pathlib.Path, list[dict]]:
    """The run every test loads from, on the harness's 2 workers (OMP_NUM_THREADS=1 and gloo, as
    under torchrun); the resume that must reproduce it runs in new processes."""
    tmp = tmp_path_factory.mktemp("straight")
    argv = RUN_FLAGS + MUON + ["--save", str(tmp / "ckpt"), "--save-interval", "10",
                                 "--metrics-jsonl", str(tmp / "metrics.jsonl")]
    for result in run_distributed(run_pretrain_gpt_reporting, 2, args=(argv,), timeout=600):
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return tmp / "ckpt", read_metrics(str(tmp / "metrics.jsonl"))[0]


def _losses(records: list[dict], first: int) -> list[float]:
    return [r["loss"] for r in records if r["iteration"] >= first]


# make test's resume of the trainer in new processes (~12 s; test_elastic_restart.py's torchrun restarts of the
# same layout, 53 s, are in `make test-slow`).
def test_resume_in_new_processes_is_exact(straight_run, tmp_path: pathlib.Path) -> None:
    saved, straight = straight_run
    resumed = _run(2, MUON + ["--load", str(saved), "--ckpt-step", "10", "--save", str(tmp_path / "ckpt")],
                   tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(11, 21))
    assert _losses(resumed, 11) == _losses(straight, 11)
    expected = _checkpoint(saved / "iter_0000020", tmp_path)
    actual = _checkpoint(tmp_path / "ckpt" / "iter_0000020", tmp_path)
    assert set(expected) == set(actual)
    assert sum(key.startswith("state/") for key in expected) > 20  # optimizer state is in it
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert value.dtype == actual[key].dtype and torch.equal(value, actual[key]), key
        else:
            assert value == actual[key], key


def test_resume_at_another_layout_and_model_only(straight_run, run_distributed, tmp_path: pathlib.Path) -> None:
    saved, straight = straight_run
    replicated = _run(1, [*FP32_MUON, "--load", str(saved), "--ckpt-step", "10"], tmp_path / "m1.jsonl",
                      run_distributed=run_distributed)
    worst = max(abs(a - b) for a, b in zip(_losses(replicated, 11), _losses(straight, 11)))
    assert len(replicated) == 10 and worst <= TOLERANCE, (worst, replicated)
    # AdamW from Muon's model: the first loss is the model's, the same as Muon's at iteration 11.
    output = {}
    adam = _run(1, ["--optimizer", "adam", "--load", str(saved), "--ckpt-step", "10", "--no-load-optim"],
                tmp_path / "m2.jsonl", output, run_distributed)
    assert adam[0]["iteration"] == 11
    assert abs(adam[0]["loss"] - _losses(straight, 11)[0]) <= TOLERANCE
    # Megatron-LM's --no-load-optim: iterations continue (11-20), the schedule restarts at step 0.
    lrs = {r["iteration"]: r["lr"] for r in adam}
    for iteration in (11, 12, 15, 20):
        assert math.isclose(lrs[iteration], _cosine_lr(iteration - 11, 1e-2), rel_tol=1e-12), (iteration, lrs)
    assert (f"--no-load-optim: fresh optimizer, lr schedule from step 0 at iteration 11 (lr 0.000000e+00) over "
            f"--lr-decay-iters 20 iterations; the last iteration, 20, runs at lr {_cosine_lr(9, 1e-2):.6e} "
            f"(--lr-decay-iters 10 fits the schedule to this run)") in output["stdout"]
    # Muon's checkpoint continued with AdamW (docs/checkpoints.md): refused naming the matrices that moved;
    # with --allow-optimizer-change-on-load their state starts fresh and AdamW's own parameters' loads.
    from_muon = ["--optimizer", "adam", "--load", str(saved), "--ckpt-step", "10", "--exit-interval", "11"]
    refused = _launch(1, from_muon, tmp_path / "m3.jsonl", run_distributed)
    assert refused.returncode == 2 and "--allow-optimizer-change-on-load" in refused.stderr, refused.stderr[-2000:]
    assert "decoder.layers.0.mlp.linear_fc1.weight (muon/dense (TensorParallelMuon) -> dense (AdamW))" in refused.stderr
    output = {}
    changed = _run(1, [*from_muon, "--allow-optimizer-change-on-load"], tmp_path / "m4.jsonl", output, run_distributed)
    assert [r["iteration"] for r in changed] == [11] and "their optimizer state starts fresh" in output["stdout"]
    assert abs(changed[0]["loss"] - _losses(straight, 11)[0]) <= TOLERANCE  # the loaded model's


def test_changed_schedule_is_refused_then_overridden_without_latest(straight_run, run_distributed,
                                                                   tmp_path: pathlib.Path) -> None:
    saved, straight = straight_run
    directory = tmp_path / "ckpt"  # iteration 10 only, no `latest`: a crash before the marker update
    shutil.copytree(saved / "iter_0000010", directory / "iter_0000010")
    refused = _launch(1, ["--optimizer", "muon", "--load", str(directory), "--lr", "2e-2"], tmp_path / "refused.jsonl",
                      run_distributed)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    for fragment in ("learning rate (max_lr): checkpoint 0.01, now 0.02", "Nothing was loaded",
                     "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        assert fragment in refused.stderr, refused.stderr[-2000:]
    assert "training from scratch" not in refused.stdout and " iteration " not in refused.stdout

    output = {}
    resumed = _run(1, ["--optimizer", "muon", "--load", str(directory), "--lr", "2e-2",
                       "--override-opt_param-scheduler"], tmp_path / "override.jsonl", output, run_distributed)
    assert [r["iteration"] for r in resumed] == list(range(11, 21))
    for record in resumed:  # the new peak lr, at the checkpoint's step count
        assert math.isclose(record["lr"], _cosine_lr(record["iteration"] - 1, 2e-2), rel_tol=1e-12), record
    assert f"{directory} has no 'latest' marker" in output["stdout"]
    assert "loading the newest complete checkpoint, iter_0000010" in output["stdout"]
    assert "RNG states not restored: saved at world size 2 with TP 1" in output["stdout"]
