"""One-line flag errors and argparse output from rank 0 only; every rank exits alike (warnings:
logging/warning_policy.py)."""

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn, Optional, TextIO

from arguments.close_match import closest, did_you_mean

PROG = "pretrain_gpt.py"


# How long another rank that fails waits before exiting, so that rank 0 (which fails alike) has
# printed the error first: torchrun stops every worker as soon as one exits non-zero, and a rank 1
# that exited first could get rank 0 killed before it says why. Under torchrun the wait ends when
# rank 0 exits: torchrun then sends the others SIGTERM, on which they exit with rank 0's status
# (not -15), so its report lists every rank with status 2. The wait covers the ranks' difference
# in start-up time (seconds) with a wide margin.
OTHER_RANKS_WAIT_S = 60.0


def is_rank_zero() -> bool:
    """From torchrun's environment, so it holds before any process group exists (or from the
    process group a caller already made, see `main`)."""
    dist = sys.modules.get("torch.distributed")  # not imported yet: no process group either
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def exit_with_error(message: str) -> NoReturn:
    """One line on rank 0's stderr, status 2 on every rank (argparse's convention), no traceback:
    every rank parses the same flags and builds the same optimizer, so each rank gets here."""
    _exit_from_any_rank(2, f"{PROG}: error: {' '.join(message.split())}\n")


def _exit_from_any_rank(status: int, message: Optional[str]) -> NoReturn:
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


class RankZeroArgumentParser(argparse.ArgumentParser):
    """argparse's usage and help printed by rank 0 only; every rank exits alike. Its errors are
    one line (no usage), with the closest flag or choice and a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        exit_with_error(f"{message}{self._close_match(message)}; see {self.prog} --help.")

    def _close_match(self, message: str) -> str:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            options = [option for option in self._option_string_actions if option.startswith("--")]
            guesses = [closest(word.split("=")[0], options) for word in unknown.group(1).split() if word[:1] == "-"]
            guesses = [guess for guess in guesses if guess]
            return f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
        choice = re.search(r"invalid choice: (.*?) \(choose from (.*)\)$", message)
        if choice:
            return did_you_mean(choice.group(1).strip("'"), [c.strip().strip("'") for c in choice.group(2).split(",")])
        return ""

    def print_usage(self, file: Optional[TextIO] = None) -> None:
        if is_rank_zero():
            super().print_usage(file)

    def print_help(self, file: Optional[TextIO] = None) -> None:
        if is_rank_zero():
            super().print_help(file)

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        _exit_from_any_rank(status, message)

