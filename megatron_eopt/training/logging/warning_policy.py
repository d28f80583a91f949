"""Which warnings a training run prints, and how: one line each, and not a page of repeats.

`warning_policy()`, the one mechanism, holds for a block (pretrain.main, which imports torch
and megatron-core inside it) and is undone after it:
- every warning prints as one line (`format_warning`), without Python's source line;
- known harmless third-party warnings (`KNOWN_HARMLESS`: Transformer Engine or Apex not
  installed) print once, on rank 0, and torch's "No CUDA runtime" log line is dropped on the
  other ranks; those that say nothing about the run (`SILENCED`: the SyntaxWarnings Python
  raises when it compiles megatron-core's docstrings) print nowhere;
- megatron_eopt's warnings about OptimizerConfig's fields name the flags that set them
  (`--muon-split-qkv-per-head` for `OptimizerConfig.muon_split_qkv_per_head=True`);
- megatron_eopt's own warnings (and those of its flags, arguments/) are about the run (its flags
  and configuration), the same on every rank: rank 0 prints them, except a `RankWarning`
  (megatron_eopt.runtime.once), about one rank alone, which every rank prints.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Callable, Iterator, Optional

from arguments.validate import flag_message
from megatron_eopt.runtime.once import RankWarning
from megatron_eopt.training.errors import PROG, is_rank_zero

__all__ = ["KNOWN_HARMLESS", "SILENCED", "format_warning", "warning_policy"]

# Third-party warnings known to be harmless: (category, message pattern, module pattern).
KNOWN_HARMLESS = (
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\."),
    (UserWarning, r"Only transformer-engine>=\S+ supports MoE experts, but your version is 0\.0\.0", r"megatron\."),
)
# Third-party warnings about their own source, not the run, ignored on every rank. Compiler
# warnings name their module by its file path, hence the path pattern.
SILENCED = (
    (SyntaxWarning, r"invalid escape sequence", r".*[/\\]megatron[/\\]core[/\\]"),
)
# torch logs this (not a warning) when something imports torch.utils.cpp_extension on a machine
# without CUDA.
NO_CUDA_RUNTIME = ("torch.utils.cpp_extension", "No CUDA runtime is found")


def format_warning(message, category: type, filename: str, lineno: int, line: Optional[str] = None) -> str:
    """One line: `pretrain_gpt.py: warning: <message on one line> (<category>)`."""
    text = str(message)
    if "OptimizerConfig." in text:  # the library's words: this run set those fields with flags
        text = flag_message(text)
    return f"{PROG}: warning: {' '.join(text.split())} ({category.__name__})\n"


@contextlib.contextmanager
def warning_policy(rank_zero: Optional[bool] = None) -> Iterator[None]:
    """The policy above for the block; `rank_zero` by default from a caller's process group or
    torchrun's RANK (errors.is_rank_zero). The warnings module's filters, `showwarning` and
    `formatwarning` are restored afterwards."""
    if rank_zero is None:
        rank_zero = is_rank_zero()
    format_before = warnings.formatwarning
    logger = logging.getLogger(NO_CUDA_RUNTIME[0])
    drop_no_cuda = _NoCudaRuntimeFilter()
    with warnings.catch_warnings():
        warnings.formatwarning = format_warning
        for category, message, module in SILENCED:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        if rank_zero:
            # Not the "once" action: it counts per module, and megatron-core repeats a message in several.
            warnings.showwarning = _each_known_text_once(warnings.showwarning)
        else:
            for category, message, module in KNOWN_HARMLESS:
                warnings.filterwarnings("ignore", message=message, category=category, module=module)
            warnings.filterwarnings("ignore", module=r"(megatron_eopt|arguments)(\.|$)")
            warnings.filterwarnings("default", category=RankWarning)  # inserted first: it wins
            logger.addFilter(drop_no_cuda)
        try:
            yield
        finally:
            warnings.formatwarning = format_before
            logger.removeFilter(drop_no_cuda)


class _NoCudaRuntimeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NO_CUDA_RUNTIME[1])


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
