"""Each parameter's name in the whole model (PP=1, EP=1), from the part of it a rank holds.

With pipeline parallelism megatron-core numbers each stage's layers from 0 (`decoder.layers.0`
on every stage) and with expert parallelism each rank its experts (`local_experts.0`), so local
names repeat across ranks. A checkpoint stores everything under the global name instead, so it
loads at any other pipeline or expert-parallel size. The global numbers come from what
megatron-core records on the modules themselves:
- a transformer layer's `layer_number` (1-based, global: the stage offset included);
- an MoE layer's `local_expert_indices` (the global index of each of its local experts);
- the last stage's copy of a tied output layer is marked `shared` (language_module.py): it is
  stored as the embedding it copies, as megatron-core's own sharded_state_dict does.
With several model chunks (virtual pipeline) the `model_chunk<i>.` prefix is dropped: the layer
numbers are already global. So is every wrapper's `module.` (`MODEL_WRAPPERS`): a checkpoint
saved from a model wrapped by Megatron-FSDP loads into the bare model (one process, DDP, torch
FSDP2, which shards in place) and back.
"""

import re
from typing import Optional

import torch

from megatron_eopt.params.expert_names import LOCAL_EXPERT, global_expert_index
from megatron_eopt.params.groups import named_trainable_parameters, stored_child_name, stored_group_key

__all__ = ["global_buffer_names", "global_parameter_names", "stored_child_name", "stored_group_key"]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")
# The layouts' wrappers: modules that hold the model as `module`, so that every name inside starts
# with `module.` (Megatron-FSDP's MegatronFSDP; megatron-core's Megatron-FSDP adapter, DDP and
# Float16Module; torch's DDP).
MODEL_WRAPPERS = ("MegatronFSDP", "FullyShardedDataParallel", "DistributedDataParallel", "Float16Module")
TIED_OUTPUT = "output_layer.weight"
TIED_EMBEDDING = "embedding.word_embeddings.weight"


def global_parameter_names(model_chunks: list[torch.nn.Module]) -> dict[str, str]:
    """{fqn (named_trainable_parameters, frozen included): its name in the PP=1/EP=1 model}.

    Raises ValueError when two parameters of this rank map to one global name.
    """
    result: dict[str, str] = {}
    for chunk_index, chunk in enumerate(model_chunks):
        renames, wrapped = _module_renames(chunk), wrapper_prefix(chunk)
        for name, param in chunk.named_parameters():
            result[(f"model_chunk{chunk_index}." if len(model_chunks) > 1 else "") + name] = (
                _global_name(name, param, renames).removeprefix(wrapped)
            )
    wanted = {fqn for fqn, _, _ in named_trainable_parameters(model_chunks, trainable_only=False)}
    result = {fqn: name for fqn, name in result.items() if fqn in wanted}
    _check_unique(result)
    return result


def global_buffer_names(model_chunks: list[torch.nn.Module]) -> dict[str, tuple[torch.Tensor, str]]:
    """{fqn: (buffer, its name in the PP=1/EP=1 model)} for every persistent buffer (model state
    that no optimizer steps, e.g. an MoE router's expert bias), named as the parameters are.
    Transformer Engine's `_extra_state` entries are not tensors and not included."""
    result: dict[str, tuple[torch.Tensor, str]] = {}
    for chunk_index, chunk in enumerate(model_chunks):
        renames, wrapped = _module_renames(chunk), wrapper_prefix(chunk)
        params = {id(param) for param in chunk.parameters()}
        for name, value in chunk.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) not in params and not name.endswith("_extra_state"):
                fqn = (f"model_chunk{chunk_index}." if len(model_chunks) > 1 else "") + name
                result[fqn] = (value, _global_name(name, value, renames).removeprefix(wrapped))
    _check_unique({fqn: name for fqn, (_, name) in result.items()})
    return result


def wrapper_prefix(chunk: torch.nn.Module) -> str:
    """What the layout's wrappers add before the model's own names: `module.` per wrapper."""
    prefix, module = "", chunk
    while type(module).__name__ in MODEL_WRAPPERS and isinstance(getattr(module, "module", None), torch.nn.Module):
        prefix, module = prefix + "module.", module.module
    return prefix


def _module_renames(chunk: torch.nn.Module) -> dict[str, str]:
    """{local module name: global module name} for the layers and experts of `chunk`."""
    modules = dict(chunk.named_modules())
    renames = {}
    for name, module in modules.items():
        layer = _LAYER.search(name)
        if layer is not None and isinstance(getattr(module, "layer_number", None), int):
            renames[name] = f"{name[:layer.start(2)]}{module.layer_number - 1}"
        expert = LOCAL_EXPERT.search(name)
        if expert is not None:
            renames[name] = f"{name[:expert.start(2)]}{global_expert_index(modules, name, expert)}"
    return renames


def _global_name(name: str, param: torch.Tensor, renames: dict[str, str]) -> str:
    if getattr(param, "shared", False) and name.endswith(TIED_OUTPUT):
        return name[: -len(TIED_OUTPUT)] + TIED_EMBEDDING
    # Each renamed module changes only its own last component (a layer or expert number), so
    # an expert inside a layer gets both numbers replaced.
    local_prefix, global_parts = "", []
    for part in name.split("."):
        local_prefix = f"{local_prefix}.{part}" if local_prefix else part
        global_parts.append(renames[local_prefix].rsplit(".", 1)[-1] if local_prefix in renames else part)
    return ".".join(global_parts)


def _check_unique(names: dict[str, str]) -> None:
    seen: dict[str, str] = {}
    for fqn, name in names.items():
        other: Optional[str] = seen.setdefault(name, fqn)
        if other != fqn:
            raise ValueError(
                f"parameters {other!r} and {fqn!r} have the same global name {name!r}; a checkpoint "
                f"needs one name per parameter (are two model chunks holding the same layer?)."
            )

