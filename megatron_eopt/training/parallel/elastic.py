"""Restarts under `torchrun --max-restarts` and collectives that fail in one line instead of hanging.

torchrun's agent keeps one TCPStore for the whole job (static and c10d rendezvous alike), so the
keys gloo's rendezvous wrote on an earlier attempt are still there on the next: the trainer's
`init_distributed` meets in runtime/torchrun_store.py's `restart_store` (a key space per attempt)
and bounds the wait by --distributed-timeout-minutes.
`collective_failures` turns a collective that failed (a peer killed) or timed out (a peer stopped)
into one line naming the operation and where it was called, then exits non-zero at once (no
clean-up that could wait on the dead peer), so torchrun can restart the job from its checkpoint.
"""

import contextlib
import os
import sys
import traceback
from typing import Iterator

import torch.distributed as dist

from megatron_eopt.ops.collectives import CollectiveTimeout
from megatron_eopt.training.errors import PROG

EXIT_STATUS = 1  # a worker failure for torchrun: it restarts the job while restarts are left


def fail(rank: int, message: str) -> None:
    """One line on this rank's stderr, then exit at once with EXIT_STATUS (no clean-up)."""
    sys.stdout.flush()
    sys.stderr.write(f"{PROG}: error: rank {rank}: {' '.join(message.split())}\n")
    sys.stderr.flush()
    os._exit(EXIT_STATUS)


def describe_failure(error: BaseException) -> str:
    """`torch.distributed.<op>` called from <function> (<file>:<line>), from the traceback: the
    innermost torch.distributed function and the innermost megatron_eopt/megatron frame above it."""
    frames = traceback.extract_tb(error.__traceback__)
    op, caller = None, None
    for index, frame in enumerate(frames):
        if os.sep + os.path.join("torch", "distributed") + os.sep in frame.filename:
            if op is None and frame.name != "wrapper":  # torch's logging decorator around the collective
                op = frame.name
                outside = [f for f in frames[:index] if os.sep + "torch" + os.sep not in f.filename]
                caller = outside[-1] if outside else None
    if op is None:
        return "a collective"
    where = f" called from {caller.name} ({_short(caller.filename)}:{caller.lineno})" if caller else ""
    return f"torch.distributed {op}{where}"


def _short(filename: str) -> str:
    for anchor in ("megatron_eopt" + os.sep, "megatron" + os.sep, "tests" + os.sep):
        if anchor in filename:
            return anchor + filename.rsplit(anchor, 1)[1]
    return os.path.basename(filename)


def is_collective_failure(error: BaseException) -> bool:
    """A RuntimeError (gloo/NCCL failure, a store timeout) raised inside torch.distributed."""
    if not isinstance(error, (RuntimeError, TimeoutError, ConnectionError)):
        return False
    marker = os.sep + os.path.join("torch", "distributed") + os.sep
    in_dist = any(marker in frame.filename for frame in traceback.extract_tb(error.__traceback__))
    return in_dist or isinstance(error, getattr(dist, "DistError", ()))


@contextlib.contextmanager
def collective_failures(rank: int, timeout_minutes: float) -> Iterator[None]:
    """A collective that fails or times out in the block ends this rank with one line (`fail`)."""
    try:
        yield
    except CollectiveTimeout as error:  # the library's bounded wait names the operation itself
        fail(rank, f"{error} (--distributed-timeout-minutes {timeout_minutes:g}; a rank stopped?). Exiting with "
                   f"status {EXIT_STATUS}; under torchrun --max-restarts the job restarts from its last checkpoint.")
    except BaseException as error:
        if not is_collective_failure(error):
            raise
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        why = (f"did not complete within --distributed-timeout-minutes {timeout_minutes:g} (a rank stopped?)"
               if timed_out else "failed (a rank died?)")
        fail(rank, f"{describe_failure(error)} {why}: {first[:300]}. Exiting with status {EXIT_STATUS}; "
                   f"under torchrun --max-restarts the job restarts from its last checkpoint.")
