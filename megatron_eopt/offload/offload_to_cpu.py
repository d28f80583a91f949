"""megatron-core's `offload_to_cpu()` / `restore_from_cpu()`: an optimizer's own tensors to the host and back.

Megatron-LM's RL loop (`--rl-offload-optimizer-during-inference`) frees the accelerator's memory
this way while it generates. What moves: the optimizer's state (Adam's moments, Muon's momentum,
SOAP's preconditioners: whatever the inner optimizer keeps, in any dtype) and the main weights it
owns (fp32 copies, bf16 remainders). What stays: the model's parameters and gradients, and anything
sharing their memory (FP32 and FSDP2 optimizers step the model's own weights or shards).

Each storage is copied to host memory (pinned where CUDA is) and its device memory is freed by
resizing the storage to 0 bytes; restoring resizes it back and copies the bytes in. The tensors
stay the same objects, so every alias the optimizer keeps (flat state buffers, views, the
inner optimizer's `state` keys) is intact and the next step is bitwise the one it would have
been. Tensors already on the host are left alone: without an accelerator both calls change
nothing, as megatron-core's do.
"""

from collections.abc import Iterable
from typing import Any

import torch


def on_accelerator(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is what offloading frees (a module-level function: tests on a
    machine without one treat the host as the accelerator)."""
    return tensor.device.type != "cpu"


def tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor in `value` (nested dicts, lists, tuples), a DTensor as its local tensor."""
    if isinstance(value, torch.Tensor):
        yield getattr(value, "_local_tensor", value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


class HostCopies:
    """The storages one optimizer moved to the host, until they are restored."""

    def __init__(self) -> None:
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (device storage, its bytes on the host)

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def offload(self, tensors: Iterable[torch.Tensor], keep: Iterable[torch.Tensor]) -> None:
        """Move the storages of `tensors` to the host, except those that a tensor in `keep` (the
        model's parameters) uses. Calling it again while offloaded changes nothing."""
        if self._moved:
            return
        kept = {storage_key(t) for t in keep}
        seen = set()
        for tensor in tensors:
            if not on_accelerator(tensor):
                continue
            key = storage_key(tensor)
            storage = tensor.untyped_storage()
            if key in kept or key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.copy_(_bytes_of(storage, tensor.device))
            storage.resize_(0)
            self._moved.append((storage, host))

    def restore(self) -> None:
        """Each moved storage back on its device, at its size, with its bytes."""
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes_of(storage, storage.device).copy_(host)
        self._moved = []


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
