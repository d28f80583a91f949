"""More fused weights of the model zoos (`transformers` 5.24, torchtitan 0.3) for
params/fused_layouts.py's table, each read from its family's forward: vision towers' q/k/v,
q/k/v and k/v projections under other names, gated MLPs (gate_up_proj, Wi, fc1, input_linear, ...),
DeBERTa's per-head q/k/v, LFM's short convolutions, DeepSeek-V4's attention, Flux's blocks; and
the weights named like fused ones that are one matrix (kept whole, with the reason).
params/__init__.py imports this module, so that every Muon consumer that reads the table sees
these entries too. docs/fsdp2.md lists them with their sources.
"""

from typing import Optional

from megatron_eopt.params.fused_layouts import (WHOLE, FusedBlocks, FusedWeight, gate_up_halves, register_fused_layout,
                                                thirds_qkv, whole_because)


def _facts(owner, *names: str) -> Optional[tuple[int, ...]]:
    """The owner's integer attributes `names`, or None when one is missing."""
    try:
        return tuple(int(getattr(owner, name)) for name in names)
    except (AttributeError, TypeError):
        return None


# --- vision towers' q/k/v ------------------------------------------------------------------------
# Each forward reshapes qkv's output (..., 3, heads, head_dim) (Flux: einops "(K H D)", K=3):
# q, k and v are the first, second and last third of the rows.
_THIRDS_QKV = (
    "transformers.models.blip.modeling_blip.BlipAttention",
    "transformers.models.florence2.modeling_florence2.Florence2VisionWindowAttention",
    "transformers.models.mgp_str.modeling_mgp_str.MgpstrAttention",
    "transformers.models.timesformer.modeling_timesformer.TimesformerSelfAttention",
    "torchtitan.models.flux.model.layers.SelfAttention",  # Flux's double-stream blocks' img_attn, txt_attn
)
for _type in _THIRDS_QKV:
    register_fused_layout(_type, "qkv", thirds_qkv)


