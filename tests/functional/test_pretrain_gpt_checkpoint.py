"""`pretrain_gpt.py --save/--load` end to end, in new processes each time (CPU, gloo).

One 20-iteration run (layer-wise Muon, DP=2) saves at iterations 10 and 20. Resuming it at 10
in new processes must reproduce iterations 11-20 exactly: the same losses, and a checkpoint at
20 equal to the straight run's key by key (parameters, optimizer state, scheduler, RNG; every
tensor bitwise). Loading the same checkpoint in one process without the distributed optimizer
(DP 2 -> 1, layer-wise -> replicated) continues with the same losses to 1e-4 (the gradient is
averaged in another order), and `--no-load-optim` lets AdamW start from Muon's model.
"""

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.functional.test_pretrain_gpt import MODEL_FLAGS, ROOT, TOLERANCE

# fp32 Newton-Schulz (the default is chosen from the hardware): layouts are compared to 1e-4.
FP32_MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"]
MUON = FP32_MUON + ["--use-distributed-optimizer"]


def _run(nproc: int, flags: list[str], metrics: pathlib.Path) -> list[dict]:
    launcher = [sys.executable, "scripts/pretrain_gpt.py"] if nproc == 1 else [
        str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={nproc}",
        "scripts/pretrain_gpt.py"]
    command = launcher + MODEL_FLAGS + flags + ["--metrics-jsonl", str(metrics)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _checkpoint(path: pathlib.Path, tmp_path: pathlib.Path) -> dict:
    out = tmp_path / f"{path.parent.name}_{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("straight")
    records = _run(2, MUON + ["--save", str(tmp / "ckpt"), "--save-interval", "10"], tmp / "metrics.jsonl")
    return tmp / "ckpt", records


def _losses(records: list[dict], first: int) -> list[float]:
    return [r["loss"] for r in records if r["iteration"] >= first]


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


def test_resume_at_another_layout_and_model_only(straight_run, tmp_path: pathlib.Path) -> None:
    saved, straight = straight_run
    replicated = _run(1, [*FP32_MUON, "--load", str(saved), "--ckpt-step", "10"], tmp_path / "m1.jsonl")
    worst = max(abs(a - b) for a, b in zip(_losses(replicated, 11), _losses(straight, 11)))
    assert len(replicated) == 10 and worst <= TOLERANCE, (worst, replicated)
    # AdamW from Muon's model: the first loss is the model's, the same as Muon's at iteration 11.
    adam = _run(1, ["--optimizer", "adam", "--load", str(saved), "--ckpt-step", "10", "--no-load-optim"],
                tmp_path / "m2.jsonl")
    assert adam[0]["iteration"] == 11
    assert abs(adam[0]["loss"] - _losses(straight, 11)[0]) <= TOLERANCE
