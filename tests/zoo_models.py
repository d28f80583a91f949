"""Tiny models of the `transformers` and torchtitan families whose fused or stacked weights
params/fused_layouts.py splits, one per layout kind, each with its components cut out as the
family's own forward reads them (the docstrings name the source): {parameter name: [function of
a full tensor -> one component's [out, in] matrix]}. Used by
tests/unit/library/params/test_zoo_layouts.py (one process) and
tests/unit/library/distributed/test_fsdp2_nd_experts.py (FSDP2 on 2 ranks).
"""

import functools

import torch


def _transformers():
    import transformers

    return transformers


# --- torchtitan ----------------------------------------------------------------------------------

def _stack(layer_configs) -> torch.nn.Module:
    """torchtitan's blocks under a root module (`layers.<i>`), as its decoders hold them."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([config.build() for config in layer_configs])
    return model


def _titan_rope(dim):
    from torchtitan.models.common import ComplexRoPE

    return ComplexRoPE.Config(dim=dim, max_seq_len=64, theta=10000.0, scaling="none")


def titan_llama3_fused_qkv():
    """FusedQKVLinear.forward: wqkv's output viewed [n_kv_heads, heads_per_kv + 2, head_dim], split
    [heads_per_kv, 1, 1]: 2 KV groups of 2 query heads, head_dim 8."""
    from torchtitan.models.llama3 import _build_llama3_layers

    layers = _build_llama3_layers(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, hidden_dim=48, fuse_qkv=True,
                                  attn_backend="flex", rope=_titan_rope(8))
    groups = lambda t: t.reshape(2, 4, 8, t.shape[-1])
    parts = {"layers.0.attention.qkv_linear.wqkv.weight": [
        lambda t: groups(t)[:, :2].reshape(-1, t.shape[-1]), lambda t: groups(t)[:, 2].reshape(-1, t.shape[-1]),
        lambda t: groups(t)[:, 3].reshape(-1, t.shape[-1])]}
    return _stack(layers), parts


def titan_deepseek_v3_mla():
    """deepseek_v3 Attention.forward: wq_b's output viewed [heads, qk_nope + qk_rope]; wkv_a's split
    [kv_lora_rank, qk_rope]; wkv_b's viewed [heads, qk_nope + v_head_dim] and split. 2 heads,
    nope 8, rope 4, v 8, kv_lora_rank 8."""
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers

    layers = _build_dsv3_layers(
        n_layers=1, n_dense_layers=1, dim=32, n_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, mscale=0.7, dense_hidden_dim=48, moe_hidden_dim=16, num_experts=3,
        num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=_titan_rope(4))
    parts = {"layers.0.attention.wq_b.weight": [lambda t, h=h: t[12 * h:12 * (h + 1)] for h in range(2)],
             "layers.0.attention.wkv_a.weight": [lambda t: t[:8], lambda t: t[8:]],
             "layers.0.attention.wkv_b.weight": [lambda t, h=h, s=s: t[16 * h + s:16 * h + s + 8]
                                          for h in range(2) for s in (0, 8)]}
    return _stack(layers), parts


def titan_gpt_oss_experts():
    """GptOssGroupedExperts.forward: mlp1_weight_EGD [E, 2F, D] per expert [out, in], its swiglu
    gate = rows 0, 2, ..., up = rows 1, 3, ...; mlp2_weight_EDF [E, D, F] one matrix each."""
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    model = torch.nn.Module()
    model.router = torch.nn.Linear(32, 3, bias=False)  # a dense parameter beside the experts, as in a model
    model.experts = GptOssGroupedExperts(GptOssGroupedExperts.Config(dim=32, hidden_dim=16, num_experts=3))
    for param in model.experts.parameters():
        torch.nn.init.normal_(param, std=0.1)
    parts = {"experts.mlp1_weight_EGD": [lambda t, e=e, s=s: t[e][s::2] for e in range(3) for s in (0, 1)],
             "experts.mlp2_weight_EDF": [lambda t, e=e: t[e] for e in range(3)]}
    return model, parts


# --- transformers ----------------------------------------------------------------------------------

def hf_deepseek_v3_mla():
    """DeepseekV3Attention.forward: q_b_proj viewed [heads, qk_head_dim]; kv_a_proj_with_mqa split
    [kv_lora_rank, qk_rope_head_dim]; kv_b_proj viewed [heads, qk_nope + v_head_dim], split."""
    config = _transformers().DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    attention = "model.layers.0.self_attn."
    parts = {attention + "q_b_proj.weight": [lambda t, h=h: t[12 * h:12 * (h + 1)] for h in range(2)],
             attention + "kv_a_proj_with_mqa.weight": [lambda t: t[:8], lambda t: t[8:]],
             attention + "kv_b_proj.weight": [lambda t, h=h, s=s: t[16 * h + s:16 * h + s + 8]
                                              for h in range(2) for s in (0, 8)]}
    return _transformers().DeepseekV3ForCausalLM(config), parts


def hf_dbrx_experts():
    """DbrxExpertGLU.forward: w1, v1 [E * ffn, hidden], x @ w1[e].T; w2 the same shape, x @ w2[e]:
    expert e's ffn rows e*F .. (e+1)*F of each, one matrix."""
    config = _transformers().DbrxConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=32,
                                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                                     ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 3, "moe_top_k": 2})
    mlp = "transformer.blocks.0.ffn.experts.mlp."
    parts = {mlp + name: [lambda t, e=e: t[16 * e:16 * (e + 1)] for e in range(3)] for name in ("w1", "v1", "w2")}
    # DbrxAttention.forward: Wqkv's output split [hidden, kv_heads * head_dim, kv_heads * head_dim].
    parts["transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight"] = [lambda t: t[:32], lambda t: t[32:48],
                                                                     lambda t: t[48:]]
    return _transformers().DbrxForCausalLM(config), parts


