"""Named models for the planner, as the trainer's GPTModelSettings (Megatron-LM's model flags).

Each number is from the model's published config (Hugging Face `config.json` of the release
named beside it). The vocabulary is the published one; the planner pads it as Megatron-LM does.
Not modelled: DeepSeek-V3's and Kimi K2's multi-token-prediction module (a 62nd layer, about
2% of their parameters) and Megatron's grouped-GEMM expert layout (the trainer's
SequentialMLP has the same matrices under other names).
"""

import dataclasses

from megatron_eopt.training.model.settings import GPTModelSettings

_DENSE = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
              share_embeddings_and_output_weights=False, seq_length=8192)

# meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32, hidden_size 4096,
# intermediate_size 14336, num_attention_heads 32, num_key_value_heads 8, vocab_size 128256.
LLAMA3_8B = GPTModelSettings(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                             num_query_groups=8, vocab_size=128256, **_DENSE)
# meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, intermediate 28672, 64 heads,
# 8 key/value heads, vocab 128256.
LLAMA3_70B = GPTModelSettings(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                              num_query_groups=8, vocab_size=128256, **_DENSE)
# meta-llama/Llama-3.1-405B config.json: 126 layers, hidden 16384, intermediate 53248, 128 heads,
# 8 key/value heads, vocab 128256.
LLAMA3_405B = GPTModelSettings(num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128,
                               num_query_groups=8, vocab_size=128256, **_DENSE)
# Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 heads, 4 key/value heads, head_dim 128,
# every layer MoE (decoder_sparse_step 1): 128 experts, 8 per token, moe_intermediate_size 768,
# no shared expert, q/k RMSNorm, vocab 151936, untied (tie_word_embeddings false).
QWEN3_30B_A3B = GPTModelSettings(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                                 num_query_groups=4, kv_channels=128, qk_layernorm=True, vocab_size=151936,
                                 num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, **_DENSE)
# deepseek-ai/DeepSeek-V3 config.json: 61 layers (first_k_dense_replace 3 dense), hidden 7168,
# intermediate_size 18432 (dense layers), 128 heads, MLA: q_lora_rank 1536, kv_lora_rank 512,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; 256 routed experts, 8 per token,
# moe_intermediate_size 2048, 1 shared expert (2048), vocab 129280.
_MLA = dict(multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
            qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, num_query_groups=None)
DEEPSEEK_V3 = GPTModelSettings(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
                               vocab_size=129280, num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                               moe_shared_expert_intermediate_size=2048, moe_layer_freq=(0,) * 3 + (1,) * 58,
                               **_MLA, **_DENSE)
# moonshotai/Kimi-K2-Instruct config.json: 61 layers (first_k_dense_replace 1), hidden 7168,
# intermediate_size 18432, 64 heads, the same MLA dims as DeepSeek-V3, 384 routed experts, 8 per
# token, moe_intermediate_size 2048, 1 shared expert, vocab 163840.
KIMI_K2 = GPTModelSettings(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=64,
                           vocab_size=163840, num_moe_experts=384, moe_router_topk=8, moe_ffn_hidden_size=2048,
                           moe_shared_expert_intermediate_size=2048, moe_layer_freq=(0,) + (1,) * 60,
                           **_MLA, **_DENSE)

PRESETS: dict[str, GPTModelSettings] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": LLAMA3_70B,
    "llama3-405b": LLAMA3_405B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
}


def preset(name: str, **changes: object) -> GPTModelSettings:
    """The named model, with `changes` (GPTModelSettings fields) applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; the presets are {', '.join(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **changes)
