"""Tiny models that other engines hold (Hugging Face `transformers`, torchtitan), built from their
model args on CPU without any download, and the routes we expect for them.

`intermediate_size == vocab_size` on purpose: each MLP's gate/up projection then has the output
head's shape, so a rule that found the head by shape alone would take them too.
"""

import torch

VOCAB, HIDDEN, LAYERS = 64, 32, 2


def llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=VOCAB, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def torchtitan_llama3() -> torch.nn.Module:
    """torchtitan's Llama3Model, its debug model's recipe at a tiny size (untied)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    torch.manual_seed(0)
    heads = 4
    config = Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
        norm=RMSNorm.Config(normalized_shape=HIDDEN),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=HIDDEN, n_heads=heads, hidden_dim=VOCAB, fuse_qkv=False, attn_backend="varlen",
            rope=ComplexRoPE.Config(dim=HIDDEN // heads, max_seq_len=64, theta=500000, scaling="none")),
    )
    return config.build()


def torchtitan_qwen3_moe(experts: int = 4) -> torch.nn.Module:
    """torchtitan's Qwen3Model with MoE layers (its debugmodel_moe recipe at a tiny size, untied,
    q/k/v unfused), states initialized: each layer's `moe.router.gate` [E, D] and
    `moe.routed_experts.inner_experts` (GroupedExperts: w1_EFD, w3_EFD [E, F, D], w2_EDF [E, D, F]).
    F == VOCAB: each expert's w1/w3 block has the output head's shape.

    Its forward does not run on CPU with gradients: torchtitan 0.3's language-model attention is
    varlen (aten::_flash_attention_forward, CUDA only) or flex ("FlexAttention does not support
    backward on CPU"); tests step it with synthetic gradients (`synthetic_gradients`)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    torch.manual_seed(0)
    heads, head_dim = 4, 8
    config = Qwen3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB, norm=_qwen3_norm(HIDDEN),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB),
        layers=_build_qwen3_moe_layers(
            n_layers=LAYERS, dim=HIDDEN, n_heads=heads, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=VOCAB,
            num_experts=experts, top_k=2, fuse_qkv=False, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0)),
    )
    model = config.build()
    model.init_states()
    return model


def synthetic_gradients(model: torch.nn.Module, seed: int) -> None:
    """A gradient for every parameter from `seed` and the parameter's index, the same full tensor on
    every rank; under FSDP2 each rank takes its shard of it (the parameter's own placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for index, param in enumerate(model.parameters()):
        generator = torch.Generator().manual_seed(1000 * seed + index)
        full = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements)
        param.grad = full


# Why each kind of parameter goes where: (optimizer, routed_because), by the parameter name's end.
EMBEDDING_LOOKUP = ("adam", "lookup table (nn.Embedding)")
TORCHTITAN_HEAD = ("adam", f"output head (Linear of the model itself, {VOCAB} rows: the vocabulary's)")
HIDDEN_MATRIX = ("muon", "hidden matrix")
VECTOR = ("adam", "1-D, not a matrix")
EXPERTS_TENSOR = ("muon", "experts tensor (3-D): one matrix per expert")


def expected_llama_routes(model: torch.nn.Module, tied: bool) -> dict[str, tuple[str, str]]:
    special = {"model.embed_tokens.weight": ("adam", "input and output embedding, tied (get_input_embeddings, "
                                                     "get_output_embeddings)" if tied else
                                             "input embedding (get_input_embeddings)")}
    if not tied:
        special["lm_head.weight"] = ("adam", "output embedding (get_output_embeddings)")
    return _expected(model, special)


def expected_torchtitan_routes(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    return _expected(model, {"tok_embeddings.weight": EMBEDDING_LOOKUP, "lm_head.weight": TORCHTITAN_HEAD})


def expected_torchtitan_moe_routes(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """torchtitan's Qwen3 MoE: as its Llama3, and each GroupedExperts tensor to Muon per expert."""
    experts = {f"layers.{layer}.moe.routed_experts.inner_experts.{name}": EXPERTS_TENSOR
               for layer in range(LAYERS) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    return _expected(model, {"tok_embeddings.weight": EMBEDDING_LOOKUP, "lm_head.weight": TORCHTITAN_HEAD, **experts})


def _expected(model: torch.nn.Module, special: dict) -> dict[str, tuple[str, str]]:
    routes = {}
    for name, param in model.named_parameters():
        routes[name] = special.get(name) or (HIDDEN_MATRIX if param.dim() == 2 else VECTOR)
    assert set(special) <= set(routes), (sorted(special), sorted(routes))
    return routes