def hf_qwen3_next_gated_delta_net():
    """Qwen3NextGatedDeltaNet.fix_query_key_value_ordering: in_proj_qkvz viewed [k_heads,
    2 hk + 2 hv v_heads / k_heads], split (hk, hk, 2 hv, 2 hv); in_proj_ba viewed [k_heads, 4],
    split (2, 2). 2 key heads, 4 value heads, hk = hv = 8."""
    config = _transformers().Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2)
    qkvz = lambda t: t.reshape(2, 48, t.shape[-1])
    ba = lambda t: t.reshape(2, 4, t.shape[-1])
    parts = {"model.layers.0.linear_attn.in_proj_qkvz.weight": [
                lambda t, a=a, b=b: qkvz(t)[:, a:b].reshape(-1, t.shape[-1]) for a, b in ((0, 8), (8, 16), (16, 32),
                                                                                        (32, 48))],
             "model.layers.0.linear_attn.in_proj_ba.weight": [
                lambda t, a=a: ba(t)[:, a:a + 2].reshape(-1, t.shape[-1]) for a in (0, 2)]}
    return _transformers().Qwen3NextForCausalLM(config), parts


def hf_llama4_experts():
    """Llama4TextExperts.forward: bmm(x, gate_up_proj[e]) with gate_up_proj [E, hidden, 2F] ([in,
    out]), chunked into gate, up; down_proj [E, F, hidden] ([in, out])."""
    config = _transformers().Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=3, num_experts_per_tok=1)
    experts = "model.layers.0.feed_forward.experts."
    parts = {experts + "gate_up_proj": [lambda t, e=e, s=s: t[e].T[s:s + 16] for e in range(3) for s in (0, 16)],
             experts + "down_proj": [lambda t, e=e: t[e].T for e in range(3)]}
    return _transformers().Llama4ForCausalLM(config), parts


def hf_jetmoe_experts():
    """JetMoeParallelExperts.forward: F.linear per expert, weight [E, out, in]; the MLP's
    input_linear output chunked into gate, up; the attention's experts one matrix each."""
    config = _transformers().JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2,
                                       kv_channels=8, intermediate_size=16, num_local_experts=3,
                                       num_experts_per_tok=2)
    parts = {"model.layers.0.mlp.input_linear.weight": [lambda t, e=e, s=s: t[e][s:s + 16]
                                                        for e in range(3) for s in (0, 16)],
             "model.layers.0.mlp.output_linear.weight": [lambda t, e=e: t[e] for e in range(3)],
             "model.layers.0.self_attention.experts.input_linear.weight": [lambda t, e=e: t[e] for e in range(3)]}
    return _transformers().JetMoeForCausalLM(config), parts


