"""Which weights are fused, and their blocks: one table that every Muon consumer reads.

A fused weight packs several matrices into one linear layer's weight (q/k/v, SwiGLU's gate and
up, MLA's heads, Mamba's [z, x, B, C, dt]); Muon orthogonalizes each separately. The table maps
(type of the module holding the linear layer, the layer's attribute) to a function that reads
the blocks from that module and its TransformerConfig, from what megatron-core records (GDN's
`in_proj_split_sections`, Mamba's per-part sizes, MLA's config fields). Types match by qualified
name through the MRO: no megatron-core import here, and subclasses inherit their base's entry.
`register_fused_layout` declares a custom module's layout. Without an owner module (the
planner) `linear_qkv`, `linear_fc1` and MLA's projections are found by name. Megatron-core's
`partition_sizes` on a weight no entry describes splits it. The table also holds `transformers`'
and torchtitan's fused and stacked weights, each read from its family's forward (docs/fsdp2.md).
A 2-D weight that still looks fused (`FUSED_NAME`, `partition_stride > 1`, or an entry that cannot
read its facts) stays whole, and the build names it (params/groups.py: routing_fallbacks).
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from megatron_eopt.ops.splits import MatrixBatch, qkv_row_blocks, tensor_parallel_rank_shape
from megatron_eopt.runtime.once import warn_once


@dataclass(frozen=True)
class FusedWeight:
    """What a layout function reads: one linear layer's weight and the module that holds it."""

    fqn: str  # for messages
    param: torch.Tensor  # this rank's shard
    owner: Optional[torch.nn.Module]  # holds the linear layer as `attribute`; None: known by name only
    attribute: str  # e.g. 'linear_kv_up_proj'
    model_config: Any  # the owner's TransformerConfig (or its chunk's)
    tp_size: int  # ranks sharding its rows: the TP size for a column-parallel weight, else 1
    split_qkv: bool = True
    per_head: bool = False


@dataclass(frozen=True)
class FusedBlocks:
    """The blocks of a fused weight, as MatrixLayout's fields (ops/splits.py); () is one matrix."""

    row_blocks: tuple[int, ...] = ()
    num_row_groups: int = 1
    head_rows: int = 0
    per_group: bool = False
    tp_contiguous: bool = False
    batch: Optional[MatrixBatch] = None  # an N-D tensor of matrices (experts), one row group each


WHOLE = FusedBlocks()
LayoutFunction = Callable[[FusedWeight], Optional[FusedBlocks]]  # None: its facts are missing

_TABLE: dict[tuple[str, str], LayoutFunction] = {}
# Linear layers stored [in, out] (their forward is `x @ weight`): one matrix, transposed.
STORED_IN_OUT = frozenset({"transformers.pytorch_utils.Conv1D"})


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_fused_layout(module_type: Union[type, str], attribute: str, function: LayoutFunction) -> None:
    """Declare that `module_type`'s linear layer (or list of them) `attribute` has the blocks `function` returns.

    `module_type` is a class or its qualified name ('package.module.Class'); subclasses match
    too. A later registration of the same pair replaces the earlier one.
    """
    name = module_type if isinstance(module_type, str) else qualified_name(module_type)
    if not isinstance(name, str) or "." not in name or not attribute or not callable(function):
        raise TypeError(f"register_fused_layout takes a class (or its qualified name 'module.Class'), an attribute "
                        f"name and a function of a FusedWeight; got {module_type!r}, {attribute!r}, {function!r}.")
    _TABLE[(name, attribute)] = function


def registered_function(owner: Optional[torch.nn.Module], attribute: str) -> Optional[LayoutFunction]:
    """The table's function for `owner.attribute` (through owner's MRO); by name without owner."""
    if owner is None:
        return _BY_NAME.get(attribute)
    if is_transformers_experts(owner):
        return transformers_experts
    for cls in type(owner).__mro__:
        function = _TABLE.get((qualified_name(cls), attribute))
        if function is not None:
            return function
    return None


def fused_blocks(weight: FusedWeight) -> FusedBlocks:
    """The blocks of one 2-D weight (WHOLE when it is one matrix); warns once when it looks fused
    but nothing describes it."""
    function = registered_function(weight.owner, weight.attribute)
    if function is None and weight.owner is not None and weight.attribute in _BY_NAME \
            and not _known_type(weight.owner):
        function = _BY_NAME[weight.attribute]  # megatron-core's names in a module of its own
    if function is not None:
        blocks = function(weight)
        if blocks is not None:
            return blocks
        _warn_unknown(weight, f"its {type(weight.owner).__name__} lacks the facts its layout reads")
        return WHOLE
    sizes = getattr(weight.param, "partition_sizes", None)
    if sizes:  # megatron-core's record of parts each sharded over TP (Mamba's in_proj)
        return FusedBlocks(tuple(int(s) for s in sizes))
    if int(getattr(weight.param, "partition_stride", 1)) > 1:
        _warn_unknown(weight, f"it has partition_stride={weight.param.partition_stride}")
    if qualified_name(type(getattr(weight.owner, weight.attribute, None))) in STORED_IN_OUT and weight.param.dim() == 2:
        return stored_in_out_blocks(weight.param, (weight.param.shape[1],))
    return WHOLE


