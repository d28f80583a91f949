"""What the run-time CPU patches of megatron-core's packages (megatron_fsdp_cpu.py for Megatron-FSDP,
megatron_lm_cpu.py for Megatron-LM's loop) put in place of CUDA-only objects and calls."""

import functools
import types
from typing import Any, Callable

import torch
import torch.distributed as dist


class NoEvent:
    """A CUDA event already reached: CPU work runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class NoStream(NoEvent):
    """A CUDA stream that waits for nothing."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> NoEvent:
        return NoEvent()


class Passthrough(types.ModuleType):
    """A module whose attributes are `base`'s, except those given."""

    def __init__(self, base: types.ModuleType, **replaced: Any) -> None:
        super().__init__(base.__name__)
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class _Done:
    """The work handle of a collective already finished."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True


def all_gather_padded(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """dist.all_gather of flat tensors of any sizes: gloo gathers equal sizes only, so each is padded
    to the largest and cut back (then already done when `async_op`)."""
    sizes = [t.numel() for t in tensor_list]
    if len(set(sizes)) <= 1:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    largest = max(sizes)
    padded = [torch.empty(largest, dtype=tensor.dtype, device=tensor.device) for _ in sizes]
    local = torch.zeros(largest, dtype=tensor.dtype, device=tensor.device)
    local[:tensor.numel()] = tensor.reshape(-1)
    dist.all_gather(padded, local, group=group)
    for out, received, size in zip(tensor_list, padded, sizes):
        out.view(-1).copy_(received[:size])
    return _Done() if async_op else None


def replace_names(replacements: list[tuple[Any, str, Any]]) -> list[Callable[[], None]]:
    """Rebind each (owner, name) to its replacement; the undo of each, to call in reverse order."""
    undo = []
    for owner, name, value in replacements:
        undo.append(functools.partial(setattr, owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    return undo