def hf_qwen2_5_vl_vision_qkv():
    """Qwen2_5_VLVisionAttention.forward: qkv's output reshaped (seq, 3, heads, head_dim): thirds."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = _transformers().models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig(
        depth=1, hidden_size=32, num_heads=4, intermediate_size=48, out_hidden_size=32, fullatt_block_indexes=[0])
    parts = {"blocks.0.attn.qkv.weight": [lambda t, s=s: t[32 * s:32 * (s + 1)] for s in range(3)]}
    return Qwen2_5_VisionTransformerPretrainedModel(config), parts


def hf_mamba2_in_proj():
    """Mamba2Mixer.forward: in_proj's output split [intermediate (z), conv_dim, num_heads (dt)], conv_dim
    after the convolution [intermediate (x), groups * state (B), groups * state (C)]: 64, 64, 8, 8, 4."""
    config = _transformers().Mamba2Config(vocab_size=64, hidden_size=32, num_heads=4, head_dim=16, expand=2, n_groups=1,
                                       state_size=8, num_hidden_layers=1)
    bounds = (0, 64, 128, 136, 144, 148)
    parts = {"backbone.layers.0.mixer.in_proj.weight": [lambda t, a=a, b=b: t[a:b] for a, b in zip(bounds, bounds[1:])]}
    return _transformers().Mamba2ForCausalLM(config), parts


def hf_qwen3_5_gated_delta_qkv():
    """Qwen3_5GatedDeltaNet.forward: in_proj_qkv's output (after its convolution) split
    [key_dim, key_dim, value_dim]: 2 key heads and 4 value heads of 8."""
    config = _transformers().Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8)
    parts = {"model.layers.0.linear_attn.in_proj_qkv.weight": [lambda t: t[:16], lambda t: t[16:32],
                                                               lambda t: t[32:]]}
    return _transformers().Qwen3_5ForCausalLM(config), parts


def hf_mamba_in_proj():
    """MambaMixer.forward: in_proj's output chunked in two, x then the gate."""
    config = _transformers().MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2)
    parts = {"backbone.layers.0.mixer.in_proj.weight": [lambda t: t[:64], lambda t: t[64:]]}
    return _transformers().MambaForCausalLM(config), parts


def hf_zamba_in_proj():
    """ZambaMambaMixer.forward: in_proj's output viewed [intermediate, 2] and chunked on the last
    dimension: x = rows 0, 2, ..., the gate = rows 1, 3, ..."""
    config = _transformers().ZambaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        attention_head_dim=8, intermediate_size=48, mamba_d_state=8, n_mamba_heads=2, layers_block_type=["mamba"])
    parts = {"model.layers.0.mamba.in_proj.weight": [lambda t: t[0::2], lambda t: t[1::2]]}
    return _transformers().ZambaForCausalLM(config), parts


def hf_falcon_qkv():
    """FalconAttention._split_heads, its three layouts of query_key_value (4 heads of 8):
    `new_decoder_architecture`: rows viewed [num_kv_heads=2, 2 + 2, 8], split [2, 1, 1] per group;
    `multi_query`: [4 + 2, 8], all queries, one key, one value; neither: [4, 3, 8] per head."""
    def falcon(**layout):
        config = _transformers().FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=4, **layout)
        return _transformers().FalconModel(config)

    model = torch.nn.Module()
    model.grouped = falcon(new_decoder_architecture=True, num_kv_heads=2)
    model.multi_query = falcon(multi_query=True)
    model.per_head = falcon(multi_query=False)
    qkv = "h.0.self_attention.query_key_value.weight"
    groups = lambda t: t.reshape(2, 4, 8, t.shape[-1])
    heads = lambda t: t.reshape(4, 3, 8, t.shape[-1])
    parts = {"grouped." + qkv: [lambda t: groups(t)[:, :2].reshape(-1, t.shape[-1]),
                                lambda t: groups(t)[:, 2].reshape(-1, t.shape[-1]),
                                lambda t: groups(t)[:, 3].reshape(-1, t.shape[-1])],
             "multi_query." + qkv: [lambda t: t[:32], lambda t: t[32:40], lambda t: t[40:]],
             "per_head." + qkv: [lambda t, s=s: heads(t)[:, s].reshape(-1, t.shape[-1]) for s in range(3)]}
    return model, parts


