"""torchtitan 0.3.0's Trainer on CPU ranks (gloo), for tests: what it needs replaced at run time, here
only (the installed package is not edited), and the parts a CPU job brings itself.

`trainer_on_cpu()` replaces, while it is open:
- the device: torchtitan picks "cuda" when no accelerator is found and calls `torch.cuda.set_device`
  and its memory statistics; a CPU stand-in answers them (no memory statistics);
- `set_pg_timeouts` after the first step: it calls `torch.distributed.set_timeout`, which torch 2.13
  does not have (a no-op here: gloo's timeouts stay as the process group has them);
- FSDP2's gradient reduction: torchtitan divides by the global token count with NCCL's PREMUL_SUM,
  which gloo lacks; each FSDP module sums, then divides (`set_force_sum_reduction_for_comms`).
A CPU job brings: a tokenizer (torchtitan's reads files from the hub), a dataloader of random tokens
(its c4_test set ships with its repository, not its wheel) and an inner attention with a CPU backward
(`sdpa_attention`: torchtitan's flex has none on CPU, its varlen is CUDA only).
"""

import contextlib
import importlib
import types
from dataclasses import dataclass
from typing import Iterator

import torch

VOCAB = 2048  # torchtitan's llama3 debugmodel's
DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                  "torchtitan.distributed.parallel_dims", "torchtitan.models.common.token_dispatcher")


class _CpuDevice:
    """What torchtitan calls on its device module (torch.cuda), answered for the CPU."""

    def set_device(self, device) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(name="cpu", total_memory=1 << 34)

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device=None) -> dict:
        return {}

    def synchronize(self, device=None) -> None:
        pass


@contextlib.contextmanager
def _replaced(module, name: str, value) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _fsdp_summing(apply_fsdp):
    def apply(model, *args, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        result = apply_fsdp(model, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # a sum, then the division: gloo has no PREMUL_SUM
        return result

    return apply


@contextlib.contextmanager
def trainer_on_cpu() -> Iterator[None]:
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3.parallelize as llama3_parallelize

    with contextlib.ExitStack() as stack:
        for name in DEVICE_MODULES:
            module = importlib.import_module(name)
            for attribute, value in (("device_type", "cpu"), ("device_module", _CpuDevice())):
                if hasattr(module, attribute):
                    stack.enter_context(_replaced(module, attribute, value))
        stack.enter_context(_replaced(dist_utils, "set_pg_timeouts", lambda **kwargs: None))
        stack.enter_context(_replaced(llama3_parallelize, "apply_fsdp_to_decoder",
                                      _fsdp_summing(llama3_parallelize.apply_fsdp_to_decoder)))
        yield


def sdpa_attention(model_spec) -> None:
    """Every FlexAttention of the model's config becomes torchtitan's ScaledDotProductAttention
    (causal; it has a CPU backward)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    swapped = list(model_spec.model.traverse(FlexAttention.Config))
    assert swapped, "the model has no FlexAttention to swap"
    for _, _, parent, attribute in swapped:
        setattr(parent, attribute, ScaledDotProductAttention.Config())


def tokenizer_and_data():
    """(tokenizer config, dataloader config): no files; tokens drawn from (seed, step, data-parallel rank)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, *, tokenizer_path=None) -> None:
            super().__init__()
            self.eos_id = 0

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("random tokens need no tokenizer")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("random tokens need no tokenizer")

        def get_vocab_size(self) -> int:
            return VOCAB

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            seed: int = 0

        def __init__(self, config, *, dp_rank, seq_len, local_batch_size, **unused) -> None:
            self.seed, self.rank, self.shape, self.batches = config.seed, dp_rank, (local_batch_size, seq_len + 1), 0

        def __iter__(self):
            while True:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.batches * 101 + self.rank)
                tokens = torch.randint(0, VOCAB, self.shape, generator=generator)
                self.batches += 1
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict:
            return {"batches": self.batches}

        def load_state_dict(self, state_dict: dict) -> None:
            self.batches = state_dict["batches"]

    return NoTokenizer.Config(), RandomTokens.Config()
