"""pretrain_gpt.py owns its --save directory from start-up until it exits (loop/save_directory.py).

While another process holds the directory, a 2-rank run is refused before training: exit status
2 on both ranks, one line on rank 0 naming the holder's pid. SIGKILLed, the holder frees the
directory; the next run holds the lock from its first iteration (before any save) and says that
its save of iteration 2 replaces the checkpoint an earlier run left there.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import torch

from tests.unit.library.checkpointing.test_directory_lock import _lock_is_free

ARGV = ["--optimizer", "adam", "--lr", "1e-3", "--train-iters", "2", "--save-interval", "2", "--log-interval", "1",
        "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "2", "--eval-iters", "0"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
HOLDER = textwrap.dedent("""
    import sys, time
    from megatron_eopt.checkpointing.directory_lock import DirectoryOwner
    DirectoryOwner(sys.argv[1]).acquire()
    print("holding", flush=True)
    time.sleep(600)
""")


def _run(rank: int, world_size: int, argv: list[str], save: str) -> tuple[object, str, str, list[bool]]:
    """(records or exit status, stdout, stderr, whether --save's lock was free at each step)."""
    import contextlib
    import io

    from megatron_eopt.training.loop import train as train_loop
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    original_step, free = train_loop.train_step, []

    def train_step(*args, **kwargs):
        free.append(_lock_is_free(save))
        return original_step(*args, **kwargs)

    train_loop.train_step = train_step
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result = run_pretrain_gpt(rank, world_size, argv)  # every rank exits at once on an error
            except SystemExit as exit_info:
                result = exit_info.code
    finally:
        train_loop.train_step = original_step
    return result, out.getvalue(), err.getvalue(), free


def _manifest(save: str) -> dict:
    with open(os.path.join(save, "iter_0000002", "megatron_eopt.json")) as f:
        return json.load(f)


def test_a_second_run_is_refused_until_the_holder_dies(run_distributed, tmp_path) -> None:
    from megatron_eopt import OptimizerConfig, get_megatron_optimizer
    from megatron_eopt.checkpointing import save_checkpoint

    save = str(tmp_path / "ckpt")
    model = torch.nn.Linear(2, 2)
    save_checkpoint(save, 2, model, get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model]), extra={"by": "earlier"})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, save], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "holding"
        refused = run_distributed(_run, 2, args=(ARGV + ["--save", save], save))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    (status0, _, err0, steps0), (status1, out1, err1, steps1) = refused
    assert status0 == status1 == 2 and steps0 == steps1 == []  # refused before training, on every rank
    lines = [line for line in err0.splitlines() if "pretrain_gpt.py" in line]
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt.py: error: --save {save}: another run owns"), err0
    assert f"pid {holder.pid} on host" in lines[0] and "command:" in lines[0], lines
    assert "pretrain_gpt.py" not in err1 + out1
    assert _manifest(save)["extra"] == {"by": "earlier"}  # untouched

    records, out, _, free = run_distributed(_run, 1, args=(ARGV + ["--save", save], save))[0]
    assert [r["iteration"] for r in records] == [1, 2]
    assert free == [False, False]  # held from start-up, before the first save
    assert f"> saving iteration 2 replaces {save}/iter_0000002, which an earlier run wrote" in out.splitlines(), out
    assert _manifest(save)["extra"] != {"by": "earlier"}
    assert _lock_is_free(save)  # released at the end of the run