def sized_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Exaone4_5_VisionAttention.qkv: its forward splits [q_dim, kv_dim, kv_dim] (all query
    heads, then the key heads, then the value heads); per head of head_dim with `per_head`."""
    if not weight.split_qkv:
        return WHOLE
    facts = _facts(weight.owner, "q_dim", "kv_dim", "head_dim")
    if facts is None:
        return None
    q_dim, kv_dim, head_dim = facts
    return FusedBlocks((q_dim, kv_dim, kv_dim), head_rows=head_dim if weight.per_head else 0)


register_fused_layout("transformers.models.exaone4_5.modeling_exaone4_5.Exaone4_5_VisionAttention", "qkv", sized_qkv)
# BarkSelfAttention.forward: att_proj's output split by embed_dim: q, k, v (thirds).
register_fused_layout("transformers.models.bark.modeling_bark.BarkSelfAttention", "att_proj", thirds_qkv)


def kv_halves(weight: FusedWeight) -> Optional[FusedBlocks]:
    """A key/value projection whose forward chunks the output in two: key, then value (the parts
    of megatron-core's linear_qkv they are)."""
    rows = weight.param.shape[0]
    if not weight.split_qkv:
        return WHOLE
    return None if rows % 2 else FusedBlocks((rows // 2,) * 2)


for _type, _attribute in (("jetmoe.modeling_jetmoe.JetMoeAttention", "kv_proj"),
                          ("evolla.modeling_evolla.EvollaSequenceCompressorAttention", "to_kv"),
                          ("granite_speech.modeling_granite_speech.GraniteSpeechConformerAttention", "to_kv"),
                          ("granite_speech_plus.modeling_granite_speech_plus.GraniteSpeechPlusConformerAttention",
                           "to_kv")):
    register_fused_layout(f"transformers.models.{_type}", _attribute, kv_halves)


def indexer_qk(weight: FusedWeight) -> Optional[FusedBlocks]:
    """Qwen4Exp's QSA indexer index_qk_proj: its forward splits [index_n_heads * index_head_dim,
    index_kv_heads * index_head_dim]: query, key (megatron-core's DSA indexer: linear_wq_b, linear_wk)."""
    facts = _facts(weight.owner, "index_n_heads", "index_kv_heads", "index_head_dim")
    if facts is None or weight.param.shape[0] != (facts[0] + facts[1]) * facts[2]:
        return None
    return FusedBlocks((facts[0] * facts[2], facts[1] * facts[2]))


register_fused_layout("transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextQSAIndexer", "index_qk_proj",
                      indexer_qk)


def flux_single_stream_linear1(weight: FusedWeight) -> Optional[FusedBlocks]:
    """torchtitan Flux's SingleStreamBlock.linear1: its forward splits [3 * hidden_size,
    mlp_hidden_dim], then the first part "(K H D)" with K=3: q, k, v (megatron-core's linear_qkv)
    and the MLP's up projection (its linear_fc1); q, k, v one block without `split_qkv`."""
    facts = _facts(weight.owner, "hidden_size", "mlp_hidden_dim")
    if facts is None or weight.param.shape[0] != 3 * facts[0] + facts[1]:
        return None
    hidden, mlp = facts
    return FusedBlocks((hidden, hidden, hidden, mlp) if weight.split_qkv else (3 * hidden, mlp))


register_fused_layout("torchtitan.models.flux.model.layers.SingleStreamBlock", "linear1", flux_single_stream_linear1)


# --- per-head q/k/v and queries ------------------------------------------------------------------

def deberta_in_proj(weight: FusedWeight) -> Optional[FusedBlocks]:
    """DeBERTa's DisentangledSelfAttention.in_proj: its forward views the output [heads,
    3 * head_size] and chunks the last dimension in three (its other branch cats the weight's
    chunks ws[3 * head + part]): per head its query, key and value rows."""
    if not weight.split_qkv:
        return WHOLE
    facts = _facts(weight.owner, "num_attention_heads", "attention_head_size")
    if facts is None or weight.param.shape[0] != 3 * facts[0] * facts[1]:
        return None
    heads, head_size = facts
    return FusedBlocks((head_size,) * 3, heads, head_rows=head_size if weight.per_head else 0)


register_fused_layout("transformers.models.deberta.modeling_deberta.DisentangledSelfAttention", "in_proj",
                      deberta_in_proj)


def deepseek_v4_query_up(weight: FusedWeight) -> Optional[FusedBlocks]:
    """DeepseekV4Attention.q_b_proj: its forward views the output [heads, head_dim] (each head then
    normalized on its own): one matrix per head, as megatron-core's MLA linear_q_up_proj."""
    facts = _facts(weight.owner, "num_heads", "head_dim")
    if facts is None or weight.param.shape[0] != facts[0] * facts[1]:
        return None
    return FusedBlocks((facts[1],), facts[0], per_group=True)


def deepseek_v4_grouped_output(weight: FusedWeight) -> Optional[FusedBlocks]:
    """DeepseekV4Attention.o_a_proj (a DeepseekV4GroupedLinear, block diagonal): its forward views
    the weight [n_groups, rows / n_groups, in] and multiplies each head group's input by its own
    block: one matrix per group, as experts are."""
    groups = _facts(getattr(weight.owner, "o_a_proj", None), "n_groups")
    rows = weight.param.shape[0]
    if groups is None or not groups[0] or rows % groups[0]:
        return None
    return FusedBlocks((rows // groups[0],), groups[0], per_group=True)


_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4."
register_fused_layout(_DEEPSEEK_V4 + "DeepseekV4Attention", "q_b_proj", deepseek_v4_query_up)
register_fused_layout(_DEEPSEEK_V4 + "DeepseekV4Attention", "o_a_proj", deepseek_v4_grouped_output)


# --- gated MLPs and short convolutions -----------------------------------------------------------
# Phi4MultimodalAudioMLP chunks gate_up_proj's output into up, then gate; Zamba2MLP into gate, then
# up, after adding its LoRA adapter's output (the adapter is its own pair of matrices): halves.
for _type in ("phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAudioMLP", "zamba2.modeling_zamba2.Zamba2MLP"):
    register_fused_layout(f"transformers.models.{_type}", "gate_up_proj", gate_up_halves)


def adapter_up_halves(weight: FusedWeight) -> FusedBlocks:
    """Zamba2MLP.gate_up_proj_adapter_list: each entry a LoRA pair (Linear(hidden, rank), Linear(rank,
    2 * intermediate)) whose output is added to gate_up_proj's before the chunk: the up projection's
    gate and up halves; the down projection (rank rows) is one matrix."""
    rows = weight.param.shape[0]
    return gate_up_halves(weight) if rows == 2 * int(weight.owner.intermediate_size) else WHOLE


register_fused_layout("transformers.models.zamba2.modeling_zamba2.Zamba2MLP", "gate_up_proj_adapter_list",
                      adapter_up_halves)
# Gated linear units under other names, each forward chunking the output in two (input, gate).
for _type, _attribute in (
    ("modernbert.modeling_modernbert.ModernBertMLP", "Wi"),
    ("modernbert_decoder.modeling_modernbert_decoder.ModernBertDecoderMLP", "Wi"),
    ("moonshine.modeling_moonshine.MoonshineDecoderMLP", "fc1"),
    ("moonshine_streaming.modeling_moonshine_streaming.MoonshineStreamingDecoderMLP", "fc1"),
    ("granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedMLP", "input_linear"),
    ("granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMLP", "input_linear"),
    ("granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAMLP", "input_linear"),
    ("clvp.modeling_clvp.ClvpGatedLinearUnit", "proj"),
    ("aya_vision.modeling_aya_vision.AyaVisionMultiModalProjector", "linear_1"),
    ("cohere2_vision.modeling_cohere2_vision.Cohere2VisionMultiModalProjector", "linear_1"),
):
    register_fused_layout(f"transformers.models.{_type}", _attribute, gate_up_halves)


def short_conv_in_proj(weight: FusedWeight) -> Optional[FusedBlocks]:
    """LFM's short convolution in_proj: its forward chunks the output in three, B, C and x (the
    input gate, the output gate and the convolution's input), each its own matrix as
    megatron-core's MambaMixer splits its in_proj's gate, input and B, C parts."""
    rows = weight.param.shape[0]
    return None if rows % 3 else FusedBlocks((rows // 3,) * 3)


for _type in ("lfm2.modeling_lfm2.Lfm2ShortConv", "lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv",
              "lfm3.modeling_lfm3.Lfm3ShortConv", "lfm3_vl.modeling_lfm3_vl.Lfm3VlVisionShortConv"):
    register_fused_layout(f"transformers.models.{_type}", "in_proj", short_conv_in_proj)


# --- named like fused weights, one matrix on purpose -----------------------------------------------
for _type, _attribute, _reason in (
    ("bark.modeling_bark.BarkMLP", "in_proj", "an MLP's up projection (GELU of its whole output): not fused"),
    ("kimi_k25.modeling_kimi_k25.Kimi_K25MultimodalProjection", "in_proj",
     "the projector's first layer (GELU of its whole output): not fused"),
    ("deepseek_v4.modeling_deepseek_v4.DeepseekV4Indexer", "q_b_proj",
     "a DSA indexer's query up projection: one matrix, as megatron-core's DSA indexer's linear_wq_b"),
):
    register_fused_layout(f"transformers.models.{_type}", _attribute, whole_because(_reason))
