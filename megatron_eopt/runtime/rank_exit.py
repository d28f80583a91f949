"""Ending a multi-rank run on bad input: one line on rank 0's stderr, the same status on every rank,
no traceback. Our trainer (training/errors.py) and Megatron-LM's loop with ours
(integrations/megatron_lm_gpt.py) end their refusals here."""

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn, Optional

# How long another rank that fails waits before exiting, so that rank 0 (which fails alike) has
# printed the error first: torchrun stops every worker as soon as one exits non-zero, and a rank 1
# that exited first could get rank 0 killed before it says why. Under torchrun the wait ends when
# rank 0 exits: torchrun then sends the others SIGTERM, on which they exit with rank 0's status
# (not -15), so its report lists every rank with status 2. The wait covers the ranks' difference
# in start-up time (seconds) with a wide margin.
OTHER_RANKS_WAIT_S = 60.0


def is_rank_zero() -> bool:
    """From torchrun's environment, so it holds before any process group exists (or from the
    process group a caller already made)."""
    dist = sys.modules.get("torch.distributed")  # not imported yet: no process group either
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def exit_with_error(message: str, prog: str) -> NoReturn:
    """`prog: error: message` in one line on rank 0's stderr, status 2 on every rank (argparse's
    convention), no traceback: every rank checks the same flags, so each rank gets here."""
    exit_from_any_rank(2, f"{prog}: error: {' '.join(message.split())}\n")


def exit_pointing_to_help(message: str, prog: str) -> NoReturn:
    """exit_with_error with `; see PROG --help.` appended, the message's own full stop dropped (no '.;')."""
    exit_with_error(f"{message.rstrip().removesuffix('.')}; see {prog} --help.", prog)


def exit_from_any_rank(status: int, message: Optional[str]) -> NoReturn:
    """Rank 0 prints `message` and exits with `status`; another rank exits alike, in silence, after
    rank 0 (OTHER_RANKS_WAIT_S) when the status is an error."""
    if is_rank_zero():
        if message:
            sys.stderr.write(message)
            sys.stderr.flush()
    elif status:
        with _exiting_on_sigterm(status):
            time.sleep(OTHER_RANKS_WAIT_S)
    raise SystemExit(status)


@contextlib.contextmanager
def _exiting_on_sigterm(status: int) -> Iterator[None]:
    """SIGTERM (torchrun stopping the workers once rank 0 has exited) ends this rank at once with
    `status`; the handler before is restored after the block. Only the main thread sets handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(status))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