def stored_in_out_blocks(param: torch.Tensor, row_blocks: tuple[int, ...]) -> FusedBlocks:
    """A weight stored [in, out] whose [out, in] view (megatron-core's orientation) has `row_blocks`."""
    return FusedBlocks(row_blocks, 1, per_group=True, batch=MatrixBatch(tuple(param.shape), transposed=True))


def _known_type(owner: torch.nn.Module) -> bool:
    names = {qualified_name(cls) for cls in type(owner).__mro__}
    return any(name in names for name, _ in _TABLE)


def _warn_unknown(weight: FusedWeight, why: str) -> None:
    warn_once(f"unknown_fused_weight:{weight.fqn}",
              f"Muon orthogonalizes {weight.fqn!r} as one matrix, but {why}, so it may pack several; "
              f"declare its blocks with megatron_eopt.params.fused_layouts.register_fused_layout.")


# --- megatron-core's fused weights -------------------------------------------------------------

def attention_qkv(weight: FusedWeight) -> FusedBlocks:
    """linear_qkv: per query group (q[, gate], k, v); per head with `per_head`."""
    if not weight.split_qkv:
        return WHOLE
    if weight.model_config is None:
        raise ValueError(
            f"parameter {weight.fqn!r} is a fused QKV weight; splitting it needs the TransformerConfig of its "
            f"model chunk (`.config` with num_attention_heads, num_query_groups, kv_channels), which the chunk "
            f"lacks. Set OptimizerConfig.muon_split_qkv=False to orthogonalize it whole."
        )
    groups, blocks = qkv_row_blocks(weight.model_config, weight.tp_size, weight.fqn)
    return FusedBlocks(blocks, groups, head_rows=blocks[-1] if weight.per_head else 0)


def mlp_fc1(weight: FusedWeight) -> FusedBlocks:
    """linear_fc1 of a gated linear unit: gate and up halves (partition_stride=2: each sharded)."""
    if not getattr(weight.model_config, "gated_linear_unit", False):
        return WHOLE
    half = tensor_parallel_rank_shape(weight.param)[0] // 2
    return FusedBlocks((half, half))


