"""A run owns its checkpoint directory from start-up until it exits (checkpointing/directory_lock.py).

Another process that holds the directory (a child process here) refuses this one's saves and
claims, naming its pid; SIGKILLed, it leaves the directory free for the next run. Between two of
the owner's saves the lock stays held (checked with a plain `fcntl.flock` on another open file,
which conflicts as another process's would), this process's own saves go through, and a save
that replaces a checkpoint the directory held before is reported once.
"""

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron_eopt.checkpointing.directory_lock import DirectoryOwner

HOLDER = textwrap.dedent("""
    import sys, time
    from megatron_eopt.checkpointing.directory_lock import DirectoryOwner
    DirectoryOwner(sys.argv[1]).acquire()
    print("holding", flush=True)
    time.sleep(600)
""")


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])


def _lock_is_free(directory) -> bool:
    with open(os.path.join(directory, ".save_lock"), "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def test_a_killed_holder_refuses_while_alive_and_frees_the_directory(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
                                  os.path.dirname(os.path.abspath(__file__)))))))
    try:
        assert holder.stdout.readline().strip() == "holding"
        model, optimizer = _model_and_optimizer(0)
        with pytest.raises(CheckpointError) as refused_save:
            save_checkpoint(str(tmp_path), 2, model, optimizer)
        with pytest.raises(CheckpointError) as refused_claim:
            DirectoryOwner(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    for refused in (refused_save, refused_claim):
        message = str(refused.value)
        assert f"pid {holder.pid} on host" in message and "command:" in message and "since" in message, message
        assert "\n" not in message
    assert "another run owns the checkpoint directory" in str(refused_claim.value)
    assert os.listdir(tmp_path) == [".save_lock"]  # the refused save touched nothing
    with DirectoryOwner(str(tmp_path)):  # the kernel released the dead holder's lock
        save_checkpoint(str(tmp_path), 2, model, optimizer)
    assert load_checkpoint(str(tmp_path), *_model_and_optimizer(1)).iteration == 2


def test_the_owner_holds_the_lock_between_its_saves_and_reports_replacements(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    save_checkpoint(str(tmp_path), 2, model, optimizer)  # an earlier run's, without an owner
    assert _lock_is_free(tmp_path)
    said = []
    with DirectoryOwner(str(tmp_path), on_replace=said.append):
        assert not _lock_is_free(tmp_path)
        save_checkpoint(str(tmp_path), 1, model, optimizer)
        assert not _lock_is_free(tmp_path) and said == []  # held between saves; iteration 1 was new
        save_checkpoint(str(tmp_path), 2, model, optimizer)
        save_checkpoint(str(tmp_path), 2, model, optimizer)  # this run's own now: said once
        assert not _lock_is_free(tmp_path)
        with pytest.raises(CheckpointError, match="owned by this process already"):
            DirectoryOwner(str(tmp_path)).acquire()
    assert said == [f"saving iteration 2 replaces {tmp_path / 'iter_0000002'}, which an earlier run wrote"]
    assert _lock_is_free(tmp_path)
    save_checkpoint(str(tmp_path), 3, model, optimizer)  # direct callers lock per save again
    assert _lock_is_free(tmp_path)


def test_replacing_without_a_callback_warns(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    save_checkpoint(str(tmp_path), 4, model, optimizer)
    with DirectoryOwner(str(tmp_path)), pytest.warns(UserWarning, match="saving iteration 4 replaces .*iter_0000004"):
        save_checkpoint(str(tmp_path), 4, model, optimizer)
