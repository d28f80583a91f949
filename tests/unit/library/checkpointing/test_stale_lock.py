"""A dead holder's lock does not block the next run; a live holder's still refuses.

The holder (a child process here) takes the directory, forks a grandchild that keeps the lock
file open (as a forked worker would) and is SIGKILLed: the kernel keeps the flock, held by the
grandchild. The next owner takes the lock over, with one warning naming the dead holder, and a
third is refused, naming the new owner. While the holder lives it refuses, as before.
"""

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest

from megatron_eopt.checkpointing import CheckpointError
from megatron_eopt.checkpointing.directory_lock import DirectoryOwner

FORKING_HOLDER = textwrap.dedent("""
    import os, sys, time
    from megatron_eopt.checkpointing.directory_lock import DirectoryOwner
    DirectoryOwner(sys.argv[1]).acquire()
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
""")


def test_a_dead_holders_lock_is_taken_over_once(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(holder.stdout.readline())
        with pytest.raises(CheckpointError, match=f"pid {holder.pid} on host"):
            DirectoryOwner(str(tmp_path)).acquire()  # alive: refused
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            owner = DirectoryOwner(str(tmp_path)).acquire()
        lines = [str(w.message) for w in caught]
        assert len(lines) == 1 and f"took over the lock on {tmp_path}: its holder is dead (pid {holder.pid}" in lines[0]
        other = subprocess.run([sys.executable, "-c", "import sys; from megatron_eopt.checkpointing.directory_lock "
                                "import DirectoryOwner; DirectoryOwner(sys.argv[1]).acquire()", str(tmp_path)],
                               capture_output=True, text=True, timeout=120)
        assert other.returncode != 0 and f"pid {os.getpid()} on host" in other.stderr, other.stderr[-2000:]
        owner.release()
    finally:
        holder.kill()
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
