"""A small megatron-core ``GPTModel`` that trains on CPU as well as on CUDA.

It is the model behind the optimizer library's tests, the demo script and
``scripts/pretrain_gpt.py``: megatron-core's real ``GPTModel`` (its parallel
linears, vocab-parallel embedding and cross entropy, parameter attributes), so
optimizers are exercised on exactly what Megatron training hands them.

On CUDA the layers come from megatron-core's own specs (Transformer Engine when
installed, else the local spec). On CPU the local spec is used with one
substitution: megatron's ``DotProductAttention`` allocates a CUDA buffer in
forward, so ``core_attention`` is replaced by :class:`SDPACoreAttention`, built
on ``torch.nn.functional.scaled_dot_product_attention``; and RoPE's frequencies,
which megatron moves to CUDA at the first forward, stay on CPU
(:class:`_CPURotaryEmbedding`).

Pipeline stages (also several model chunks per rank) and MoE layers with expert parallelism
are built on CPU too (``initialize_model_parallel(..., pipeline_model_parallel_size=,
virtual_pipeline_model_parallel_size=, expert_model_parallel_size=)`` then
:func:`build_gpt_model_chunks`), with one more substitution: tied embeddings across stages are
synchronised without megatron's ``.cuda()`` (:class:`_CPUTiedEmbeddingGPTModel`). MoE layers
also train on CPU, through the substitutions of ``megatron_eopt/training/model/moe.py`` (a router and an allgather
dispatcher that do not call CUDA; experts seeded by global index, so the weights do not depend
on the expert-parallel size), with tensor parallelism too when ``sequence_parallel`` is set
(megatron's MoELayer needs it). megatron's pipeline schedules call CUDA: ``megatron_eopt/training/parallel/pipeline.py``
runs the stages with ``torch.distributed.pipelining`` instead.

Typical use (torch.distributed must already be initialised, gloo is fine)::

    initialize_model_parallel(tensor_model_parallel_size=1, seed=1234)
    model = build_gpt_model(GPTModelSettings())
    loss = gpt_loss(model, tokens)  # tokens: [batch, seq_length + 1]
    loss.backward()
    destroy_model_parallel()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.activations import quick_gelu, squared_relu
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import (
    MLATransformerConfig,
    TransformerConfig,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)

from megatron_eopt.training.arguments.moe import moe_layer_pattern
from megatron_eopt.training.model.mla import mla_config_fields, with_cpu_mla
from megatron_eopt.training.model.moe import moe_layer_builder
from megatron_eopt.training.model.norms import LocalTorchNorm
from megatron_eopt.training.parallel.cpu_rng import use_cpu_rng_tracker
from megatron_eopt.training.parallel.sequence_parallel import (
    install_cpu_sequence_parallel,
    use_cpu_sequence_parallel_linears,
)

__all__ = [
    "GPTModelSettings",
    "SDPACoreAttention",
    "SettingsError",
    "build_gpt_model",
    "build_gpt_model_chunks",
    "destroy_model_parallel",
    "gpt_layer_spec",
    "gpt_loss",
    "gpt_token_losses",
    "initialize_model_parallel",
]


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` that runs on any device.

    Takes the keywords megatron's ``Attention`` passes to ``core_attention``.
    Layouts follow megatron: query ``[sq, b, heads, head_dim]``, key/value
    ``[sk, b, query_groups, head_dim]`` (per tensor-parallel partition; values may be narrower,
    as in multi-latent attention), output ``[sq, b, heads * value_head_dim]``. Options it does not implement raise
    ``ValueError`` instead of silently computing different attention.

    QK-clip: while ``record_max_attn_logits`` is True (from the config's ``qk_clip`` /
    ``log_max_attention_logit``, or set by the optimizer), each training-mode forward folds
    the per-head maximum of the masked pre-softmax logits q.k * softmax_scale over the
    batch into ``current_max_attn_logits`` ([heads on this rank], megatron-core's
    attribute); the optimizer reads and resets it every step. Evaluation forwards do not
    count. The logits are materialised once more for this ([b, heads, sq, sk] fp32).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        unsupported = {
            "context parallelism": config.context_parallel_size != 1,
            f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
            "sliding-window attention": config.window_size is not None,
        }
        for option, used in unsupported.items():
            if used:
                raise ValueError(f"SDPACoreAttention does not support {option}")
        self._check_mask_type(attn_mask_type)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # Multi-latent attention passes its query/key width (k_channels) and its value width
        # (v_channels, may differ) with its own softmax_scale; the widths come from the tensors.
        head_dim = config.kv_channels if k_channels is None else k_channels
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside megatron's softmax: a numerical-range trick for fp16 with no effect
        # on the result, so it is ignored here.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if attention_dropout is None:
            attention_dropout = config.attention_dropout
        self.dropout_p = attention_dropout
        self.record_max_attn_logits = bool(
            getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False)
        )
        self.current_max_attn_logits: torch.Tensor | None = None
        # cp_comm_type and pg_collection are accepted for megatron's builder signature; context
        # parallelism is rejected above and the per-partition head counts come from the tensors.

    @staticmethod
    def _check_mask_type(mask_type: AttnMaskType) -> None:
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPACoreAttention supports causal, padding and no_mask masks, not {mask_type}"
            )

    def _sdpa(self, q, k, v, mask, causal: bool, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale
        )

    @torch.no_grad()
    def _record_max_logits(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None,
                           causal: bool) -> None:
        """Fold this batch's per-head max logit into ``current_max_attn_logits``."""
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        if causal:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        batch_max = scores.amax(dim=(0, 2, 3))
        previous = self.current_max_attn_logits
        self.current_max_attn_logits = batch_max if previous is None else torch.maximum(previous, batch_max)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention over ``[s, b, n, d]`` inputs; returns ``[sq, b, n * d]``.

        ``attention_mask`` follows megatron: boolean, ``True`` marks positions that are
        masked out, broadcastable to ``[b, heads, sq, sk]``. With a causal mask type an
        explicit mask is applied on top of causality (e.g. per-document masks).
        """
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention does not support packed sequences (THD format)")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        self._check_mask_type(mask_type)

        sq, b, heads, head_dim = query.shape
        sk, groups = key.size(0), key.size(2)
        if heads % groups != 0:
            raise ValueError(f"{heads} query heads do not divide into {groups} key/value groups")
        if heads != groups:  # grouped-query attention: each group serves heads // groups heads
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)

        causal = mask_type == AttnMaskType.causal
        if causal and sq != sk:
            raise ValueError(f"causal attention needs sq == sk, got sq={sq}, sk={sk}")
        if mask_type == AttnMaskType.padding and attention_mask is None:
            raise ValueError("padding mask type needs an attention_mask")
        allowed = None  # SDPA boolean masks mark positions to *keep*, the inverse of megatron's
        if attention_mask is not None and mask_type != AttnMaskType.no_mask:
            allowed = ~attention_mask.to(torch.bool)
            if causal:  # SDPA takes is_causal or a mask, not both
                allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
                causal = False

        # [s, b, n, d] -> [b, n, s, d], the layout SDPA expects.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.record_max_attn_logits and self.training:
            self._record_max_logits(q, k, allowed, causal)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Heads differ across tensor-parallel ranks, so their dropout must use the
            # model-parallel RNG stream, as megatron's DotProductAttention does (on CPU the
            # tracker's streams are CPU generator states, megatron_eopt/training/parallel/cpu_rng.py). Under
            # sequence parallelism the transformer block runs inside that stream already.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, allowed, causal, dropout_p)
        else:
            out = self._sdpa(q, k, v, allowed, causal, dropout_p)
        # [b, n, sq, d_v] -> [sq, b, n * d_v] (d_v: the value width, MLA's may differ from the query's)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * value.size(-1))


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


class SettingsError(ValueError):
    """A setting the model cannot be built with.

    The message names the settings (``max_position_embeddings (32) must be >= seq_length (64)``);
    a front end that took them from its own options re-words it in their names with
    :meth:`message_for`, e.g. ``--max-position-embeddings 32 must be >= --seq-length 64``.
    """

    def __init__(self, template: str, **values: Any) -> None:
        # `template` has one {placeholder} per setting involved; `values` gives their values.
        self.template, self.values = template, values
        super().__init__(self.message_for({}))

    def message_for(self, names: Mapping[str, str]) -> str:
        """The message with each setting written as ``names[setting] value`` where named."""
        return self.template.format(**{
            setting: f"{names[setting]} {value}" if setting in names else f"{setting} ({value})"
            for setting, value in self.values.items()
        })


@dataclasses.dataclass(frozen=True)
class GPTModelSettings:
    """Shape and options of the GPT model; defaults give a tiny model for tests.

    ``seq_length`` is the number of model inputs per sample: :func:`gpt_loss` takes
    ``seq_length + 1`` tokens (inputs plus the shifted labels).
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_query_groups: int | None = 2  # None: multi-head attention (one group per head)
    ffn_hidden_size: int = 128
    swiglu: bool = True
    # Without swiglu, the MLP's activation (Megatron-LM's --squared-relu, --quick-geglu: a gated
    # unit with x * sigmoid(1.702 x)); "gelu" is megatron's default.
    activation: Literal["gelu", "squared_relu", "quick_geglu"] = "gelu"
    seq_length: int = 32
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int = 128
    bf16: bool = False  # bf16 parameters (megatron's --bf16); fp32 otherwise
    fp16: bool = False  # fp16 parameters (megatron's --fp16)
    add_bias_linear: bool = False
    add_qkv_bias: bool = False  # megatron's --add-qkv-bias: biases on the QKV projection only (implied by add_bias_linear)
    layernorm_epsilon: float = 1e-5  # megatron's --norm-epsilon
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    # megatron's --apply-layernorm-1p: norms store gamma - 1 (initialised to 0) and scale by
    # weight + 1 (megatron_eopt/training/model/norms.py with the local spec; Transformer Engine's norms natively).
    layernorm_zero_centered_gamma: bool = False
    # megatron's --kv-channels: each attention head's width (None: hidden_size // heads).
    kv_channels: int | None = None
    # megatron's --qk-layernorm: a norm (--normalization's kind) on each head's query and key. Its
    # weights are replicated over tensor-parallel ranks but each rank's gradient covers only its
    # heads: the trainer sums them over TP (megatron_eopt/training/parallel/grad_reduction.py), as megatron does by name.
    qk_layernorm: bool = False
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    rotary_base: int = 10000  # RoPE: the base period of its frequencies
    rotary_percent: float = 1.0  # RoPE: the fraction of each head's dimensions it rotates
    rotary_interleaved: bool = False  # RoPE: rotate neighbouring pairs, not the two halves of a head
    rotary_seq_len_interpolation_factor: float | None = None  # RoPE: positions divided by this
    rope_scaling: bool = False  # RoPE: Llama 3.x's scaling of the long wavelengths (megatron's)
    rope_scaling_factor: float = 8.0
    share_embeddings_and_output_weights: bool = False
    # megatron's multi-latent attention (--multi-latent-attention, megatron_eopt/training/model/mla.py): queries from
    # hidden -> q_lora_rank -> heads (or one projection when q_lora_rank is None), keys and values
    # from hidden -> kv_lora_rank (+ the shared RoPE key part) -> heads; each head's query/key is
    # qk_head_dim wide plus qk_pos_emb_head_dim rotated by RoPE ("rope") or YaRN ("yarn", with
    # rotary_scaling_factor, mscale, mscale_all_dim), its value v_head_dim. Megatron-LM's
    # defaults; MLATransformerConfig's fields of the same names.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: Literal["rope", "yarn"] = "yarn"
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    # megatron's --init-method-xavier-uniform: every weight (embeddings too) drawn U(-a, a),
    # a = sqrt(6 / (fan_in + fan_out)) of the full matrix, instead of N(0, init_method_std).
    init_method_xavier_uniform: bool = False
    embedding_init_method_std: float | None = None  # megatron's: the embeddings' N(0, std) (None: init_method_std)
    # Initialise full weights on CPU and slice each rank's shard, so a model is identical
    # across tensor-parallel degrees for the same seed (megatron's --use-cpu-initialization).
    cpu_initialization: bool = True
    # QK-clip (megatron-core's TransformerConfig fields): the attention records its maximum
    # logits when either flag is set; the optimizer reads the same fields.
    qk_clip: bool = False
    qk_clip_threshold: float = 100.0
    qk_clip_alpha: float = 0.5
    log_max_attention_logit: bool = False
    # megatron's --transformer-impl: "auto" (Transformer Engine on CUDA when installed), "local"
    # or "transformer_engine" (required); see gpt_layer_spec.
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    # megatron's activation recompute: "full" recomputes whole layers in backward (recompute_method
    # "uniform": groups of recompute_num_layers layers; "block": the first recompute_num_layers of
    # each stage), "selective" the core attention. Dropout draws the same masks again (megatron's
    # checkpoint restores the RNG states; megatron_eopt/training/parallel/cpu_rng.py on CPU). megatron's TransformerConfig
    # checks the combination.
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    # With "selective": the submodules recomputed (megatron's recompute_modules; None: its default,
    # the core attention). "core_attn", "mlp" and "moe" are checkpointed, "layernorm" recomputed
    # with its output discarded.
    recompute_modules: tuple[str, ...] | None = None
    distribute_saved_activations: bool = False  # full recompute at TP > 1, CUDA only
    # megatron's --sequence-parallel (megatron_eopt/training/parallel/sequence_parallel.py): activations outside attention
    # and the MLP split along the sequence over the tensor-parallel ranks. Ignored at TP=1, as in
    # megatron; the trainer sums the tagged norm gradients over TP (sum_grads_over_tensor_parallel).
    sequence_parallel: bool = False
    # Mixture of experts (megatron-core's MoELayer, SequentialMLP experts; megatron_eopt/training/model/moe.py):
    # None: a dense MLP. The other fields are megatron-core TransformerConfig's, same names and
    # meaning (lists as tuples: the settings are frozen); megatron_eopt/training/arguments/moe.py checks them.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"  # alltoall: CUDA only
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size, as megatron's default
    moe_layer_freq: int | tuple[int, ...] = 1  # every Nth layer MoE, or 1 (MoE) / 0 (dense) per layer
    # Load balancing: one type, or several each with its aux-loss coefficient.
    moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss"
    moe_aux_loss_coeff: float | tuple[float, ...] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (megatron_eopt/training/model/moe.py's finish_router_step)
    moe_router_bias_update_rate: float = 1e-3
    # Routing: score function, top-k scaling, softmax before top-k, router precision,
    # group-limited routing, input jitter.
    moe_router_score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_router_pre_softmax: bool = False
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_input_jitter_eps: float | None = None
    # Shared experts (megatron's SharedExpertMLP), optionally behind a sigmoid gate.
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # Token dropping: capacity per expert, padding to it, and which tokens go.
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    # megatron's --pipeline-model-parallel-layout, e.g. "Et*2|L": embedding and two layers on
    # the first stage, only the final norm and output layer (L) on the last. None: an even split.
    pipeline_model_parallel_layout: str | None = None
    # megatron's other ways to split layers unevenly over stages (exclusive with a layout).
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "seq_length", "vocab_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{{{name}}} must be positive", **{name: getattr(self, name)})
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise SettingsError("{kv_channels} must be positive", kv_channels=self.kv_channels)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise SettingsError("{hidden_size} must be divisible by {num_attention_heads}",
                                hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads)
        groups = self.query_groups
        if groups <= 0 or self.num_attention_heads % groups:
            raise SettingsError("{num_attention_heads} must be divisible by {num_query_groups}",
                                num_attention_heads=self.num_attention_heads, num_query_groups=groups)
        if self.max_positions < self.seq_length:
            raise SettingsError("{max_position_embeddings} must be >= {seq_length}",
                                max_position_embeddings=self.max_positions, seq_length=self.seq_length)
        if self.activation not in ("gelu", "squared_relu", "quick_geglu"):
            raise SettingsError("{activation} must be gelu, squared_relu or quick_geglu", activation=self.activation)
        if self.swiglu and self.activation != "gelu":
            raise SettingsError("{swiglu} and {activation} exclude each other", swiglu=True, activation=self.activation)
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise SettingsError("{normalization} must be LayerNorm or RMSNorm", normalization=self.normalization)
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise SettingsError("{position_embedding_type} must be learned_absolute, rope or none",
                                position_embedding_type=self.position_embedding_type)
        if not 0.0 < self.rotary_percent <= 1.0:
            raise SettingsError("{rotary_percent} must be in (0, 1]", rotary_percent=self.rotary_percent)
        if self.rotary_base < 1:
            raise SettingsError("{rotary_base} must be >= 1", rotary_base=self.rotary_base)
        for name in ("rotary_seq_len_interpolation_factor", "rope_scaling_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SettingsError(f"{{{name}}} must be a finite number > 0", **{name: value})
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise SettingsError(f"{{{name}}} must be in [0, 1)", **{name: getattr(self, name)})
        if not (math.isfinite(self.layernorm_epsilon) and self.layernorm_epsilon > 0.0):
            raise SettingsError("{layernorm_epsilon} must be a finite number > 0", layernorm_epsilon=self.layernorm_epsilon)
        if self.bf16 and self.fp16:
            raise SettingsError("{bf16} and {fp16} exclude each other", bf16=True, fp16=True)
        for name in ("init_method_std", "embedding_init_method_std"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0.0):
                raise SettingsError(f"{{{name}}} must be a finite number > 0", **{name: value})
        if self.multi_latent_attention:
            self._check_multi_latent_attention()

    def _check_multi_latent_attention(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{{{name}}} must be positive", **{name: getattr(self, name)})
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise SettingsError("{q_lora_rank} must be positive (or unset: no query compression)",
                                q_lora_rank=self.q_lora_rank)
        if self.qk_pos_emb_head_dim % 2:
            raise SettingsError("{qk_pos_emb_head_dim} must be even (RoPE rotates pairs)",
                                qk_pos_emb_head_dim=self.qk_pos_emb_head_dim)
        if self.rope_type not in ("rope", "yarn"):
            raise SettingsError("{rope_type} must be rope or yarn", rope_type=self.rope_type)
        if not (math.isfinite(self.rotary_scaling_factor) and self.rotary_scaling_factor > 0):
            raise SettingsError("{rotary_scaling_factor} must be a finite number > 0",
                                rotary_scaling_factor=self.rotary_scaling_factor)
        for name in ("mscale", "mscale_all_dim"):
            if not math.isfinite(getattr(self, name)):
                raise SettingsError(f"{{{name}}} must be a finite number", **{name: getattr(self, name)})
        if self.num_query_groups is not None and self.num_query_groups != self.num_attention_heads:
            raise SettingsError("{num_query_groups} does not apply with {multi_latent_attention} (every head has "
                                "its own key and value)", num_query_groups=self.num_query_groups,
                                multi_latent_attention=True)

    @property
    def gated(self) -> bool:
        return self.swiglu or self.activation == "quick_geglu"

    @property
    def activation_func(self) -> Any:
        """megatron's activations; SwiGLU is a gated unit with SiLU (megatron's default would give GeGLU)."""
        if self.swiglu:
            return F.silu
        return {"gelu": F.gelu, "squared_relu": squared_relu, "quick_geglu": quick_gelu}[self.activation]

    @property
    def query_groups(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def max_positions(self) -> int:
        if self.max_position_embeddings is None:
            return self.seq_length
        return self.max_position_embeddings

    @property
    def params_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        return torch.float16 if self.fp16 else torch.float32

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise SettingsError (a ValueError) if the model cannot be split over ``tp`` ranks."""
        for name, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
            ("moe_ffn_hidden_size", self.moe_ffn_hidden_size or 0),
            ("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size or 0),
        ):
            if value % tp:
                raise SettingsError(f"{{{name}}} must be divisible by {{tensor_model_parallel_size}}",
                                    **{name: value, "tensor_model_parallel_size": tp})
        if self.multi_latent_attention:
            self._check_mla_tensor_parallel(tp)
        if self.sequence_parallel and self.seq_length % tp:
            raise SettingsError("{seq_length} must be divisible by {tensor_model_parallel_size} with sequence parallelism",
                                seq_length=self.seq_length, tensor_model_parallel_size=tp)
        if self.num_moe_experts is not None and tp > 1 and not self.sequence_parallel:  # megatron's MoELayer refuses it
            raise SettingsError("{num_moe_experts} with {tensor_model_parallel_size} needs {sequence_parallel}",
                                num_moe_experts=self.num_moe_experts, tensor_model_parallel_size=tp,
                                sequence_parallel=self.sequence_parallel)


    def _check_mla_tensor_parallel(self, tp: int) -> None:
        """megatron's local spec splits the down-projections' outputs over TP too."""
        if self.q_lora_rank is not None and self.q_lora_rank % tp:
            raise SettingsError("{q_lora_rank} must be divisible by {tensor_model_parallel_size}",
                                q_lora_rank=self.q_lora_rank, tensor_model_parallel_size=tp)
        if (self.kv_lora_rank + self.qk_pos_emb_head_dim) % tp:
            raise SettingsError("{kv_lora_rank} + {qk_pos_emb_head_dim} must be divisible by "
                                "{tensor_model_parallel_size}", kv_lora_rank=self.kv_lora_rank,
                                qk_pos_emb_head_dim=self.qk_pos_emb_head_dim, tensor_model_parallel_size=tp)


def initialize_model_parallel(
    tensor_model_parallel_size: int,
    seed: int,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
) -> None:
    """Set up megatron's model-parallel groups and seed the RNGs.

    torch.distributed must already be initialised; its world size must be a multiple of
    ``tensor_model_parallel_size * pipeline_model_parallel_size`` (the rest becomes data
    parallelism). ``virtual_pipeline_model_parallel_size``: model chunks per rank (interleaved
    pipeline; build them with :func:`build_gpt_model_chunks`). Experts are split over
    ``expert_model_parallel_size`` ranks of the data-parallel ranks (megatron's layout).
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(gloo works on CPU) before initialize_model_parallel"
        )
    world_size = torch.distributed.get_world_size()
    _check_parallel_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                          virtual_pipeline_model_parallel_size, expert_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("model parallel state is already initialised; destroy it first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    # CPU initialisation draws from torch's default generator, on every device.
    global _init_seed
    _init_seed = seed
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        # Megatron's seeding also sets up the per-TP-rank CUDA RNG streams used by dropout;
        # it calls CUDA, hence only when CUDA is there.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:  # the same per-TP-rank stream on the CPU generator (megatron_eopt/training/parallel/cpu_rng.py)
        use_cpu_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank())


# The seed of the last initialize_model_parallel: build_gpt_model seeds each model chunk and each
# transformer layer from it (see _LayerSeededTransformerLayer).
_init_seed: int | None = None


class _LayerSeededTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer that reseeds the default generator after its initialisation,
    with the seed and its global layer number.

    With CPU initialisation the weights are drawn from one generator in construction order, so
    without this a pipeline stage's layers would start where that stage's generator is, not
    where the PP=1 model's is. With it, build_gpt_model seeds a chunk as the PP=1 model's
    generator stands after the layers before it (seed + their count), and every layer, the
    embedding and the output layer get the same weights in every pipeline layout.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _init_seed is not None:
            torch.manual_seed(_init_seed + self.layer_number)


def _check_parallel_sizes(world_size: int, tp: int, pp: int, vpp: int | None, ep: int) -> None:
    if tp <= 0 or pp <= 0 or world_size % (tp * pp):
        raise ValueError(
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) must be "
            f"positive and divide the world size ({world_size})"
        )
    if ep <= 0 or (world_size // (tp * pp)) % ep:
        raise ValueError(
            f"expert_model_parallel_size ({ep}) must be positive and divide the data-parallel "
            f"size ({world_size // (tp * pp)})"
        )
    if vpp is not None and (vpp < 1 or pp == 1):
        raise ValueError(
            f"virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1 "
            f"(got {pp}) and must be >= 1; pass None for one model chunk per rank"
        )


def destroy_model_parallel() -> None:
    """Tear down megatron's model-parallel groups (torch.distributed stays initialised)."""
    parallel_state.destroy_model_parallel()


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
    tp = parallel_state.get_tensor_model_parallel_world_size()
    settings.check_tensor_parallel(tp)
    sequence_parallel = settings.sequence_parallel and tp > 1
    config_class = MLATransformerConfig if settings.multi_latent_attention else TransformerConfig
    config = config_class(
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        num_attention_heads=settings.num_attention_heads,
        num_query_groups=settings.query_groups,
        ffn_hidden_size=settings.ffn_hidden_size,
        gated_linear_unit=settings.gated,
        activation_func=settings.activation_func,
        normalization=settings.normalization,
        layernorm_zero_centered_gamma=settings.layernorm_zero_centered_gamma,
        kv_channels=settings.kv_channels,
        qk_layernorm=settings.qk_layernorm,
        rotary_interleaved=settings.rotary_interleaved,
        add_bias_linear=settings.add_bias_linear,
        add_qkv_bias=settings.add_qkv_bias or settings.add_bias_linear,
        layernorm_epsilon=settings.layernorm_epsilon,
        hidden_dropout=settings.hidden_dropout,
        attention_dropout=settings.attention_dropout,
        init_method_std=settings.init_method_std,
        embedding_init_method_std=settings.embedding_init_method_std,
        **_xavier_init(settings),
        bf16=settings.bf16,
        fp16=settings.fp16,
        params_dtype=settings.params_dtype,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        # On CPU there is no other way: megatron's GPU initialisation calls CUDA.
        use_cpu_initialization=settings.cpu_initialization or device.type != "cuda",
        qk_clip=settings.qk_clip,
        qk_clip_threshold=settings.qk_clip_threshold,
        qk_clip_alpha=settings.qk_clip_alpha,
        log_max_attention_logit=settings.log_max_attention_logit,
        sequence_parallel=sequence_parallel,
        recompute_granularity=settings.recompute_granularity,
        recompute_method=settings.recompute_method,
        recompute_num_layers=settings.recompute_num_layers,
        recompute_modules=None if settings.recompute_modules is None else list(settings.recompute_modules),
        distribute_saved_activations=settings.distribute_saved_activations,
        **_pipeline_config(settings),
        **_expert_config(settings),
        **mla_config_fields(settings),
    )
    model_class = GPTModel if device.type == "cuda" else _CPUTiedEmbeddingGPTModel
    layer_spec = _stage_block_spec(settings, config, vp_stage, device.type == "cuda",
                                   local_norms=sequence_parallel or settings.layernorm_zero_centered_gamma)
    if _init_seed is not None:  # see _LayerSeededTransformerLayer
        torch.manual_seed(_init_seed + get_transformer_layer_offset(config, vp_stage))
    if sequence_parallel and device.type != "cuda":
        install_cpu_sequence_parallel()
    model = model_class(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=settings.vocab_size,
        max_sequence_length=settings.max_positions,
        share_embeddings_and_output_weights=settings.share_embeddings_and_output_weights,
        position_embedding_type=settings.position_embedding_type,
        rotary_base=settings.rotary_base,
        rotary_percent=settings.rotary_percent,
        seq_len_interpolation_factor=settings.rotary_seq_len_interpolation_factor,
        rope_scaling=settings.rope_scaling,
        rope_scaling_factor=settings.rope_scaling_factor,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )
    # Some local-spec modules (torch norms) ignore params_dtype; megatron's Float16Module casts
    # the whole model the same way for bf16 training. Parameters keep megatron's attributes.
    return model.to(device=device, dtype=settings.params_dtype)


def _stage_block_spec(settings: GPTModelSettings, config: TransformerConfig, vp_stage: int | None, use_cuda: bool,
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
        if spec.module is TransformerLayer and _init_seed is not None:
            spec = dataclasses.replace(spec, module=_LayerSeededTransformerLayer)
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
        moe_grouped_gemm=False,
        **{name: list(value) if isinstance(value, tuple) else value for name, value in fields.items()},
    )


class _CPURotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding without the move of its inverse frequencies to
    ``torch.cuda.current_device()`` at the first forward (``get_emb``): the same angles,
    position x inverse frequency, each used by two components (the two halves of a head, or
    neighbouring pairs with ``rotary_interleaved``), ``[seq, 1, 1, head_dim]``."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        angles = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((angles, angles), dim=-1)
        return emb[:, None, None, :]


class _CPUTiedEmbeddingGPTModel(GPTModel):
    """GPTModel whose tied-embedding set-up and rotary embedding also run on CPU.

    With tied embeddings and a pipeline, megatron-core zeroes the last stage's output-layer
    copy and all-reduces it with the first stage's embedding over the embedding group, but
    first moves the weight with ``.cuda()`` (language_module.py). This substitution does the
    same all-reduce where the weight is; on one stage it changes nothing. RoPE's frequencies
    stay where the model is (:class:`_CPURotaryEmbedding`).
    """

    _syncing_embeddings_here = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(getattr(self, "rotary_pos_emb", None)) is RotaryEmbedding:
            self.rotary_pos_emb.__class__ = _CPURotaryEmbedding
        if self.config.sequence_parallel:
            use_cpu_sequence_parallel_linears(self)

    def setup_embeddings_and_output_layer(self) -> None:
        self._syncing_embeddings_here = True  # hides the embedding group from megatron's CUDA copy
        try:
            super().setup_embeddings_and_output_layer()
        finally:
            self._syncing_embeddings_here = False
        if torch.distributed.is_initialized() and self._is_in_embd_group():
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=self.embd_group)

    def _is_in_embd_group(self) -> bool:
        return not self._syncing_embeddings_here and super()._is_in_embd_group()


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
