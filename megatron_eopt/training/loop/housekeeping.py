"""Megatron-LM's memory and garbage-collection habits around each iteration:

- `--manual-gc`: Python's automatic collector is turned off for the run and `gc.collect()` runs
  at the same points on every rank instead (so no rank stalls on a collection while the others
  wait for it in a collective): at the start, every `--manual-gc-interval` iterations (0: never)
  and, unless `--no-manual-gc-eval`, before and after each evaluation. The collector is turned
  back on when training ends.
- `--empty-unused-memory-level`: `torch.cuda.empty_cache()` after each forward/backward (1) and
  also after each optimizer step (2). On CPU there is no caching allocator to empty: said once.
"""

import argparse
import contextlib
import gc
from typing import Iterator

import torch

from megatron_eopt.training.arguments.loop import check_housekeeping_flags  # noqa: F401 (re-exported)


class Housekeeping:
    """The flags' actions at their points of the training loop (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.manual_gc = args.manual_gc
        self.gc_interval = args.manual_gc_interval
        self.gc_around_eval = args.manual_gc and args.manual_gc_eval
        self.empty_cache_level = args.empty_unused_memory_level if device.type == "cuda" else 0
        self.start_line = None
        if args.empty_unused_memory_level and device.type != "cuda":
            self.start_line = (f"--empty-unused-memory-level {args.empty_unused_memory_level}: no effect on CPU "
                               f"(no CUDA caching allocator to empty)")

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        if self.manual_gc:
            gc.disable()
            gc.collect()
        try:
            yield
        finally:
            if self.manual_gc:
                gc.enable()

    def after_forward_backward(self) -> None:
        if self.empty_cache_level >= 1:
            torch.cuda.empty_cache()

    def after_step(self, iteration: int) -> None:
        if self.empty_cache_level >= 2:
            torch.cuda.empty_cache()
        if self.manual_gc and self.gc_interval and iteration % self.gc_interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        if self.gc_around_eval:
            gc.collect()
        try:
            yield
        finally:
            if self.gc_around_eval:
                gc.collect()
            if self.empty_cache_level >= 1:
                torch.cuda.empty_cache()
