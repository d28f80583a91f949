"""One-line flag errors and argparse output from rank 0 only; every rank exits alike
(runtime/rank_exit.py; warnings: logging/warning_policy.py)."""

import argparse
import re
from typing import NoReturn, Optional, TextIO

from arguments.close_match import closest, did_you_mean
from megatron_eopt.runtime import rank_exit
from megatron_eopt.runtime.rank_exit import is_rank_zero

PROG = "pretrain_gpt.py"


def exit_with_error(message: str) -> NoReturn:
    """One line on rank 0's stderr, status 2 on every rank (runtime/rank_exit.py), no traceback."""
    rank_exit.exit_with_error(message, PROG)


class RankZeroArgumentParser(argparse.ArgumentParser):
    """argparse's usage and help printed by rank 0 only; every rank exits alike. Its errors are
    one line (no usage), with the closest flag or choice and a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        rank_exit.exit_pointing_to_help(f"{message}{self._close_match(message)}", self.prog)

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
        rank_exit.exit_from_any_rank(status, message)

