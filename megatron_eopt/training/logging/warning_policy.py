"""Which warnings a training run prints, so that its output is not a page of repeats.

Every rank imports megatron-core and torch, which say what is not installed (Transformer Engine,
Apex, a CUDA runtime) and carry a SyntaxWarning in one of megatron-core's docstrings: harmless and
the same on every rank, so each prints once, on rank 0. megatron_eopt's own warnings are about
the run (its flags and configuration), the same on every rank: rank 0 prints them. The entry
scripts call :func:`quiet_repeated_warnings` before anything imports megatron-core.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Callable

__all__ = ["KNOWN_HARMLESS", "quiet_repeated_warnings"]

# Third-party warnings known to be harmless: (category, message pattern, module pattern). Compiler
# warnings name their module by its file path, hence the path pattern of the SyntaxWarning.
KNOWN_HARMLESS = (
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\."),
    (UserWarning, r"Only transformer-engine>=\S+ supports MoE experts, but your version is 0\.0\.0", r"megatron\."),
    (SyntaxWarning, r"invalid escape sequence", r".*[/\\]megatron[/\\]core[/\\]"),
)
# torch logs this (not a warning) when something imports torch.utils.cpp_extension on a machine
# without CUDA.
NO_CUDA_RUNTIME = ("torch.utils.cpp_extension", "No CUDA runtime is found")


def quiet_repeated_warnings(rank: int | None = None) -> None:
    """Print each known harmless third-party warning once on rank 0 and not elsewhere, and
    megatron_eopt's warnings on rank 0 only. ``rank``: torchrun's ``RANK`` by default (0 without)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        # Not the "once" action: it counts per module, and megatron-core repeats a message in several.
        warnings.showwarning = _each_known_text_once(warnings.showwarning)
        return
    for category, message, module in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    warnings.filterwarnings("ignore", module=r"megatron_eopt(\.|$)")
    logger, message = NO_CUDA_RUNTIME
    logging.getLogger(logger).addFilter(lambda record: not record.getMessage().startswith(message))


def _each_known_text_once(show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` that passes a known harmless warning's text on the first time only."""
    known = [(category, re.compile(message, re.I)) for category, message, _ in KNOWN_HARMLESS]
    shown: set[str] = set()

    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if any(issubclass(category, kind) and pattern.match(text) for kind, pattern in known):
            if text in shown:
                return
            shown.add(text)
        show(message, category, filename, lineno, file, line)

    return showwarning
