"""The trainer's saves at DP=2 (layer-wise Muon).

A full disk on one rank: both ranks agree that the save failed (neither believes it succeeded),
rank 0 prints one line, `latest` stays at the previous checkpoint, the partial directory goes.
Without --continue-on-save-failure every rank stops with status 2; with it training goes on and
the next save succeeds. With --async-save the checkpoints equal the synchronous run's, tensor by
tensor, and a background save that fails stops the run at the next save in the same way."""

import contextlib
import errno
import io
import os
import pathlib

import pytest
import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.pretrain_gpt_in_process import run_pretrain_gpt

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-2",
        "--log-interval", "1", "--save-interval", "2", "--seed", "1234", "--optimizer", "muon", "--use-distributed-optimizer",
        "--eval-iters", "0"]  # no evaluation: not checked here
FAILING_ITERATION = 4


def _run_with_full_disk_on_rank_1(rank: int, world_size: int, folder: str, flags: list[str],
                                  failing: int | None = FAILING_ITERATION) -> dict:
    """pretrain's main where rank 1's shard writes raise ENOSPC at the save of `failing` (None:
    none fails). The patches are undone before returning (the workers are reused)."""
    original_write = filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if rank == 1 and failing is not None and f"iter_{failing:07d}" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original_write(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            records = run_pretrain_gpt(rank, world_size, [*ARGV, "--save", folder, *flags])  # ranks exit together
        status = 0
    except SystemExit as exit_info:
        records, status = [], exit_info.code
    finally:
        filesystem.FileSystemWriter.write_data = original_write
    return {"status": status, "out": out.getvalue(), "err": err.getvalue(), "iterations": [r["iteration"] for r in records],
            "listing": sorted(os.listdir(folder)), "latest": pathlib.Path(folder, "latest").read_text()}


def _checkpoint(path: pathlib.Path, out: pathlib.Path) -> dict:
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def test_async_saves_equal_synchronous_ones(tmp_path, run_distributed) -> None:
    runs = {}
    for name, flags in (("sync", ["--save-interval", "2"]), ("async", ["--save-interval", "2", "--async-save"])):
        runs[name] = run_distributed(_run_with_full_disk_on_rank_1, 2, args=(str(tmp_path / name), flags, None))
        assert [r["status"] for r in runs[name]] == [0, 0], runs[name][0]["err"][-3000:]
    assert runs["async"][0]["listing"] == runs["sync"][0]["listing"]
    assert runs["async"][0]["out"].count("(in the background, --async-save)") == 2  # iterations 2 and 4
    for iteration in (2, 4, 6):
        name = f"iter_{iteration:07d}"
        expected = _checkpoint(tmp_path / "sync" / name, tmp_path / "sync.pt")
        actual = _checkpoint(tmp_path / "async" / name, tmp_path / "async.pt")
        assert set(expected) == set(actual)
        for key, value in expected.items():
            assert torch.equal(value, actual[key]) if torch.is_tensor(value) else value == actual[key], (name, key)


def test_a_failed_async_save_stops_the_run_at_the_next_save(tmp_path, run_distributed) -> None:
    failed = run_distributed(_run_with_full_disk_on_rank_1, 2, args=(str(tmp_path / "full"), ["--async-save"]))
    assert [r["status"] for r in failed] == [2, 2] and failed[0]["latest"] == "iter_0000002"
    assert [n for n in failed[0]["listing"] if not n.startswith(".save_lock")] == ["iter_0000002", "latest"]
    lines = [line for line in failed[0]["err"].splitlines() if "saving iter_0000004" in line]
    assert len(lines) == 1 and "rank 1: writing the shards: OSError: [Errno 28]" in lines[0], failed[0]["err"][-3000:]


def test_a_full_disk_on_one_rank_stops_every_rank_or_goes_on_with_the_flag(tmp_path, run_distributed) -> None:
    stopped = run_distributed(_run_with_full_disk_on_rank_1, 2, args=(str(tmp_path / "stop"), []))
    err = stopped[0]["err"]
    assert "saving iter_" not in stopped[1]["err"]  # rank 0 prints the line
    assert [r["status"] for r in stopped] == [2, 2]
    assert stopped[0]["latest"] == "iter_0000002"
    assert [n for n in stopped[0]["listing"] if not n.startswith(".save_lock")] == ["iter_0000002", "latest"]
    lines = [line for line in err.splitlines() if "saving iter_0000004" in line]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: saving iter_0000004 in ") and "failed: rank 1: writing the " \
        "shards: OSError: [Errno 28] No space left on device" in lines[0], lines[0]
    assert lines[0].endswith("'latest' still names iter_0000002, which loads as before. Training stops (the save "
                             "after iteration 4 failed; --continue-on-save-failure would go on training)."), lines[0]

    went_on = run_distributed(_run_with_full_disk_on_rank_1, 2, args=(str(tmp_path / "go"), ["--continue-on-save-failure"]))
    out = went_on[0]["out"]
    assert [r["status"] for r in went_on] == [0, 0] and went_on[0]["iterations"] == list(range(1, 7))
    assert went_on[0]["latest"] == "iter_0000006"
    assert [n for n in went_on[0]["listing"] if not n.startswith(".save_lock")] == ["iter_0000002", "iter_0000006", "latest"]
    warnings = [line for line in out.splitlines() if "saving iter_0000004" in line]
    assert len(warnings) == 1 and warnings[0].endswith("Training goes on (--continue-on-save-failure)."), out[-3000:]
