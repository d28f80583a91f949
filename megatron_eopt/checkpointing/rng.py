"""Random number generator states in a checkpoint, one set per rank.

Each rank saves `rng/<kind>/<rank>of<world>`: its CPU generator (`cpu`), its current CUDA
device's generator when CUDA is in use (`cuda`), and every state of megatron-core's RNG tracker
(`tracker/<name>`, e.g. `model-parallel-rng`, which drives dropout inside tensor-parallel
regions). A rank's states are only meaningful for the same rank of the same layout, so they are
restored only when the world size and the tensor-parallel size equal the saved ones (Megatron-LM
likewise ignores RNG state when TP/PP change); otherwise the run keeps its own seeding and the
load says so. A resharding load is never refused for RNG.

The tracker is megatron-core's process-global one. A save reads it only when it already exists
(megatron-core imported and the tracker created), so saving neither imports megatron-core's
model stack nor creates the tracker; a load that finds tracker states sets them into it.
"""

import sys
from typing import Any, Optional

import torch

TRACKER_MODULE = "megatron.core.tensor_parallel.random"


def rng_keys_suffix(rank: int, world_size: int) -> str:
    return f"{rank}of{world_size}"


def rng_entries(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states as checkpoint entries (CPU byte tensors)."""
    suffix = rng_keys_suffix(rank, world_size)
    entries = {f"rng/cpu/{suffix}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entries[f"rng/cuda/{suffix}"] = torch.cuda.get_rng_state()
    tracker = _tracker(import_it=False)
    if tracker is not None:
        for name, state in tracker.get_states().items():
            entries[f"rng/tracker/{name}/{suffix}"] = _as_tensor(state)
    return entries


def rng_keys_to_load(stored_keys: Any, rank: int, world_size: int) -> list[str]:
    suffix = "/" + rng_keys_suffix(rank, world_size)
    return sorted(k for k in stored_keys if k.startswith("rng/") and k.endswith(suffix))


def restore_rng(states: dict[str, torch.Tensor]) -> list[str]:
    """Set the generators from `states` (keys from `rng_keys_to_load`); returns what was not set."""
    not_restored = []
    tracker_states = {}
    for key, state in states.items():
        kind = key.split("/")[1]
        if kind == "cpu":
            torch.set_rng_state(state)
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(state)
        elif kind == "tracker":
            tracker_states["/".join(key.split("/")[2:-1])] = state
        else:
            not_restored.append(key)
    if tracker_states:
        tracker = _tracker(import_it=True)
        current = tracker.get_states()
        merged = dict(current)
        for name, state in tracker_states.items():
            merged[name] = _like(state, current.get(name))
        tracker.set_states(merged)
    return not_restored


def _tracker(import_it: bool) -> Optional[Any]:
    """megatron-core's tracker. Saving reads it only if it already exists: creating it here would
    fix its kind (a later request for Transformer Engine's tracker would be ignored)."""
    if not import_it:
        module = sys.modules.get(TRACKER_MODULE)
        if module is None or not getattr(module, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
            return None
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def _as_tensor(state: Any) -> torch.Tensor:
    # A graph-safe tracker (use_cudagraphable_rng) holds torch.Generator objects.
    return state.get_state() if isinstance(state, torch.Generator) else state


def _like(state: torch.Tensor, current: Any) -> Any:
    if isinstance(current, torch.Generator):
        current.set_state(state)
        return current
    return state
