"""A save that fails with an OS error (a full disk, a read-only directory) raises one
CheckpointSaveError on every rank and leaves the directory as it was: the partial directory is
removed, `latest` still names the previous checkpoint, which loads, and an earlier copy of the same
iteration stays. Failures are simulated at each phase: the shards, the manifest, the rename, the
`latest` marker; at DP=2 on one rank only (the other ranks must not believe the save succeeded)."""

import errno
import os

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import CheckpointSaveError, load_checkpoint, save_checkpoint, storage


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])


def _step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(32, 8)).square().mean().backward()
    optimizer.step()


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_at(monkeypatch, phase: str) -> None:
    """Make one phase of the next save raise ENOSPC (EROFS for the rename)."""
    if phase == "shards":
        monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", _full_disk)
    elif phase in ("manifest", "latest"):
        name = (storage.MANIFEST if phase == "manifest" else storage.LATEST) + ".tmp"
        fsync = os.fsync

        def full_disk_on_flush(fd: int) -> None:  # the temp file is written, not yet renamed
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
                _full_disk()
            fsync(fd)

        monkeypatch.setattr(storage.os, "fsync", full_disk_on_flush)
    elif phase == "rename":
        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        monkeypatch.setattr(storage, "_rename_into_place", read_only)


def _listing(directory) -> dict:
    return {name: sorted(os.listdir(directory / name)) if (directory / name).is_dir() else (directory / name).read_text()
            for name in sorted(os.listdir(directory)) if name != storage.SAVE_LOCK}


@pytest.mark.parametrize("phase", ["shards", "manifest", "rename", "latest"])
@pytest.mark.parametrize("same_iteration", [False, True])
def test_a_failed_save_leaves_the_directory_as_it_was(tmp_path, monkeypatch, phase: str, same_iteration: bool) -> None:
    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer)
    save_checkpoint(str(tmp_path), 3, model, optimizer)
    saved = [p.detach().clone() for p in model.parameters()]
    before = _listing(tmp_path)
    _step(model, optimizer)
    _fail_at(monkeypatch, phase)
    failing = 3 if same_iteration else 6  # saving iteration 3 again must keep the earlier copy
    with pytest.raises(CheckpointSaveError) as caught:
        save_checkpoint(str(tmp_path), failing, model, optimizer)
    message = str(caught.value)
    assert "\n" not in message
    reason = "Read-only file system" if phase == "rename" else "No space left on device"
    assert message.startswith(f"saving iter_{failing:07d} in {tmp_path} failed: rank 0: ") and reason in message, message
    assert message.endswith("The partial directory is removed; 'latest' still names iter_0000003, which loads as "
                            "before."), message
    assert _listing(tmp_path) == before
    monkeypatch.undo()
    model, optimizer = _model_and_optimizer(1)
    assert load_checkpoint(str(tmp_path), model, optimizer).iteration == 3
    for value, expected in zip(model.parameters(), saved):
        assert torch.equal(value, expected)


def test_an_unwritable_directory_fails_before_writing(tmp_path, monkeypatch) -> None:
    makedirs = os.makedirs

    def denied(path, *args, **kwargs):  # as for a non-root user under a read-only parent
        if str(path).startswith(str(tmp_path / "ckpt")):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        makedirs(path, *args, **kwargs)

    monkeypatch.setattr(storage.os, "makedirs", denied)
    model, optimizer = _model_and_optimizer(0)
    with pytest.raises(CheckpointSaveError, match="failed before writing anything: rank 0: PermissionError"):
        save_checkpoint(str(tmp_path / "ckpt"), 1, model, optimizer)
    assert not (tmp_path / "ckpt").exists()


def test_an_async_save_equals_a_synchronous_one_and_one_at_a_time(tmp_path, monkeypatch) -> None:
    """start_save_checkpoint copies the state before returning: steps taken while it writes do not
    reach the file. A second save into the same directory while one is in flight is refused."""
    import threading

    from megatron_eopt.checkpointing import start_save_checkpoint

    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer)
    save_checkpoint(str(tmp_path / "sync"), 1, model, optimizer)
    release, begin_save = threading.Event(), storage.begin_save

    def held_begin_save(*args, **kwargs):
        release.wait(timeout=60)
        return begin_save(*args, **kwargs)

    monkeypatch.setattr(storage, "begin_save", held_begin_save)
    pending = start_save_checkpoint(str(tmp_path / "async"), 1, model, optimizer)
    with pytest.raises(ValueError, match="still in flight \\(iteration 1\\); wait\\(\\) for it"):
        start_save_checkpoint(str(tmp_path / "async"), 2, model, optimizer)
    _step(model, optimizer)  # changes the live state while the save is held
    release.set()
    assert pending.wait() == str(tmp_path / "async" / "iter_0000001") and pending.done()
    monkeypatch.undo()
    for name in ("sync", "async"):
        model, optimizer = _model_and_optimizer(1)
        load_checkpoint(str(tmp_path / name), model, optimizer)
        _step(model, optimizer)  # the same step from the loaded state: equal only if the optimizer state is too
        if name == "sync":
            expected = [p.detach().clone() for p in model.parameters()]
    for value, reference in zip(model.parameters(), expected):
        assert torch.equal(value, reference)
