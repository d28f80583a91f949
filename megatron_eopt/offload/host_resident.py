"""Optimizer state on the host, streamed to the device for the step (`optimizer_cpu_offload`).

Which parameters: megatron-core's rule (its HybridDeviceOptimizer), over what one child steps on
this rank (under the layer-wise optimizer, what it owns): in param-group order, while the elements
taken are fewer than `optimizer_offload_fraction` of all. Between steps their state tensors are
host tensors (pinned where CUDA is), their main weights too (main_param_storage.OnHost), which
checkpoints read as they are. The step runs in windows: the resident parameters together, then
each offloaded one alone, its state copied into fresh device tensors, the inner optimizer's param
groups narrowed to it, the results copied back. With `overlap_cpu_optimizer_d2h_h2d` on CUDA the
copies run on a side stream. Each parameter gets the update it gets without offload (the inner
optimizers update parameter by parameter; Muon's TP exchange runs per window on every TP rank
alike, whose shards are equal). docs/memory.md has the design and the measurements.
"""

import contextlib
from typing import Iterator, Optional, Sequence

import torch


def offloaded_indices(numels: Sequence[int], fraction: float) -> list[int]:
    """Positions of the parameters megatron-core's rule offloads (module docstring)."""
    threshold = sum(numels) * fraction
    taken, count = [], 0
    for index, numel in enumerate(numels):
        if count >= threshold:
            break
        taken.append(index)
        count += numel
    return taken


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A fresh host tensor with `tensor`'s values (pinned when asked and CUDA exists)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
    host.copy_(tensor)
    return host


def device_copy(tensor: torch.Tensor, device: torch.device, stream: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
    """A fresh tensor on `device` with `tensor`'s values (a real copy on the host too)."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        copy.copy_(tensor, non_blocking=stream is not None)
    return copy


class HostResidentState:
    """The host half of one child's offloaded state, and the windows its step runs in."""

    def __init__(self, indices: Sequence[int], count: int, device: torch.device, pin: bool, overlap: bool) -> None:
        self.indices = list(indices)  # positions in the child's parameter list
        self._offloaded = set(self.indices)
        self._count = count
        self.device = device
        self.pin = pin
        self._stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None

    def is_offloaded(self, index: int) -> bool:
        return index in self._offloaded

    def windows(self) -> list[list[int]]:
        """The resident parameters together, then each offloaded one alone (module docstring)."""
        resident = [i for i in range(self._count) if i not in self._offloaded]
        return ([resident] if resident else []) + [[i] for i in self.indices]

    def to_host(self, states: Sequence[dict]) -> None:
        """Every tensor of `states` (offloaded parameters' state dicts) onto the host, in place
        of the device ones; tensors already there stay."""
        for state in states:
            for key, value in state.items():
                if _moves(value) and value.device.type != "cpu":
                    state[key] = host_copy(value, self.pin)

    @contextlib.contextmanager
    def on_device(self, states: Sequence[dict]) -> Iterator[None]:
        """Inside: each tensor of `states` a device copy; after: the results back in the host
        tensors (new host tensors for state the step created)."""
        hosts = [{key: value for key, value in state.items() if _moves(value)} for state in states]
        for state, host in zip(states, hosts):
            state.update({key: device_copy(value, self.device, self._stream) for key, value in host.items()})
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        yield
        for state, host in zip(states, hosts):
            for key, value in state.items():
                if not _moves(value):
                    continue
                kept = host.get(key)
                if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype:
                    self._copy_out(kept, value)
                    state[key] = kept
                else:
                    state[key] = host_copy(value, self.pin)

    def _copy_out(self, host: torch.Tensor, value: torch.Tensor) -> None:
        if self._stream is None:
            host.copy_(value)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(value, non_blocking=True)
            value.record_stream(self._stream)

    def finish(self) -> None:
        """Wait for the last copies out (the host tensors hold the step's results after it)."""
        if self._stream is not None:
            self._stream.synchronize()


def _moves(value: object) -> bool:
    """State that moves: plain tensors with elements. Scalars (Adam's `step`) stay where the inner
    optimizer keeps them (torch's Adam wants its step on the host unless capturable)."""
    return type(value) is torch.Tensor and value.dim() > 0