def _per_head(weight: FusedWeight, head_parts: tuple[int, ...]) -> FusedBlocks:
    rows = tensor_parallel_rank_shape(weight.param)[0]
    if rows % sum(head_parts):
        raise ValueError(f"parameter {weight.fqn!r}: {rows} rows on this rank are not whole heads of "
                         f"{'+'.join(map(str, head_parts))} rows.")
    return FusedBlocks(head_parts, rows // sum(head_parts), per_group=True)


def mla_query_up(weight: FusedWeight) -> FusedBlocks:
    """linear_q_up_proj (and linear_q_proj without q_lora_rank): one matrix per head, its
    qk_head_dim + qk_pos_emb_head_dim rows (the head's query and its rotary query)."""
    config = weight.model_config
    return _per_head(weight, (config.qk_head_dim + config.qk_pos_emb_head_dim,))


def mla_kv_up(weight: FusedWeight) -> FusedBlocks:
    """linear_kv_up_proj: per head, its key (qk_head_dim rows) and its value (v_head_dim rows)."""
    config = weight.model_config
    return _per_head(weight, (config.qk_head_dim, config.v_head_dim))


def mla_kv_down(weight: FusedWeight) -> FusedBlocks:
    """linear_kv_down_proj: the compressed KV (kv_lora_rank rows), then the rotary key shared by
    all heads (qk_pos_emb_head_dim rows). Column-parallel (the local spec), TP shards the whole
    matrix, cutting through the parts: `tp_contiguous`."""
    config = weight.model_config
    return FusedBlocks((config.kv_lora_rank, config.qk_pos_emb_head_dim), tp_contiguous=weight.tp_size > 1)


def mamba_in_proj(weight: FusedWeight) -> Optional[FusedBlocks]:
    """MambaMixer.in_proj: [z, x, B, C, dt], each sharded over TP; this rank's sizes as its
    `sharded_state_dict` splits them."""
    mixer = weight.owner
    try:
        d_inner, groups, state, heads = (mixer.d_inner_local_tp, mixer.ngroups_local_tp, mixer.d_state,
                                         mixer.nheads_local_tp)
    except AttributeError:
        return None
    return FusedBlocks((d_inner, d_inner, groups * state, groups * state, heads))


def gated_delta_net_in_proj(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Gated delta net's in_proj: the parts its module records, this rank's sizes
    (`in_proj_split_sections`: query, key, value, z, beta, alpha in megatron-core 0.19), each
    sharded over TP."""
    sections = getattr(weight.owner, "in_proj_split_sections", None)
    return FusedBlocks(tuple(int(s) for s in sections)) if sections else None


def _if_latent_attention(function: LayoutFunction) -> LayoutFunction:
    """`function` by name only where the config says multi-latent attention (names such as
    linear_q_proj are common elsewhere)."""
    return lambda weight: function(weight) if getattr(weight.model_config, "multi_latent_attention", False) else WHOLE


_BY_NAME: dict[str, LayoutFunction] = {
    "linear_qkv": attention_qkv, "linear_fc1": mlp_fc1,
    "linear_q_proj": _if_latent_attention(mla_query_up), "linear_q_up_proj": _if_latent_attention(mla_query_up),
    "linear_kv_down_proj": _if_latent_attention(mla_kv_down), "linear_kv_up_proj": _if_latent_attention(mla_kv_up),
}

for _type, _attribute, _function in (
    ("megatron.core.transformer.attention.Attention", "linear_qkv", attention_qkv),
    ("megatron.core.transformer.mlp.MLP", "linear_fc1", mlp_fc1),
    ("megatron.core.transformer.moe.experts.TEGroupedMLP", "linear_fc1", mlp_fc1),
    ("megatron.core.transformer.multi_latent_attention.MultiLatentAttention", "linear_q_proj", mla_query_up),
    ("megatron.core.transformer.multi_latent_attention.MultiLatentAttention", "linear_q_down_proj", lambda w: WHOLE),
    ("megatron.core.transformer.multi_latent_attention.MultiLatentAttention", "linear_q_up_proj", mla_query_up),
    ("megatron.core.transformer.multi_latent_attention.MultiLatentAttention", "linear_kv_down_proj", mla_kv_down),
    ("megatron.core.transformer.multi_latent_attention.MultiLatentAttention", "linear_kv_up_proj", mla_kv_up),
    ("megatron.core.ssm.mamba_mixer.MambaMixer", "in_proj", mamba_in_proj),
    ("megatron.core.ssm.gated_delta_net.common._GDNBase", "in_proj", gated_delta_net_in_proj),
):
    register_fused_layout(_type, _attribute, _function)


# --- MoE experts stored as one N-D tensor ------------------------------------------------------
# A parameter is a batch of matrices, one per index of its leading dimensions, when the module
# holding it directly is an experts container this table knows: transformers 5's experts
# classes (marked by its `use_experts_implementation` decorator, below) and torchtitan's
# GroupedExperts, or a type declared with `register_fused_layout`. The leading dimensions then
# index experts by construction; nothing is inferred from a shape, so a conv weight or a 3-D
# position table is never read as experts.

def expert_matrices(param: torch.Tensor, transposed: bool = False, row_blocks: tuple[int, ...] = (),
                    interleaved: bool = False) -> FusedBlocks:
    """The layout of an N-D experts tensor: one matrix per expert ([out, in], or [in, out] stored
    `transposed`), split into `row_blocks` (gate and up: two halves), whose rows alternate when
    `interleaved`. For a layout function of a custom experts container."""
    batch = MatrixBatch(tuple(param.shape), transposed, len(row_blocks) if interleaved else 1)
    return FusedBlocks(row_blocks or (batch.matrix_rows,), batch.count, per_group=True, batch=batch)


def is_transformers_experts(module: torch.nn.Module) -> bool:
    """An experts module of `transformers` 5 (Qwen3-MoE's, Mixtral's, ...): its class comes from
    transformers and carries the layout flags that transformers' `use_experts_implementation`
    decorator sets on every experts class it dispatches (`is_transposed`, `is_concatenated`,
    `has_gate`)."""
    return type(module).__module__.startswith("transformers.") and all(
        isinstance(getattr(module, flag, None), bool) for flag in ("is_transposed", "is_concatenated", "has_gate"))


def transformers_experts(weight: FusedWeight) -> Optional[FusedBlocks]:
    """transformers 5's experts tensors, [E, out, in] (or [E, in, out] with `is_transposed`):
    `gate_up_proj` holds gate then up ([gate; up] halves when `is_concatenated`, else alternating
    rows: gate0, up0, ...), `up_proj` (without a gate) and `down_proj` one matrix each. Their
    biases ([E, out]) are no batch of matrices: None."""
    experts, param = weight.owner, weight.param
    if param.dim() < 3:
        return None
    transposed = experts.is_transposed
    if weight.attribute == "gate_up_proj" and experts.has_gate:
        half = (param.shape[-1] if transposed else param.shape[-2]) // 2
        return expert_matrices(param, transposed, (half, half), interleaved=not experts.is_concatenated)
    if weight.attribute in ("gate_up_proj", "up_proj", "down_proj"):
        return expert_matrices(param, transposed)
    return None


def grouped_experts(weight: FusedWeight) -> Optional[FusedBlocks]:
    """torchtitan's GroupedExperts: w1 (gate) and w3 (up) [E, F, D], w2 (down) [E, D, F], each
    expert's matrix [out, in]."""
    return expert_matrices(weight.param) if weight.param.dim() == 3 else None


def expert_batch_blocks(owner: Optional[torch.nn.Module], attribute: str, fqn: str,
                        param: torch.Tensor) -> Optional[FusedBlocks]:
    """The blocks of an N-D parameter `owner.<attribute>` when its owner is an experts container
    the table knows and its layout is a batch of matrices; else None."""
    function = registered_function(owner, attribute) if owner is not None else None
    if function is None:
        return None
    blocks = function(FusedWeight(fqn=fqn, param=param, owner=owner, attribute=attribute, model_config=None,
                                  tp_size=1))
    return blocks if blocks is not None and blocks.batch is not None else None


def is_experts_container(owner: Optional[torch.nn.Module]) -> bool:
    """Whether `owner` holds experts as N-D tensors (its other parameters, e.g. biases [E, out],
    are per-expert vectors: no matrices)."""
    if owner is None:
        return False
    if is_transformers_experts(owner):
        return True
    return any(_TABLE.get((qualified_name(cls), "")) is _EXPERTS_CONTAINER for cls in type(owner).__mro__)


def _experts_container(weight: FusedWeight) -> None:
    return None  # a marker entry: the type holds experts (is_experts_container)


_EXPERTS_CONTAINER: LayoutFunction = _experts_container


def register_experts_container(module_type: Union[type, str], attributes: tuple[str, ...],
                               function: LayoutFunction = grouped_experts) -> None:
    """Declare that `module_type` holds MoE experts as N-D tensors: its parameters `attributes`
    have the layouts `function` returns (by default one [out, in] matrix per leading index), its
    others are per-expert vectors, stepped by the scalar optimizer."""
    for attribute in attributes:
        register_fused_layout(module_type, attribute, function)
    name = module_type if isinstance(module_type, str) else qualified_name(module_type)
    _TABLE[(name, "")] = _EXPERTS_CONTAINER


register_experts_container("torchtitan.models.common.moe.GroupedExperts", ("w1_EFD", "w2_EDF", "w3_EFD"))


# --- transformers' fused projections -----------------------------------------------------------
# Found by the module class that holds the linear layer (the table's key) and its config's head
# counts; docs/fsdp2.md lists which families fuse which weights.

def _head_dim(module: torch.nn.Module) -> Optional[int]:
    """The attention module's head size: its own attribute, else its config's."""
    config = getattr(module, "config", None)
    size = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
    if size is None and config is not None:
        size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return size


def stacked_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Phi-3's qkv_proj: all query heads' rows, then all key heads', then all value heads'."""
    config = getattr(weight.owner, "config", None)
    if not weight.split_qkv:
        return WHOLE
    if config is None:
        return None
    head_dim = _head_dim(weight.owner)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    return FusedBlocks((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
                       head_rows=head_dim if weight.per_head else 0)


def per_head_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """GPT-NeoX's, Bloom's, Persimmon's query_key_value and MiniMax's lightning qkv_proj: per head
    its query, key and value rows (the output viewed [heads, 3, head_dim]), so q, k and v are each
    one block taken from every head."""
    if not weight.split_qkv:
        return WHOLE
    head_dim = _head_dim(weight.owner)
    rows = weight.param.shape[0]
    if not head_dim or rows % (3 * head_dim):
        return None
    return FusedBlocks((head_dim,) * 3, rows // (3 * head_dim), head_rows=head_dim if weight.per_head else 0)


def gate_up_halves(weight: FusedWeight) -> FusedBlocks:
    """A gated MLP's gate_up_proj ([gate; up], chunked in two): gate and up separately."""
    half = weight.param.shape[0] // 2
    return FusedBlocks((half, half))


for _type, _attribute, _function in (
    ("transformers.models.phi3.modeling_phi3.Phi3Attention", "qkv_proj", stacked_qkv),
    ("transformers.models.phi3.modeling_phi3.Phi3MLP", "gate_up_proj", gate_up_halves),
    ("transformers.models.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAttention", "qkv_proj", stacked_qkv),
    ("transformers.models.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalMLP", "gate_up_proj",
     gate_up_halves),
    ("transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention", "query_key_value", per_head_qkv),
    ("transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention", "query_key_value",
     per_head_qkv),
    ("transformers.models.bloom.modeling_bloom.BloomAttention", "query_key_value", per_head_qkv),
    ("transformers.models.persimmon.modeling_persimmon.PersimmonAttention", "query_key_value", per_head_qkv),
    ("transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention", "qkv_proj", per_head_qkv),
    ("transformers.models.glm.modeling_glm.GlmMLP", "gate_up_proj", gate_up_halves),
    ("transformers.models.glm4.modeling_glm4.Glm4MLP", "gate_up_proj", gate_up_halves),
):
    register_fused_layout(_type, _attribute, _function)


# --- weights kept whole on purpose, and names that mark a weight as fused -----------------------

def whole_because(reason: str) -> LayoutFunction:
    """A table entry for a weight that is one matrix on purpose (or whose layout is not a split
    into rows): Muon orthogonalizes it whole, and the build names it in no fallback line."""
    def whole(weight: FusedWeight) -> FusedBlocks:
        return WHOLE

    whole.reason = reason  # docs/fsdp2.md lists them
    return whole


# An attribute name that marks a 2-D weight as packing several matrices. A weight so named that no
# table entry describes goes to Muon whole, and the build names it (groups.routing_fallbacks).
FUSED_NAME = re.compile(r"qkv|query_key_value|c_attn|gate_up|w13|^in_proj(?!_[abz]$)|kv_a_proj|kv_b_proj|q_b_proj|wkv"
                        r"|mlp1_weight", re.IGNORECASE)


def is_described(owner: Optional[torch.nn.Module], attribute: str) -> bool:
    """Whether the table says what `owner.<attribute>` holds (split, or whole on purpose)."""
    if registered_function(owner, attribute) is not None:
        return True
    return owner is not None and attribute in _BY_NAME and not _known_type(owner)


def unknown_fused_name(owner: Optional[torch.nn.Module], attribute: str) -> bool:
    """A 2-D weight named like a fused one that no table entry describes."""
    return bool(FUSED_NAME.search(attribute)) and not is_described(owner, attribute)


# --- torchtitan 0.3's fused weights ------------------------------------------------------------

def torchtitan_fused_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """FusedQKVLinear.wqkv (torchtitan/models/common/attention.py, its forward): the rows viewed
    [n_kv_heads, heads_per_kv + 2, head_dim], split [heads_per_kv, 1, 1]: per KV group its query
    heads, its key and its value, megatron-core's linear_qkv layout."""
    owner = weight.owner
    if not weight.split_qkv:
        return WHOLE
    try:
        per_kv, head_dim = int(owner.heads_per_kv), int(owner.head_dim)
    except (AttributeError, TypeError):
        return None
    group_rows = (per_kv + 2) * head_dim
    rows = weight.param.shape[0]
    if rows % group_rows:
        return None
    return FusedBlocks((per_kv * head_dim, head_dim, head_dim), rows // group_rows,
                       head_rows=head_dim if weight.per_head else 0)


def _latent_facts(owner: torch.nn.Module) -> Optional[tuple[int, int, int, int]]:
    """(qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank) of an MLA module."""
    try:
        return tuple(int(getattr(owner, name)) for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                            "kv_lora_rank"))
    except (AttributeError, TypeError):
        return None


def _whole_heads(weight: FusedWeight, head_parts: tuple[int, ...]) -> Optional[FusedBlocks]:
    rows = weight.param.shape[0]
    return None if rows % sum(head_parts) else FusedBlocks(head_parts, rows // sum(head_parts), per_group=True)


def latent_query(weight: FusedWeight) -> Optional[FusedBlocks]:
    """MLA's query projection (with or without a LoRA down projection before it): the output
    viewed [heads, qk_nope_head_dim + qk_rope_head_dim], one matrix per head, as megatron-core's
    linear_q_up_proj."""
    facts = _latent_facts(weight.owner)
    return None if facts is None else _whole_heads(weight, (facts[0] + facts[1],))


def latent_kv_down(weight: FusedWeight) -> Optional[FusedBlocks]:
    """MLA's KV down projection: the compressed KV (kv_lora_rank rows), then the rotary key shared
    by all heads (qk_rope_head_dim rows), as megatron-core's linear_kv_down_proj."""
    facts = _latent_facts(weight.owner)
    return None if facts is None else FusedBlocks((facts[3], facts[1]))


def latent_kv_up(weight: FusedWeight) -> Optional[FusedBlocks]:
    """MLA's KV up projection: the output viewed [heads, qk_nope_head_dim + v_head_dim], per head
    its key then its value, as megatron-core's linear_kv_up_proj."""
    facts = _latent_facts(weight.owner)
    return None if facts is None else _whole_heads(weight, (facts[0], facts[2]))


_TITAN_MLA = "torchtitan.models.deepseek_v3.model.Attention"  # DeepSeek-V3 and Kimi K2.x (its subclass model)
for _attribute, _function in (("wq", latent_query), ("wq_b", latent_query), ("wkv_a", latent_kv_down),
                              ("wkv_b", latent_kv_up),
                              ("wq_a", whole_because("MLA's query down projection: one matrix"))):
    register_fused_layout(_TITAN_MLA, _attribute, _function)
register_fused_layout("torchtitan.models.common.attention.FusedQKVLinear", "wqkv", torchtitan_fused_qkv)


def interleaved_gate_up_experts(weight: FusedWeight) -> Optional[FusedBlocks]:
    """torchtitan GPT-OSS's mlp1_weight_EGD [E, 2F, D]: its forward's swiglu takes gate = rows
    0, 2, 4, ... and up = rows 1, 3, 5, ... of each expert's [out, in] matrix."""
    param = weight.param
    if param.dim() != 3:
        return None
    half = param.shape[-2] // 2
    return expert_matrices(param, row_blocks=(half, half), interleaved=True)


register_experts_container("torchtitan.models.gpt_oss.moe.GptOssGroupedExperts", ("mlp2_weight_EDF",))
register_fused_layout("torchtitan.models.gpt_oss.moe.GptOssGroupedExperts", "mlp1_weight_EGD",
                      interleaved_gate_up_experts)


# --- transformers 5.24's fused weights, read from each family's forward ------------------------

def gated_delta_qkvz(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Qwen3-Next's in_proj_qkvz (fix_query_key_value_ordering): the rows viewed [num_k_heads,
    2 * head_k_dim + 2 * head_v_dim * num_v_heads / num_k_heads], per key head its query, key,
    value and z rows. Split as megatron-core's gated delta net splits in_proj: q, k, v, z."""
    owner = weight.owner
    try:
        k_heads, v_per_k = int(owner.num_k_heads), int(owner.num_v_heads) // int(owner.num_k_heads)
        k_dim, v_dim = int(owner.head_k_dim), int(owner.head_v_dim)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return FusedBlocks((k_dim, k_dim, v_per_k * v_dim, v_per_k * v_dim), k_heads)


def gated_delta_ba(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Qwen3-Next's in_proj_ba: per key head num_v_heads / num_k_heads rows of beta, then of alpha."""
    owner = weight.owner
    try:
        k_heads, v_per_k = int(owner.num_k_heads), int(owner.num_v_heads) // int(owner.num_k_heads)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return FusedBlocks((v_per_k, v_per_k), k_heads)


def gated_delta_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Qwen3.5's in_proj_qkv: split [key_dim, key_dim, value_dim] after its convolution: q, k, v."""
    try:
        key_dim, value_dim = int(weight.owner.key_dim), int(weight.owner.value_dim)
    except (AttributeError, TypeError):
        return None
    return FusedBlocks((key_dim, key_dim, value_dim))


def thirds_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """A vision tower's qkv, reshaped (..., 3, heads, head_dim) in its forward: q, k and v are the
    first, second and last third of the rows."""
    rows = weight.param.shape[0]
    if not weight.split_qkv:
        return WHOLE
    return None if rows % 3 else FusedBlocks((rows // 3,) * 3)


def stacked_expert_rows(weight: FusedWeight) -> Optional[FusedBlocks]:
    """DBRX's DbrxExpertGLU w1, v1 and w2, 2-D [experts * ffn, hidden]: each expert's ffn rows one
    matrix (w1 and v1 are [out, in] per expert, w2 [in, out]: its forward multiplies by w2 itself)."""
    experts = getattr(weight.owner, "moe_num_experts", None)
    rows = weight.param.shape[0]
    if not experts or rows % int(experts):
        return None
    return FusedBlocks((rows // int(experts),), int(experts), per_group=True)


def transposed_halves_experts(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Llama 4's Llama4TextExperts: gate_up_proj [E, hidden, 2F] and down_proj [E, F, hidden] are
    [in, out] per expert (its forward's bmm); gate_up's output chunks into gate, then up."""
    param = weight.param
    if param.dim() != 3:
        return None
    if weight.attribute == "gate_up_proj":
        return expert_matrices(param, transposed=True, row_blocks=(param.shape[-1] // 2,) * 2)
    return expert_matrices(param, transposed=True)


def halves_experts(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Step3p7's experts: gate_up_proj [E, 2F, hidden] (its _apply_gate chunks gate, then up),
    down_proj [E, hidden, F], [out, in] per expert (F.linear)."""
    param = weight.param
    if param.dim() != 3:
        return None
    if weight.attribute == "gate_up_proj":
        return expert_matrices(param, row_blocks=(param.shape[-2] // 2,) * 2)
    return expert_matrices(param)


def jetmoe_experts(weight: FusedWeight) -> Optional[FusedBlocks]:
    """JetMoe's JetMoeParallelExperts.weight [E, out, in] (F.linear per expert). The MLP's
    input_linear (`mlp.input_linear`) holds gate, then up (its forward chunks in two); the
    attention's experts (JetMoeMoA) and output_linear hold one matrix per expert."""
    param = weight.param
    if param.dim() != 3:
        return None
    if weight.fqn.endswith("mlp.input_linear.weight"):
        return expert_matrices(param, row_blocks=(param.shape[-2] // 2,) * 2)
    return expert_matrices(param)


_MLA = {"q_proj": latent_query, "q_b_proj": latent_query, "kv_a_proj_with_mqa": latent_kv_down,
        "kv_b_proj": latent_kv_up}
# Attention modules whose forward is DeepSeek-V3's MLA (checked per family: kv_a_proj_with_mqa's
# output split [kv_lora_rank, qk_rope_head_dim], kv_b_proj's viewed per head and split
# [qk_nope_head_dim, v_head_dim], the query viewed per head of qk_head_dim).
_MLA_FAMILIES = (
    "axk1.modeling_axk1.AXK1Attention", "bailing_hybrid.modeling_bailing_hybrid.BailingHybridAttention",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention", "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention",
    "dots3_note.modeling_dots3_note.Dots3NoteTextAttention",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteAttention",
    "glm5_next.modeling_glm5_next.Glm5NextTextAttention", "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention",
    "hy_v4.modeling_hy_v4.HYV4Attention", "hy_v4_vl.modeling_hy_v4_vl.HYV4VLAttention",
    "kimi_linear.modeling_kimi_linear.KimiLinearAttention", "longcat_flash.modeling_longcat_flash.LongcatFlashMLA",
    "minicpm3.modeling_minicpm3.MiniCPM3Attention", "mistral4.modeling_mistral4.Mistral4Attention",
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextAttention", "youtu.modeling_youtu.YoutuAttention",
)
for _family in _MLA_FAMILIES:
    for _attribute, _function in _MLA.items():
        register_fused_layout(f"transformers.models.{_family}", _attribute, _function)
for _attribute in ("kv_a_proj_with_mqa", "kv_b_proj"):  # AXK2 fuses its query with a gate instead
    register_fused_layout("transformers.models.axk2.modeling_axk2.AXK2Attention", _attribute, _MLA[_attribute])

_THIRDS_QKV = (
    "blip_2.modeling_blip_2.Blip2Attention", "cohere_compass.modeling_cohere_compass.CohereCompassVisionAttention",
    "dots3_note.modeling_dots3_note.Dots3NoteVisionAttention",
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeVisionAttention",
    "florence2.modeling_florence2.Florence2VisionChannelAttention", "glm4v.modeling_glm4v.Glm4vVisionAttention",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionAttention", "glm5_next.modeling_glm5_next.Glm5NextVisionAttention",
    "glm_image.modeling_glm_image.GlmImageVisionAttention", "glm_ocr.modeling_glm_ocr.GlmOcrVisionAttention",
    "got_ocr2.modeling_got_ocr2.GotOcr2VisionAttention", "hiera.modeling_hiera.HieraMaskUnitAttention",
    "instructblip.modeling_instructblip.InstructBlipAttention",
    "instructblipvideo.modeling_instructblipvideo.InstructBlipVideoAttention",
    "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention", "qwen2_vl.modeling_qwen2_vl.VisionAttention",
    "qwen3_5.modeling_qwen3_5.Qwen3_5VisionAttention", "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionAttention",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionAttention",
    "qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionAttention", "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionAttention",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpVisionAttention", "sam.modeling_sam.SamVisionSdpaAttention",
    "sam2.modeling_sam2.Sam2MultiScaleAttention", "sam_hq.modeling_sam_hq.SamHQVisionSdpaAttention",
    "seggpt.modeling_seggpt.SegGptAttention", "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrSamVisionSdpaAttention",
    "vitdet.modeling_vitdet.VitDetAttention",
)
for _family in _THIRDS_QKV:
    register_fused_layout(f"transformers.models.{_family}", "qkv", thirds_qkv)

for _family in ("dia.modeling_dia.DiaMLP", "dots3_note.modeling_dots3_note.Dots3NoteAudioMLP",
                "glm4v.modeling_glm4v.Glm4vTextMLP", "glm_image.modeling_glm_image.GlmImageTextMLP",
                "glm_ocr.modeling_glm_ocr.GlmOcrTextMLP", "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLDenseMLP"):
    register_fused_layout(f"transformers.models.{_family}", "gate_up_proj", gate_up_halves)

for _family in ("qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
                "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet",
                "lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet"):
    register_fused_layout(f"transformers.models.{_family}", "in_proj_qkv", gated_delta_qkv)
register_fused_layout("transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet", "in_proj_qkvz",
                      gated_delta_qkvz)
register_fused_layout("transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet", "in_proj_ba",
                      gated_delta_ba)
for _attribute in ("w1", "v1", "w2"):
    register_fused_layout("transformers.models.dbrx.modeling_dbrx.DbrxExpertGLU", _attribute, stacked_expert_rows)
register_experts_container("transformers.models.llama4.modeling_llama4.Llama4TextExperts",
                           ("gate_up_proj", "down_proj"), transposed_halves_experts)
register_experts_container("transformers.models.step3p7.modeling_step3p7.Step3p7Experts",
                           ("gate_up_proj", "down_proj"), halves_experts)
register_experts_container("transformers.models.inkling.modeling_inkling.InklingSharedExperts",
                           ("gate_proj", "up_proj", "down_proj"))
register_experts_container("transformers.models.jetmoe.modeling_jetmoe.JetMoeParallelExperts", ("weight",),
                           jetmoe_experts)


def dbrx_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """DbrxAttention.Wqkv: its forward splits [hidden_size, kv_heads * head_dim, kv_heads * head_dim]."""
    owner = weight.owner
    if not weight.split_qkv:
        return WHOLE
    try:
        q_rows, kv_rows = int(owner.hidden_size), int(owner.num_key_value_heads) * int(owner.head_dim)
    except (AttributeError, TypeError):
        return None
    return FusedBlocks((q_rows, kv_rows, kv_rows))


def mamba2_in_proj(weight: FusedWeight) -> Optional[FusedBlocks]:
    """A Mamba-2 mixer's in_proj: its forward splits [intermediate (gate z), conv_dim, num_heads (dt)]
    and, after the convolution, conv_dim into [intermediate (x), groups * state (B), groups * state
    (C)]: z, x, B, C and dt, as megatron-core's MambaMixer splits in_proj."""
    owner = weight.owner
    try:
        inner, heads = int(owner.intermediate_size), int(owner.num_heads)
        bc = int(owner.n_groups) * int(owner.ssm_state_size)
    except (AttributeError, TypeError):
        return None
    return FusedBlocks((inner, inner, bc, bc, heads))


def mamba1_in_proj(weight: FusedWeight) -> FusedBlocks:
    """A Mamba-1 mixer's in_proj: its forward chunks the output in two, x then the gate."""
    return gate_up_halves(weight)


def zamba_in_proj(weight: FusedWeight) -> Optional[FusedBlocks]:
    """ZambaMambaMixer.in_proj: its forward views the output [intermediate, 2] and chunks the last
    dimension: x = rows 0, 2, 4, ..., the gate = rows 1, 3, 5, ..."""
    rows = weight.param.shape[0]
    return None if rows % 2 else FusedBlocks((1, 1), rows // 2)


register_experts_container("transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashExperts",
                           ("gate_up_proj", "down_proj"), halves_experts)
register_fused_layout("transformers.models.dbrx.modeling_dbrx.DbrxAttention", "Wqkv", dbrx_qkv)
for _family in ("mamba2.modeling_mamba2.Mamba2Mixer", "bamba.modeling_bamba.BambaMixer",
                "nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer", "falcon_h1.modeling_falcon_h1.FalconH1Mixer",
                "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer",
                "zamba2.modeling_zamba2.Zamba2MambaMixer"):
    register_fused_layout(f"transformers.models.{_family}", "in_proj", mamba2_in_proj)
for _family in ("mamba.modeling_mamba.MambaMixer", "jamba.modeling_jamba.JambaMambaMixer",
                "falcon_mamba.modeling_falcon_mamba.FalconMambaMixer"):
    register_fused_layout(f"transformers.models.{_family}", "in_proj", mamba1_in_proj)
register_fused_layout("transformers.models.zamba.modeling_zamba.ZambaMambaMixer", "in_proj", zamba_in_proj)