def hf_chunked_wqkv():
    """MptAttention.forward's `Wqkv(...).chunk(3)` and ModernBertAttention.forward's view [3, heads,
    head_dim]: q, k, v are the first, second and last third of the rows (4 heads of 8)."""
    model = torch.nn.Module()
    model.mpt = _transformers().MptModel(_transformers().MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1))
    model.modernbert = _transformers().ModernBertModel(_transformers().ModernBertConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    thirds = [lambda t, s=s: t[32 * s:32 * (s + 1)] for s in range(3)]
    return model, {"mpt.blocks.0.attn.Wqkv.weight": thirds, "modernbert.layers.0.attn.Wqkv.weight": thirds}


def hf_gpt_bigcode_c_attn():
    """GPTBigCodeAttention.forward (4 heads of 8): with `multi_query` c_attn's output split [32, 8,
    8], all queries, one key, one value; without, viewed [4, 3 * 8] and split per head. The
    cross-attention's c_attn [64, 32] (key and value; its forward's split runs with one head, where
    it takes the halves): halves."""
    def bigcode(multi_query):
        config = _transformers().GPTBigCodeConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                                                  multi_query=multi_query, add_cross_attention=not multi_query)
        return _transformers().GPTBigCodeModel(config)

    model = torch.nn.Module()
    model.multi_query, model.per_head = bigcode(True), bigcode(False)
    heads = lambda t: t.reshape(4, 3, 8, t.shape[-1])
    c_attn = "h.0.attn.c_attn.weight"
    return model, {"multi_query." + c_attn: [lambda t: t[:32], lambda t: t[32:40], lambda t: t[40:]],
                   "per_head." + c_attn: [lambda t, s=s: heads(t)[:, s].reshape(-1, t.shape[-1]) for s in range(3)],
                   "per_head.h.0.crossattention.c_attn.weight": [lambda t: t[:32], lambda t: t[32:]]}


def hf_codegen_qkv():
    """CodeGenAttention.forward: qkv_proj's output viewed [mp_num=4, 3 * 32 / 4] and split per
    shard into query, value, key (8 rows each)."""
    config = _transformers().CodeGenConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                                           rotary_dim=4)
    shards = lambda t: t.reshape(4, 3, 8, t.shape[-1])
    parts = {"transformer.h.0.attn.qkv_proj.weight": [lambda t, s=s: shards(t)[:, s].reshape(-1, t.shape[-1])
                                                       for s in range(3)]}
    return _transformers().CodeGenForCausalLM(config), parts


def hf_vision_qkv():
    """BlipAttention.forward: qkv's output reshaped (..., 3, heads, head_dim): thirds (4 heads of 8);
    Exaone4_5_VisionAttention.forward: split [q_dim, kv_dim, kv_dim] = [32, 16, 16] (2 KV heads)."""
    from transformers.models.exaone4_5.configuration_exaone4_5 import Exaone4_5_VisionConfig
    from transformers.models.exaone4_5.modeling_exaone4_5 import Exaone4_5_VisionModel

    model = torch.nn.Module()
    model.blip = _transformers().BlipVisionModel(_transformers().BlipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=16))
    model.exaone = Exaone4_5_VisionModel(Exaone4_5_VisionConfig(
        depth=1, hidden_size=32, num_heads=4, num_key_value_heads=2, intermediate_size=48, out_hidden_size=32,
        fullatt_block_indexes=[0]))
    return model, {"blip.encoder.layers.0.self_attn.qkv.weight": [lambda t, s=s: t[32 * s:32 * (s + 1)]
                                                                  for s in range(3)],
                   "exaone.blocks.0.attn.qkv.weight": [lambda t: t[:32], lambda t: t[32:48], lambda t: t[48:]]}


