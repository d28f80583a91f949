"""GPT-2 style fused q/k/v weights for params/fused_layouts.py's table: a `transformers` `Conv1D`
stored [in, out] (its forward is `x @ weight`), whose forward splits the OUTPUT, so q, k and v are
column blocks of the storage. Each is one matrix stored transposed (ops/splits.py: a single
`MatrixBatch`): Muon orthogonalizes the [out, in] view's row blocks, as megatron-core splits
linear_qkv, and Newton-Schulz of a transpose being the transpose of Newton-Schulz, the update is
stored back transposed. Under FSDP2 the stored rows (the view's columns) go to one owner, which
transposes the whole matrix. params/__init__.py imports this module.
"""

from typing import Optional


from megatron_eopt.params.fused_layouts import FusedBlocks, FusedWeight, register_fused_layout, stored_in_out_blocks


def conv1d_qkv(weight: FusedWeight) -> Optional[FusedBlocks]:
    """c_attn of GPT-2's attention and its copies (GPT2Attention, DecisionTransformerGPT2Attention,
    ImageGPTAttention) and of OpenAI-GPT's Attention: the forward splits the output
    `split(self.split_size, dim=2)`: q, k and v (cross-attention's c_attn: k and v, its query
    being q_attn's), each `split_size` columns of the storage, then viewed per head of
    `head_dim` (OpenAI-GPT: split_size / n_head). Per head with `per_head`."""
    owner, param = weight.owner, weight.param
    if not weight.split_qkv:
        return stored_in_out_blocks(param, (param.shape[1],))
    try:
        split_size = int(owner.split_size)
        heads = int(getattr(owner, "num_heads", None) or owner.n_head)
    except (AttributeError, TypeError):
        return None
    head_dim = int(getattr(owner, "head_dim", 0) or split_size // max(heads, 1))
    parts = 2 if getattr(owner, "is_cross_attention", False) else 3
    if param.dim() != 2 or param.shape[1] != parts * split_size or not head_dim or split_size % head_dim:
        return None
    if weight.per_head:
        return stored_in_out_blocks(param, (head_dim,) * (parts * split_size // head_dim))
    return stored_in_out_blocks(param, (split_size,) * parts)


for _family in ("gpt2.modeling_gpt2.GPT2Attention",
                "decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2Attention",
                "imagegpt.modeling_imagegpt.ImageGPTAttention", "openai.modeling_openai.Attention"):
    register_fused_layout(f"transformers.models.{_family}", "c_attn", conv1d_qkv)
