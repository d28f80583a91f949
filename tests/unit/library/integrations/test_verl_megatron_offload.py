"""verl 0.9.1's Megatron-side offload helpers on what `get_megatron_optimizer` returns (docs/memory.md,
"Engines' offload helpers"): `verl.utils.megatron_utils.offload_megatron_optimizer` before generation
and `load_megatron_optimizer` after it must move every tensor our optimizer owns, Muon's momentum and
the fp32 main weights included, not only Adam's moments.

What the helpers read: `isinstance(optimizer, megatron.core.optimizer.ChainedOptimizer)` (then each of
`chained_optimizers`, else the optimizer itself); of each child `shard_fp32_from_float16_groups`
(moved with `tensor.data = tensor.data.to(...)`) and `child.optimizer`: its `state` values' `exp_avg`,
`exp_avg_sq` and `master_param` by name, or, where `child.optimizer` has `sub_optimizers`,
`inner_param_to_orig_param` and `state` (megatron-core's HybridDeviceOptimizer), every tensor of every
sub-optimizer's state, and on the way back its `_move_new_state_to_right_device()`.

Without an accelerator a move to the host changes nothing visible, so the test records which storages
the helpers hand to `Tensor.to` and for which device; the CPU platform's device stands in for the
accelerator on the way back.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from tests import rl_engines_on_cpu
from tests.small_model import small_model, step_on_random_grads

CONFIG = OptimizerConfig(optimizer="muon", lr=1e-2, bf16=True, muon_fp32_matmul_prec="highest")


class MovedStorages:
    """The storages `Tensor.to(device, ...)` was called on, by target device."""

    def __init__(self) -> None:
        self.by_device: dict[str, set[int]] = {}

    def install(self, monkeypatch) -> None:
        original = torch.Tensor.to

        def recording_to(tensor, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)):
                self.by_device.setdefault(str(target), set()).add(tensor.untyped_storage().data_ptr())
            return original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", recording_to)


def _owned(optimizer) -> dict[str, int]:
    """Every tensor our optimizer owns (inner state and fp32 main weights), by a readable name: its storage."""
    owned = {}
    for index, child in enumerate(optimizer.chained_optimizers):
        for number, tensor in enumerate(child._owned_tensors()):
            owned[f"{child.name} tensor {number} {tuple(tensor.shape)}"] = tensor.untyped_storage().data_ptr()
    return owned


def test_verl_megatron_offload_helpers_move_every_tensor_our_optimizer_owns(monkeypatch) -> None:
    import verl.plugin.platform.platform_manager as platform_manager
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    monkeypatch.setattr(platform_manager, "_current_platform", None)  # ours for this test only
    rl_engines_on_cpu.use_verl_cpu_platform()
    # verl clears megatron-core's global memory buffer after offloading: Megatron-LM's initialisation makes it.
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", GlobalMemoryBuffer())
    from verl.utils.megatron_utils import load_megatron_optimizer, offload_megatron_optimizer

    model = small_model(CONFIG)
    optimizer = get_megatron_optimizer(CONFIG, [model])
    step_on_random_grads(model, optimizer, seed=1)
    owned = _owned(optimizer)
    assert any("muon" in name for name in owned) and any("adam" in name for name in owned), owned
    moved = MovedStorages()
    moved.install(monkeypatch)
    offload_megatron_optimizer(optimizer)
    to_host = moved.by_device.pop("cpu", set())
    load_megatron_optimizer(optimizer)
    back = moved.by_device.pop("cpu", set())
    assert [name for name, storage in owned.items() if storage not in to_host] == []
    assert [name for name, storage in owned.items() if storage not in back] == []
