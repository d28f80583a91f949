"""A small megatron-core ``GPTModel`` that trains on CPU as well as on CUDA, and its loss.

It is megatron-core's real ``GPTModel`` (parallel linears, vocab-parallel embedding and cross
entropy, parameter attributes), so optimizers see exactly what Megatron training hands them. The
pieces live beside it: settings.py, transformer_config.py, layer_specs.py (with sdpa_attention.py,
mla.py, moe.py on CPU), cpu_gpt_model.py and model_parallel.py. Pipeline stages and MoE layers
with expert parallelism build on CPU too.

    initialize_model_parallel(tensor_model_parallel_size=1, seed=1234)  # after init_process_group
    model = build_gpt_model(GPTModelSettings())
    loss = gpt_loss(model, tokens)  # tokens: [batch, seq + 1]
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_eopt.training.model.cpu_gpt_model import CPUGPTModel
from megatron_eopt.training.model.layer_specs import stage_block_spec
# Re-exported: with build_gpt_model and gpt_loss they are the names of the typical use above.
from megatron_eopt.training.model.model_parallel import (
    destroy_model_parallel,
    initialize_model_parallel,
    seed_model_chunk,
)
from megatron_eopt.training.model.settings import GPTModelSettings
from megatron_eopt.training.model.transformer_config import transformer_config
from megatron_eopt.training.parallel.sequence_parallel import install_cpu_sequence_parallel

__all__ = [
    "GPTModelSettings",
    "build_gpt_model",
    "build_gpt_model_chunks",
    "destroy_model_parallel",
    "gpt_loss",
    "gpt_token_losses",
    "initialize_model_parallel",
]

# Settings handed to GPTModel under the same names and unchanged.
_SAME_NAMED_ARGUMENTS = ("vocab_size", "share_embeddings_and_output_weights", "position_embedding_type",
                         "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor")


def build_gpt_model_chunks(settings: GPTModelSettings, device: torch.device | str = "cpu") -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without a virtual pipeline)."""
    virtual_stages = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if virtual_stages is None:
        return [build_gpt_model(settings, device)]
    return [build_gpt_model(settings, device, vp_stage=stage) for stage in range(virtual_stages)]


def build_gpt_model(
    settings: GPTModelSettings, device: torch.device | str = "cpu", vp_stage: int | None = None
) -> GPTModel:
    """Build megatron-core's GPTModel for the current model-parallel state on ``device``.

    With pipeline parallelism this is the part of the model on this rank's stage (virtual
    stage ``vp_stage`` with an interleaved pipeline): the embeddings on the first stage, the
    final norm and output layer on the last, its share of the layers with global numbers.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call initialize_model_parallel before build_gpt_model")
    device = torch.device(device)
    settings.check_tensor_parallel(parallel_state.get_tensor_model_parallel_world_size())
    config = transformer_config(settings, device)
    sequence_parallel = config.sequence_parallel
    model_class = GPTModel if device.type == "cuda" else CPUGPTModel
    layer_spec = stage_block_spec(settings, config, vp_stage, device.type == "cuda",
                                   local_norms=sequence_parallel or settings.layernorm_zero_centered_gamma)
    seed_model_chunk(config, vp_stage)
    if sequence_parallel and device.type != "cuda":
        install_cpu_sequence_parallel()
    model = model_class(
        config=config,
        transformer_layer_spec=layer_spec,
        **{name: getattr(settings, name) for name in _SAME_NAMED_ARGUMENTS},
        max_sequence_length=settings.max_positions,
        seq_len_interpolation_factor=settings.rotary_seq_len_interpolation_factor,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )
    # Some local-spec modules (torch norms) ignore params_dtype; megatron's Float16Module casts
    # the whole model the same way for bf16 training. Parameters keep megatron's attributes.
    return model.to(device=device, dtype=settings.params_dtype)


def gpt_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on ``tokens`` (``[batch, seq + 1]``, int64)."""
    losses, _ = gpt_token_losses(model, tokens)
    return losses.mean()


def gpt_token_losses(model: torch.nn.Module, tokens: torch.Tensor,
                     document_inputs: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token cross entropy of ``model`` on ``tokens`` (``[batch, seq + 1]``,
    int64) as fp32 ``[b, s]``, and the labels ``[b, s]``.

    The model sees ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``; megatron computes the
    vocab-parallel cross entropy when given labels and returns per-token losses ``[b, s]``.
    ``model`` may be a wrapper (e.g. megatron's DDP) that forwards its arguments.
    ``document_inputs(inputs)``: (position ids, attention mask or None) for packed documents
    (megatron_eopt/training/data/datasets.py's ``document_inputs``); default positions 0..s-1 and no mask.
    """
    if tokens.dim() != 2 or tokens.size(1) < 2:
        raise ValueError(f"tokens must be [batch, seq + 1] with seq >= 1: {tuple(tokens.shape)}")
    tokens = tokens.to(next(model.parameters()).device, torch.long)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if document_inputs is None:
        position_ids = torch.arange(inputs.size(1), device=inputs.device).expand_as(inputs)
        attention_mask = None  # causality comes from the attention module's causal mask type
    else:
        position_ids, attention_mask = document_inputs(inputs)
    losses = model(input_ids=inputs, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
    return losses.float(), labels

