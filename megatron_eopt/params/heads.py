"""A model's token embeddings and output head, found by structure, for models megatron-core did not build.

megatron-core tags its word embedding and output layer `is_embedding_or_output_parameter`; other
models (`transformers`, torchtitan, plain torch) carry no such tag, and torch FSDP2's `fully_shard`
drops parameter attributes anyway. Modules survive it, so this reads the module tree:
- embeddings the model reports: every submodule's `get_input_embeddings()` /
  `get_output_embeddings()` (`transformers`), tied or not;
- the output head: a linear layer (`nn.Linear` or a subclass) that is a direct child of the model
  (or of the wrappers' `module` chain around it), with one row per vocabulary entry: as many rows
  as one of the model's lookup tables or as the root's `config.vocab_size` (a pipeline stage with
  the head but not the embedding). torchtitan's `output` / `lm_head` sit there; a projection of a
  block may have the vocabulary's shape by chance, and is never a direct child.
Lookup tables themselves are found by module type in params/groups.py (`ParamRouting`).
"""

from typing import Iterable, Iterator, Optional

import torch

def embedding_and_output_reasons(chunks: Iterable[torch.nn.Module], lookup_table_types: tuple[type, ...]) -> dict[int, str]:
    """id(param) -> why it is a token embedding or output head, for the chunks' structural ones."""
    chunks = [chunk for chunk in chunks if isinstance(chunk, torch.nn.Module)]
    reasons = _reported_embeddings(chunks)
    vocab_sizes = _vocabulary_sizes(chunks, lookup_table_types)
    for chunk in chunks:
        for head in _output_heads(chunk, vocab_sizes):
            reasons.setdefault(id(head.weight), f"output head ({type(head).__name__} of the model itself, "
                                                 f"{head.weight.shape[0]} rows: the vocabulary's)")
    return reasons


def _reported_embeddings(chunks: list[torch.nn.Module]) -> dict[int, str]:
    """What `get_input_embeddings()` / `get_output_embeddings()` return, from every module having them."""
    found: dict[int, set[str]] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for method in ("get_input_embeddings", "get_output_embeddings"):
                for param in _parameters_of(_reported(module, method)):
                    found.setdefault(id(param), set()).add(method)
    return {key: _embedding_reason(methods) for key, methods in found.items()}


def _embedding_reason(methods: set[str]) -> str:
    if len(methods) == 2:
        return "input and output embedding, tied (get_input_embeddings, get_output_embeddings)"
    method = next(iter(methods))
    return f"{method.split('_')[1]} embedding ({method})"


def _reported(module: torch.nn.Module, method: str) -> Optional[torch.nn.Module]:
    getter = getattr(module, method, None)
    if not callable(getter):
        return None
    try:
        reported = getter()
    except (NotImplementedError, AttributeError):  # transformers: a model that does not say, or whose
        # getter reads a part this configuration leaves out (SAM3 tracker video without a vision encoder)
        return None
    return reported if isinstance(reported, torch.nn.Module) else None  # None: a model without a head


def _parameters_of(module: Optional[torch.nn.Module]) -> Iterator[torch.nn.Parameter]:
    return iter(()) if module is None else module.parameters()


def _vocabulary_sizes(chunks: list[torch.nn.Module], lookup_table_types: tuple[type, ...]) -> set[int]:
    sizes = {module.weight.shape[0] for chunk in chunks for module in chunk.modules()
             if isinstance(module, lookup_table_types) and getattr(module, "weight", None) is not None}
    for chunk in chunks:
        vocab_size = getattr(getattr(chunk, "config", None), "vocab_size", None)
        if isinstance(vocab_size, int) and not isinstance(vocab_size, bool):
            sizes.add(vocab_size)
    return sizes


def _output_heads(chunk: torch.nn.Module, vocab_sizes: set[int]) -> Iterator[torch.nn.Linear]:
    """The linear layers with vocabulary rows among the direct children of `chunk` and of the
    modules it wraps (`chunk.module`, ...: DDP, Float16Module)."""
    module: Optional[torch.nn.Module] = chunk
    while isinstance(module, torch.nn.Module):
        for child in module.children():
            weight = getattr(child, "weight", None)
            if isinstance(child, torch.nn.Linear) and weight is not None and weight.dim() == 2 \
                    and weight.shape[0] in vocab_sizes:
                yield child
        module = getattr(module, "module", None)
