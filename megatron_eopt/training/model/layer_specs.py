"""Transformer-layer specs: which megatron-core modules make up each layer of the GPT model.

On CUDA the layers come from megatron-core's own specs (Transformer Engine when installed, else
the local spec). On CPU the local spec is used with substitutions: the core attention becomes
``SDPACoreAttention`` (``sdpa_attention.py``), multi-latent attention ``mla.py``'s, MoE layers
``moe.py``'s; norms that refuse sequence parallelism or zero-centred gamma become ``norms.py``'s.
:func:`stage_block_spec` gives one pipeline stage's layers, MoE and dense ones by
``moe_layer_freq``.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)

from megatron_eopt.training.arguments.moe import moe_layer_pattern
from megatron_eopt.training.model.mla import with_cpu_mla
from megatron_eopt.training.model.model_parallel import LayerSeededTransformerLayer, init_seed
from megatron_eopt.training.model.moe import moe_layer_builder
from megatron_eopt.training.model.norms import LocalTorchNorm
from megatron_eopt.training.model.sdpa_attention import SDPACoreAttention
from megatron_eopt.training.model.settings import GPTModelSettings

__all__ = ["TRANSFORMER_IMPLS", "gpt_layer_spec", "stage_block_spec", "transformer_engine_at_least"]


def gpt_layer_spec(use_cuda: bool, max_attn_logits: bool = False, num_experts: int | None = None,
                   transformer_impl: str = "auto", qk_layernorm: bool = False,
                   multi_latent_attention: bool = False) -> ModuleSpec:
    """Transformer-layer spec: megatron's own on CUDA, local + SDPA attention on CPU.

    ``max_attn_logits`` (QK-clip or max-logit logging): on CUDA, Transformer Engine's
    attention records them from TE 2.9; without such a TE the SDPA attention is used.
    ``num_experts``: megatron's MoE layer, with the substitutions of megatron_eopt/training/model/moe.py (experts
    seeded by global index; on CPU also the router, layer and allgather dispatcher).
    ``transformer_impl`` (Megatron-LM's --transformer-impl): "auto" takes Transformer Engine's
    layers on CUDA when it is installed, "local" megatron's local ones, "transformer_engine"
    requires them (CUDA and TE, >= 2.9 with ``max_attn_logits``).
    ``qk_layernorm``: a norm on each head's query and key (megatron's, over the head width); with
    ``multi_latent_attention`` (megatron's MLASelfAttention, megatron_eopt/training/model/mla.py) norms on the
    compressed query and key/value latents instead.
    """
    spec = _attention_spec(use_cuda, max_attn_logits, num_experts, transformer_impl, qk_layernorm,
                           multi_latent_attention)
    if num_experts is None:
        return spec
    mlp = moe_layer_builder(spec.submodules.mlp, use_cuda)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


def _attention_spec(use_cuda: bool, max_attn_logits: bool, num_experts: int | None,
                    transformer_impl: str, qk_layernorm: bool, multi_latent_attention: bool = False) -> ModuleSpec:
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, not {transformer_impl!r}")
    te_version = "2.9.0" if max_attn_logits else None  # TE records the maximum logits from 2.9
    if transformer_impl == "transformer_engine" and not (use_cuda and transformer_engine_at_least(te_version)):
        raise ValueError(f"transformer_impl='transformer_engine' needs CUDA and Transformer Engine"
                         f"{' >= 2.9 (QK-clip reads the maximum attention logits it records)' if te_version else ''}")
    if use_cuda and transformer_impl != "local" and transformer_engine_at_least(te_version):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                                          multi_latent_attention=multi_latent_attention)
    local = dict(num_experts=num_experts, qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention)
    if use_cuda and not max_attn_logits:
        return get_gpt_layer_local_spec(**local)
    # Copy each level we change so no spec object shared with other callers is mutated.
    spec = get_gpt_layer_local_spec(**local)
    attention = spec.submodules.self_attention
    if multi_latent_attention and not use_cuda:
        attention = with_cpu_mla(attention)
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=SDPACoreAttention),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


def transformer_engine_at_least(version: str | None) -> bool:
    """Whether Transformer Engine is installed (and at least ``version``, when given)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    if version is None:
        return True
    from megatron.core.utils import is_te_min_version

    return is_te_min_version(version)



def stage_block_spec(settings: GPTModelSettings, config: TransformerConfig, vp_stage: int | None, use_cuda: bool,
                      local_norms: bool) -> ModuleSpec | TransformerBlockSubmodules:
    """This stage's layers: one layer spec when all are alike, else a block spec of this stage's
    layers (MoE and dense ones by ``moe_layer_freq``, as megatron-core's
    ``get_gpt_decoder_block_spec`` does; local norms, see :func:`_with_local_norms`)."""
    is_moe = _stage_moe_layers(settings, config, vp_stage)
    specs, final_norm = {}, None
    for moe in set(is_moe) or {settings.num_moe_experts is not None}:
        spec = gpt_layer_spec(use_cuda=use_cuda, max_attn_logits=settings.qk_clip or settings.log_max_attention_logit,
                              num_experts=settings.num_moe_experts if moe else None,
                              transformer_impl=settings.transformer_impl, qk_layernorm=settings.qk_layernorm,
                              multi_latent_attention=settings.multi_latent_attention)
        if spec.module is TransformerLayer and init_seed() is not None:
            spec = dataclasses.replace(spec, module=LayerSeededTransformerLayer)
        if local_norms:
            spec, final_norm = _with_local_norms(spec)
        specs[moe] = spec
    if len(specs) == 1 and final_norm is None:
        return next(iter(specs.values()))
    return TransformerBlockSubmodules(layer_specs=[specs[moe] for moe in is_moe], layer_norm=final_norm or LayerNormImpl)


def _stage_moe_layers(settings: GPTModelSettings, config: TransformerConfig, vp_stage: int | None) -> list[bool]:
    """Whether each layer of this (virtual) stage is MoE, by its global number."""
    if settings.num_moe_experts is None:
        pattern = [0] * settings.num_layers
    else:
        pattern = moe_layer_pattern(settings.moe_layer_freq, settings.num_layers)
    if config.pipeline_model_parallel_layout is not None:
        layer_ids = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                            vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage)
        layer_ids = range(offset, offset + get_num_layers_to_build(config, vp_stage))
    return [bool(pattern[layer]) for layer in layer_ids]


def _with_local_norms(layer_spec: ModuleSpec) -> tuple[ModuleSpec, type | None]:
    """megatron's torch layer norm refuses sequence parallelism and zero-centred gamma: with the
    local spec, the layer's norms (the query/key norms too) become megatron_eopt/training/model/norms.py's
    LocalTorchNorm, and so must the final one (the second value; None when nothing changed).
    Transformer Engine's norms do both themselves and stay."""
    norms = {name: LocalTorchNorm for name in ("input_layernorm", "pre_mlp_layernorm")
             if getattr(layer_spec.submodules, name) is WrappedTorchNorm}
    if not norms:
        return layer_spec, None
    attention = layer_spec.submodules.self_attention
    qk_norms = {name: LocalTorchNorm for name in ("q_layernorm", "k_layernorm", "kv_layernorm")  # kv: MLA's
                if getattr(attention.submodules, name, None) is WrappedTorchNorm}
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, **qk_norms))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, self_attention=attention, **norms)), LocalTorchNorm

