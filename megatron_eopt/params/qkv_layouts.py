"""More `transformers` 5.24 fused q/k/v weights for params/fused_layouts.py's table, each read
from its family's forward (docs/fsdp2.md lists them). params/__init__.py imports this module,
so that every Muon consumer that reads the table sees these entries too.
"""

from typing import Optional

from megatron_eopt.params.fused_layouts import WHOLE, FusedBlocks, FusedWeight, register_fused_layout


def falcon_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """FalconAttention.query_key_value (its `_split_heads`): with `new_decoder_architecture` the
    rows viewed [num_kv_heads, heads / num_kv_heads + 2, head_dim], per KV group its query heads,
    its key and its value (megatron-core's linear_qkv layout); else with `multi_query` the rows
    [heads + 2, head_dim]: all query heads, then one key and one value head; else [heads, 3,
    head_dim]: per head its query, key and value. Each split q, k, v, as megatron-core splits
    linear_qkv."""
    owner = weight.owner
    if not weight.split_qkv:
        return WHOLE
    try:
        heads, kv_heads, head_dim = int(owner.num_heads), int(owner.num_kv_heads), int(owner.head_dim)
        grouped, multi_query = bool(owner.new_decoder_architecture), bool(owner.multi_query)
    except (AttributeError, TypeError):
        return None
    head_rows = head_dim if weight.per_head else 0
    if grouped:
        if not kv_heads or heads % kv_heads:
            return None
        per_kv = heads // kv_heads
        return FusedBlocks((per_kv * head_dim, head_dim, head_dim), kv_heads, head_rows=head_rows)
    if multi_query:
        return FusedBlocks((heads * head_dim, head_dim, head_dim), head_rows=head_rows)
    return FusedBlocks((head_dim,) * 3, heads, head_rows=head_rows)


register_fused_layout("transformers.models.falcon.modeling_falcon.FalconAttention", "query_key_value", falcon_qkv)


def chunked_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """MPT's and ModernBERT's Wqkv: the output chunked in three (MptAttention.forward's
    `chunk(3)`, ModernBertAttention.forward's view [3, heads, head_dim]): all query heads, then all
    key heads, then all value heads; per head of `head_dim` rows with `per_head`."""
    if not weight.split_qkv:
        return WHOLE
    rows, head_dim = weight.param.shape[0], getattr(weight.owner, "head_dim", None)
    if rows % 3 or not isinstance(head_dim, int) or (rows // 3) % head_dim:
        return None
    return FusedBlocks((rows // 3,) * 3, head_rows=head_dim if weight.per_head else 0)


for _family in ("mpt.modeling_mpt.MptAttention", "modernbert.modeling_modernbert.ModernBertAttention"):
    register_fused_layout(f"transformers.models.{_family}", "Wqkv", chunked_qkv)


def gpt_bigcode_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """GPTBigCodeAttention.c_attn (an nn.Linear, [out, in]; its forward): with `multi_query` split
    [embed_dim, head_dim, head_dim], all query heads, one key, one value; else viewed [heads,
    3 * head_dim], per head its query, key and value. Cross-attention's c_attn holds the key and
    the value of the encoder's states (its query is q_attn's): its forward's `split((head_dim,
    head_dim))` runs with one head only, where it takes the two halves of the rows; split into
    those halves, key and value, as GPT-2's cross-attention splits its c_attn."""
    owner = weight.owner
    if not weight.split_qkv:
        return WHOLE
    try:
        heads, head_dim, multi_query = int(owner.num_heads), int(owner.head_dim), bool(owner.multi_query)
        cross = bool(owner.is_cross_attention)
    except (AttributeError, TypeError):
        return None
    head_rows = head_dim if weight.per_head else 0
    rows = weight.param.shape[0]
    if cross:
        return FusedBlocks((rows // 2,) * 2, head_rows=head_rows) if rows % (2 * head_dim) == 0 else None
    if multi_query:
        return FusedBlocks((heads * head_dim, head_dim, head_dim), head_rows=head_rows)
    return FusedBlocks((head_dim,) * 3, heads, head_rows=head_rows)


register_fused_layout("transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention", "c_attn",
                      gpt_bigcode_qkv)


def codegen_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """CodeGenAttention.qkv_proj (its forward): the rows viewed [mp_num, 3 * embed_dim / mp_num]
    (the 4 model-parallel shards CodeGen was trained with), each split into query, value and key:
    q, v and k each one block taken from every shard."""
    owner = weight.owner
    if not weight.split_qkv:
        return WHOLE
    try:
        shards, embed_dim, head_dim = int(owner.mp_num), int(owner.embed_dim), int(owner.head_dim)
    except (AttributeError, TypeError):
        return None
    local = embed_dim // shards if shards else 0
    if not local or local * shards != embed_dim or weight.param.shape[0] != 3 * embed_dim or local % head_dim:
        return None
    return FusedBlocks((local,) * 3, shards, head_rows=head_dim if weight.per_head else 0)


register_fused_layout("transformers.models.codegen.modeling_codegen.CodeGenAttention", "qkv_proj", codegen_qkv)