def titan_flux_blocks():
    """Flux's SingleStreamBlock.forward: linear1's output split [3 * hidden, mlp_hidden], the first
    part "(K H D)" with K=3: q, k, v, then the MLP's up rows (32, 32, 32, 64); SelfAttention.forward
    (the double-stream block's img_attn): qkv "(K H D)": thirds."""
    from torchtitan.models.flux import _make_double_block_config, _make_single_block_config

    model = torch.nn.Module()
    model.single_stream = _make_single_block_config(32, 4, 2.0).build()
    model.double_stream = _make_double_block_config(32, 4, 2.0, False).build()
    bounds = (0, 32, 64, 96, 160)
    return model, {"single_stream.linear1.weight": [lambda t, a=a, b=b: t[a:b] for a, b in zip(bounds, bounds[1:])],
                   "double_stream.img_attn.qkv.weight": [lambda t, s=s: t[32 * s:32 * (s + 1)] for s in range(3)]}


def hf_gated_mlps():
    """Zamba2MLP.forward: gate_up_proj's output plus its LoRA adapter's (the adapter's up projection
    [96, 4]: its halves too) chunked into gate, up;
    Phi4MultimodalAudioMLP.forward: chunked into up, gate. Halves of 48 rows each."""
    from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalAudioMLP

    config = _transformers().Zamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        num_attention_heads=4, num_key_value_heads=4, attention_head_dim=8, intermediate_size=48, mamba_d_state=8,
        mamba_headdim=8, n_mamba_heads=8, adapter_rank=4, num_mem_blocks=1)
    model = torch.nn.Module()
    model.zamba2 = _transformers().Zamba2ForCausalLM(config)
    model.phi4_audio = Phi4MultimodalAudioMLP(_transformers().Phi4MultimodalAudioConfig(hidden_size=32,
                                                                                       intermediate_size=48))
    halves = [lambda t: t[:48], lambda t: t[48:]]
    return model, {"zamba2.model.layers.1.shared_transformer.feed_forward.gate_up_proj.weight": halves,
                   "zamba2.model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.0.1.weight": halves,
                   "phi4_audio.gate_up_proj.weight": halves}


def hf_deberta_in_proj():
    """DeBERTa's DisentangledSelfAttention.forward: in_proj's output viewed [heads, 3 * head_size]
    and chunked in three: per head its query, key and value rows (4 heads of 8)."""
    config = _transformers().DebertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=48)
    heads = lambda t: t.reshape(4, 3, 8, t.shape[-1])
    return _transformers().DebertaModel(config), {"encoder.layer.0.attention.self.in_proj.weight": [
        lambda t, s=s: heads(t)[:, s].reshape(-1, t.shape[-1]) for s in range(3)]}


def hf_short_conv_in_proj():
    """Lfm2ShortConv.forward (Lfm2MoeShortConv's, Lfm3ShortConv's and Lfm3VlVisionShortConv's the
    same): in_proj's output chunked in three, B, C, x."""
    config = _transformers().Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        layer_types=["conv", "full_attention"])
    return _transformers().Lfm2ForCausalLM(config), {"model.layers.0.conv.in_proj.weight": [
        lambda t, s=s: t[32 * s:32 * (s + 1)] for s in range(3)]}


