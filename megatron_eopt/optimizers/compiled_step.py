"""emerging_optimizers compiles some updates with `@torch.compile`: the first step pays for it.

Lion, LaProp, SOAP, REKLS and PSGD-Pro call update functions their modules decorate with
`@torch.compile`, so their first `step()` compiles (tens of seconds on a CPU, over a minute with
an empty compile cache) and looks like a hang. `watch_first_step` makes such an optimizer say so
before its first step and how long that step took after it (rank 0, once per process and
optimizer, on stderr). With `OptimizerConfig.emerging_optimizers_compile=False`
(`--no-emerging-optimizers-compile`) every step runs under `torch.compiler.set_stance("force_eager")`:
the same update, uncompiled, with no first-step cost (slower steps on large models).
"""

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

_ANNOUNCED: set[str] = set()  # optimizer names whose first compiled step this process reported


def compiled_functions(optimizer_cls: type) -> list[str]:
    """Names of the `torch.compile`d functions in the modules of `optimizer_cls` and its bases."""
    found = []
    for klass in optimizer_cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or klass.__module__.startswith(("torch.", "builtins")):
            continue
        for name, value in vars(module).items():
            if callable(value) and hasattr(value, "_torchdynamo_orig_callable") and name not in found:
                found.append(name)
    return found


class WatchedStep:
    """`optimizer.step` replaced by this (an object, so a deep copy steps its own optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer, name: str, compile: bool, functions: list[str]) -> None:
        self.optimizer, self.name, self.compile, self.functions = optimizer, name, compile, functions

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = type(self.optimizer).step
        if not self.compile:
            with torch.compiler.set_stance("force_eager"):
                return step(self.optimizer, *args, **kwargs)
        if self.name in _ANNOUNCED:
            return step(self.optimizer, *args, **kwargs)
        _ANNOUNCED.add(self.name)
        _say(f"{self.name}: the first step compiles emerging_optimizers' {', '.join(self.functions)} with "
             f"torch.compile (up to a minute or more; OptimizerConfig(emerging_optimizers_compile=False) or "
             f"--no-emerging-optimizers-compile runs it uncompiled)")
        started = time.perf_counter()
        result = step(self.optimizer, *args, **kwargs)
        _say(f"{self.name}: first step took {time.perf_counter() - started:.1f} s (torch.compile included); "
             f"later steps reuse the compiled code")
        return result


def watch_first_step(name: str, optimizer: torch.optim.Optimizer, config: Any) -> torch.optim.Optimizer:
    """`optimizer`, its step watched (or run uncompiled) when its class calls compiled functions."""
    functions = compiled_functions(type(optimizer))
    if functions:
        optimizer.step = WatchedStep(optimizer, name, getattr(config, "emerging_optimizers_compile", True), functions)
    return optimizer


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"megatron_eopt: {message}", file=sys.stderr, flush=True)
