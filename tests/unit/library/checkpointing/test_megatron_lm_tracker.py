"""Megatron-LM's tracker (`latest_checkpointed_iteration.txt`) beside our `latest`: the one written last
names the checkpoint a load without an iteration takes (Megatron-LM's functional-test runner rewrites the
tracker to resume a ckpt-resume case from half; docs/checkpoints.md)."""

import os
import pathlib

import pytest

from megatron_eopt.checkpointing import storage


def _touch_later(path: pathlib.Path, text: str, after: pathlib.Path) -> None:
    path.write_text(text)
    later = os.stat(after).st_mtime_ns + 1_000_000
    os.utime(path, ns=(later, later))


def test_the_pointer_written_last_names_the_checkpoint(tmp_path: pathlib.Path) -> None:
    for name in ("iter_0000010", "iter_0000020"):
        (tmp_path / name).mkdir()
    (tmp_path / storage.LATEST).write_text("iter_0000020")
    assert storage.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000020")
    tracker = tmp_path / storage.MEGATRON_LM_TRACKER
    _touch_later(tracker, "10\n", after=tmp_path / storage.LATEST)  # as run_ci_test.sh's `echo 10 >`
    assert storage.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000010")
    _touch_later(tmp_path / storage.LATEST, "iter_0000020", after=tracker)  # a later save of ours
    assert storage.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000020")


def test_a_tracker_alone_counts_and_one_without_a_number_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "iter_0000010").mkdir()
    tracker = tmp_path / storage.MEGATRON_LM_TRACKER
    tracker.write_text("10")
    assert storage.has_checkpoints(str(tmp_path))
    assert storage.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000010")
    tracker.write_text("release")
    with pytest.raises(storage.CheckpointError, match=r"holds 'release', not an iteration number"):
        storage.latest_checkpoint(str(tmp_path))
