"""Faults a worker sends itself, for the fault entries of our trainer (fault_entry.py) and of
Megatron-LM's loop (megatron_lm_fault_entry.py).

MEGATRON_EOPT_FAULTS is a JSON list of faults, each {"attempt": torchrun's restart count,
"rank": global rank, "iteration": N, "phase": P, "signal": "KILL", "STOP" or "TERM"}; the rank
sends itself the signal when attempt, rank, iteration and phase match (`fire`). Each fault and
each start prints one `fault_entry:` line with the time.
"""

import json
import os
import signal
import sys
import time

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
FAULTS = [f for f in json.loads(os.environ.get("MEGATRON_EOPT_FAULTS", "[]"))
          if f["attempt"] == ATTEMPT and f["rank"] == RANK]


def say(what: str) -> None:
    sys.stderr.write(f"fault_entry: attempt {ATTEMPT} rank {RANK} {what} at t={time.time():.3f}\n")
    sys.stderr.flush()


def fire(phase: str, iteration) -> None:
    """Send this rank the signal of each fault of this attempt and rank at `phase` of `iteration`."""
    for fault in FAULTS:
        if fault["phase"] == phase and fault["iteration"] == iteration:
            name = fault.get("signal", "KILL")
            say(f"SIG{name} in phase {phase} of iteration {iteration}")
            if name == "STOP":
                continue_when_terminated(os.getpid())
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


def continue_when_terminated(pid: int) -> None:
    """A stopped process holds torchrun's SIGTERM pending, and torchrun's restart waits a fixed 30 s
    (LocalElasticAgent._stop_workers ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before SIGKILL. A
    forked watcher sends SIGCONT once a SIGTERM is pending, so the stopped rank ends as torchrun asks.
    The stop itself lasts until then: the other ranks still meet a rank that does nothing."""
    if os.fork() != 0:
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun signals the worker's whole process group
    term = 1 << (signal.SIGTERM - 1)
    try:
        while True:
            with open(f"/proc/{pid}/status") as status:  # pending signals, per thread and shared
                pending = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
            if any(mask & term for mask in pending):
                os.kill(pid, signal.SIGCONT)
                break
            time.sleep(0.1)
    finally:
        os._exit(0)  # also when the stopped process is gone (its /proc entry with it)


def wrap(owner, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapped)