def hf_deepseek_v4_attention():
    """DeepseekV4Attention.forward: q_b_proj's output viewed [heads, head_dim] (4 heads of 8);
    o_a_proj (DeepseekV4GroupedLinear.forward) viewed [o_groups, o_lora_rank, in]: 2 groups of 8 rows."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    config = _transformers().DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, head_dim=8, q_lora_rank=16,
        qk_rope_head_dim=4, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"], o_groups=2,
        o_lora_rank=8, index_n_heads=2, index_head_dim=8, n_routed_experts=4, moe_intermediate_size=16,
        num_experts_per_tok=2)
    model = torch.nn.Module()
    model.attention = DeepseekV4Attention(config, 0)
    return model, {"attention.q_b_proj.weight": [lambda t, h=h: t[8 * h:8 * (h + 1)] for h in range(4)],
                   "attention.o_a_proj.weight": [lambda t, g=g: t[8 * g:8 * (g + 1)] for g in range(2)]}


def hf_fused_under_other_names():
    """Fused weights not named like ones: BarkSelfAttention.forward splits att_proj's output by
    embed_dim (q, k, v: 32 rows each); JetMoeAttention.forward chunks kv_proj's in two (key, value:
    16 each); GraniteSpeechConformerAttention.forward to_kv's (key, value: 32 each);
    ModernBertMLP.forward Wi's (input, gate: 48 each)."""
    from transformers.models.bark.modeling_bark import BarkSelfAttention
    from transformers.models.granite_speech.modeling_granite_speech import GraniteSpeechConformerAttention
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    hf = _transformers()
    model = torch.nn.Module()
    model.bark = BarkSelfAttention(hf.BarkSemanticConfig(hidden_size=32, num_heads=4, num_layers=1), is_causal=True)
    model.jetmoe = JetMoeAttention(hf.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                   num_key_value_heads=2, kv_channels=8, intermediate_size=16,
                                                   num_local_experts=3, num_experts_per_tok=2), 0)
    model.granite_speech = GraniteSpeechConformerAttention(hf.GraniteSpeechEncoderConfig(
        hidden_dim=32, num_heads=4, dim_head=8, context_size=8, max_pos_emb=16))
    model.modernbert = ModernBertMLP(hf.ModernBertConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    parts = lambda size, count: [lambda t, i=i: t[size * i:size * (i + 1)] for i in range(count)]
    return model, {"bark.att_proj.weight": parts(32, 3), "jetmoe.kv_proj.weight": parts(16, 2),
                   "granite_speech.to_kv.weight": parts(32, 2), "modernbert.Wi.weight": parts(48, 2)}
def _conv1d_blocks(width: int, parts: int) -> list:
    """The [out, in] blocks of a Conv1D weight t [in, out] whose output splits into `parts` column
    blocks of `width` (`split(split_size, dim=2)`)."""
    return [lambda t, s=s: t[:, width * s:width * (s + 1)].T for s in range(parts)]


def hf_gpt2_c_attn():
    """GPT2Attention.forward (4 heads of 8): c_attn, a Conv1D stored [in, out] = [32, 96], its output
    `split(split_size=32, dim=2)` into q, k, v: column blocks of the storage; the cross-attention's
    c_attn [32, 64] into k, v (its query is q_attn's)."""
    config = _transformers().GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                                        add_cross_attention=True)
    return _transformers().GPT2Model(config), {"h.0.attn.c_attn.weight": _conv1d_blocks(32, 3),
                                               "h.0.crossattention.c_attn.weight": _conv1d_blocks(32, 2)}


def hf_openai_gpt_c_attn():
    """OpenAI-GPT's Attention.forward (4 heads of 8, `n_head`, no head_dim attribute): c_attn, a
    Conv1D [32, 96], its output `split(split_size=32, dim=2)` into q, k, v."""
    config = _transformers().OpenAIGPTConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    return _transformers().OpenAIGPTModel(config), {"h.0.attn.c_attn.weight": _conv1d_blocks(32, 3)}


def _initialized(builder):
    """`builder` with every parameter drawn from N(0, 0.02) (under the caller's seed): some families
    make weights with torch.empty and leave them to `post_init` (DeepSeek-V4's `position_bias`,
    JetMoe's experts: values up to 1e37 measured), whose update `before - after` then rounds away."""
    @functools.wraps(builder)
    def build():
        model, parts = builder()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)
        return model, parts
    return build


CASES = {builder.__name__: _initialized(builder) for builder in (
    titan_llama3_fused_qkv, titan_deepseek_v3_mla, titan_gpt_oss_experts, hf_deepseek_v3_mla, hf_dbrx_experts,
    hf_qwen3_next_gated_delta_net, hf_llama4_experts, hf_jetmoe_experts, hf_qwen2_5_vl_vision_qkv, hf_mamba2_in_proj,
    hf_qwen3_5_gated_delta_qkv, hf_mamba_in_proj, hf_zamba_in_proj, hf_falcon_qkv,
    hf_chunked_wqkv, hf_gpt_bigcode_c_attn, hf_codegen_qkv, hf_vision_qkv, titan_flux_blocks, hf_gated_mlps,
    hf_deberta_in_proj, hf_short_conv_in_proj, hf_deepseek_v4_attention,
    hf_fused_under_other_names, hf_gpt2_c_attn, hf_openai_gpt_c_attn)}
