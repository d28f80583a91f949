"""The megatron-core ``TransformerConfig`` of a ``GPTModelSettings``.

Most fields are the settings' own under the same names; the rest come from the model-parallel
state ``parallel_state`` was set up with (tensor, pipeline and expert parallel sizes) and from
the device (CPU initialisation wherever megatron's GPU one would call CUDA).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import (
    MLATransformerConfig,
    TransformerConfig,
)

from megatron_eopt.training.model.mla import mla_config_fields
from megatron_eopt.training.model.settings import GPTModelSettings

__all__ = ["transformer_config"]


# Settings handed to TransformerConfig under the same names and unchanged.
_SAME_NAMED_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "normalization",
    "layernorm_zero_centered_gamma", "kv_channels", "qk_layernorm", "rotary_interleaved", "add_bias_linear",
    "layernorm_epsilon", "hidden_dropout", "attention_dropout", "init_method_std", "embedding_init_method_std",
    "bf16", "fp16", "params_dtype", "qk_clip", "qk_clip_threshold", "qk_clip_alpha", "log_max_attention_logit",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
)


def transformer_config(settings: GPTModelSettings, device: torch.device) -> TransformerConfig:
    """The TransformerConfig (MLATransformerConfig with multi-latent attention) of ``settings`` for
    the current model-parallel state on ``device``. Sequence parallelism is off at TP=1."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config_class = MLATransformerConfig if settings.multi_latent_attention else TransformerConfig
    return config_class(
        **{name: getattr(settings, name) for name in _SAME_NAMED_FIELDS},
        num_query_groups=settings.query_groups,
        gated_linear_unit=settings.gated,
        activation_func=settings.activation_func,
        add_qkv_bias=settings.add_qkv_bias or settings.add_bias_linear,
        **_xavier_init(settings),
        tensor_model_parallel_size=tp,
        # On CPU there is no other way: megatron's GPU initialisation calls CUDA.
        use_cpu_initialization=settings.cpu_initialization or device.type != "cuda",
        sequence_parallel=settings.sequence_parallel and tp > 1,
        recompute_modules=None if settings.recompute_modules is None else list(settings.recompute_modules),
        **_pipeline_config(settings),
        **_expert_config(settings),
        **mla_config_fields(settings),
        # Whole layers, should CUDA graphs be enabled: megatron-core's default, "full", is the
        # deprecated spelling of this empty list and warns.
        cuda_graph_modules=[],
    )


def _xavier_init(settings: GPTModelSettings) -> dict[str, Any]:
    """Megatron-LM's --init-method-xavier-uniform: the init and the output-layer (scaled) init.
    (The installed Megatron-LM hands TransformerConfig a `scaled_init_method`, a field it does
    not have, so the flag fails there with a TypeError; its output_layer_init_method is meant.)"""
    if not settings.init_method_xavier_uniform:
        return {}
    return dict(init_method=torch.nn.init.xavier_uniform_, output_layer_init_method=torch.nn.init.xavier_uniform_)


def _pipeline_config(settings: GPTModelSettings) -> dict[str, Any]:
    """TransformerConfig fields of the pipeline layout parallel_state was set up with."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages == 1:
        return {}
    return dict(
        pipeline_model_parallel_size=stages,
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_model_parallel_layout=settings.pipeline_model_parallel_layout,
        num_layers_in_first_pipeline_stage=settings.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=settings.num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=settings.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=settings.account_for_loss_in_pipeline_split,
        pipeline_dtype=settings.params_dtype,
    )


# MoE settings handed to TransformerConfig unchanged (tuples as the lists megatron expects).
_MOE_CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(GPTModelSettings)
                           if field.name.startswith("moe_"))


def _expert_config(settings: GPTModelSettings) -> dict[str, Any]:
    if settings.num_moe_experts is None:
        return {}
    fields = {name: getattr(settings, name) for name in _MOE_CONFIG_FIELDS}
    return dict(
        num_moe_experts=settings.num_moe_experts,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        moe_grouped_gemm=False,
        **{name: list(value) if isinstance(value, tuple) else value for name, value in fields.items()},
    )

