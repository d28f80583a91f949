"""What verl's and AReaL's FSDP engines need to train a tiny model on CPU, for the tests that hold our
optimizer in them (tests/unit/library/integrations/test_verl_engine.py, test_areal_engine.py):

- a tiny Qwen3 checkpoint on disk (both engines load a Hugging Face model from a path);
- for verl 0.9.1, a CPU platform: verl ships CUDA, NPU and ROCm ones and falls back to "nvidia" when it
  detects none. Its plugin API (`PlatformBase`, `set_platform`) takes ours; it must be set before
  `verl.workers.engine.fsdp.transformer_impl` is imported (that module reads the device name once);
- a batch of random tokens in each engine's format, and an SFT loss in AReaL's signature;
- the optimizer state and the shards of the model as plain tensors, to compare two runs key by key.
AReaL 1.0.4 picks its own CPU platform (gloo) when it finds no accelerator.
"""

import types
from contextlib import contextmanager
from typing import Any

import torch

# Qwen3 at a size that trains in moments: 2 layers, GQA (4 query heads, 2 key/value heads), untied head.
QWEN3_SIZE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=64)


def save_tiny_qwen3(directory: str) -> str:
    """A randomly initialised tiny Qwen3 (seed 0) saved with `save_pretrained`; returns its path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**QWEN3_SIZE)).save_pretrained(directory)
    return directory


def verl_sft_batch(rank: int, step: int):
    """verl's no-padding batch of 2 sequences: jagged input_ids/position_ids/loss_mask, and the per-batch
    settings verl's trainer adds (padded attention: verl's remove-padding path needs flash-attn)."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(100 * step + rank)
    lengths = [7, 5]
    jagged = lambda tensors: torch.nested.as_nested_tensor(tensors, layout=torch.jagged)  # noqa: E731
    return tu.get_tensordict(
        {"input_ids": jagged([torch.randint(0, QWEN3_SIZE["vocab_size"], (n,), generator=generator) for n in lengths]),
         "position_ids": jagged([torch.arange(n) for n in lengths]),
         "loss_mask": jagged([torch.ones(n, dtype=torch.long) for n in lengths])},
        non_tensor_dict={"use_remove_padding": False, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2,
                         "max_token_len_per_gpu": 1024, "use_fused_kernels": False, "temperature": 1.0,
                         "global_batch_size": 4, "pad_mode": "no_padding"})


def areal_sft_batch(rank: int, step: int) -> dict:
    """AReaL's padded batch of 2 sequences: input_ids, attention_mask and the loss mask shifted to the next token."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    attention_mask = torch.ones(2, 7, dtype=torch.bool)
    attention_mask[1, 5:] = False
    return {"input_ids": torch.randint(0, QWEN3_SIZE["vocab_size"], (2, 7), generator=generator),
            "attention_mask": attention_mask, "loss_mask": torch.roll(attention_mask, shifts=-1, dims=-1)}


def areal_sft_loss(logprobs: torch.Tensor, entropy: torch.Tensor, input_: dict, **kwargs) -> torch.Tensor:
    """An SFT loss in AReaL's loss-function signature: the mean negative log-likelihood over `loss_mask`
    (AReaL's own, in areal.trainer, imports its experiment loggers: swanlab, wandb)."""
    mask = input_["loss_mask"].bool()
    return -torch.where(mask, logprobs, 0.0).sum() / mask.count_nonzero()


def _cpu_device_module() -> types.ModuleType:
    """`torch.cpu` plus what verl calls on its platform's device module that `torch.cpu` lacks
    (the rng state its checkpoints save, the memory figures it logs)."""

    class CpuDeviceModule(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

    module = CpuDeviceModule("verl_cpu_device")
    module.get_rng_state, module.set_rng_state = torch.get_rng_state, torch.set_rng_state
    module.manual_seed = module.manual_seed_all = torch.manual_seed
    module.empty_cache = lambda: None
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, lambda *args, **kwargs: 0)
    module.mem_get_info = lambda *args, **kwargs: (0, 0)
    return module


def use_verl_cpu_platform() -> None:
    """Make verl run on CPU with gloo: its platform singleton becomes a CPU one."""
    from verl.plugin.platform import set_platform
    from verl.plugin.platform.platform_base import PlatformBase

    device_module = _cpu_device_module()

    class CpuPlatform(PlatformBase):
        device_name, vendor_name = "cpu", "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # verl moves tensors `.to(get_device_id())`
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Any = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        profiler_stop = profiler_start

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    set_platform(CpuPlatform())


def plain(value: Any) -> Any:
    """`value` (a state dict, nested) with every DTensor as its local shard and tensors cloned."""
    if isinstance(value, torch.Tensor):
        return getattr(value, "_local_tensor", value).detach().clone()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    return value


def snapshot(model: torch.nn.Module, optimizer: Any) -> dict:
    """This rank's parameters and optimizer `state_dict()`, as `plain` copies to compare a resumed run with."""
    return {"model": plain(dict(model.named_parameters())), "optimizer": plain(optimizer.state_dict())}


def differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Where two nested values differ: tensors bitwise (dtype and shape too), the rest by ==."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        same = (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)
                and expected.dtype == actual.dtype and torch.equal(expected, actual))
        return [] if same else [where]
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return [f"{where} keys {sorted(map(str, set(expected) ^ set(actual)))}"]
        return [d for key in expected for d in differences(expected[key], actual[key], f"{where}/{key}")]
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    return [] if expected == actual else [where]


def inner_state_tensors(optimizer: Any) -> dict[str, torch.Tensor]:
    """Every tensor the inner optimizers of ours keep, by child, parameter index and key."""
    found = {}
    for child_index, child in enumerate(optimizer.chained_optimizers):
        inner = child.optimizer
        for param_index, param in enumerate(p for g in inner.param_groups for p in g["params"]):
            for key, value in inner.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    found[f"child {child_index} param {param_index} {key}"] = value
    return found
