"""``GPTModelSettings``: the shape and options of the GPT model, checked when made.

The fields are Megatron-LM's model flags under megatron-core's ``TransformerConfig`` names;
``transformer_config.py`` turns them into that config. A setting the model cannot be built with
raises :class:`SettingsError`, whose message a front end can re-word in its own option names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported where it is used: the flag checks make settings before torch
    import torch

__all__ = ["GPTModelSettings", "SettingsError"]


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
        import torch.nn.functional as F
        from megatron.core.activations import quick_gelu, squared_relu

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
        import torch

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

