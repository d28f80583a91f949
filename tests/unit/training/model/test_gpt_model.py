"""Tests for megatron_eopt/training/model/ (gpt.py and its pieces): megatron-core's GPTModel on CPU, TP=1 and TP=2."""

from __future__ import annotations

import dataclasses
import math
import socket

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)
from megatron_eopt.training.model.layer_specs import gpt_layer_spec
from megatron_eopt.training.model.sdpa_attention import SDPACoreAttention
from tests.gpt_training import token_batch, train_steps, unchecked_step

SEED = 1234
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def fixed_tokens(settings: GPTModelSettings, batch: int = 4) -> torch.Tensor:
    return token_batch(settings, batch, seed=0)


@pytest.fixture(scope="module")
def tp1():
    """torch.distributed (gloo, world size 1) and megatron model parallel at TP=1."""
    owns_group = not torch.distributed.is_initialized()  # another module may have set one up
    if owns_group:
        with socket.socket() as sock:  # a free port; init_method leaves MASTER_* env vars alone
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    assert torch.distributed.get_world_size() == 1
    initialize_model_parallel(tensor_model_parallel_size=1, seed=SEED)
    yield
    destroy_model_parallel()
    if owns_group:
        torch.distributed.destroy_process_group()


# --- SDPACoreAttention -------------------------------------------------------------------------


def attention_config(heads: int, groups: int, **kwargs) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * 8,
        num_attention_heads=heads,
        num_query_groups=groups,
        use_cpu_initialization=True,
        attention_dropout=0.0,  # megatron's default is 0.1
        **kwargs,
    )


def reference_attention(q, k, v, scale: float) -> torch.Tensor:
    """softmax(Q K^T * scale + causal mask) V with explicit matmuls, megatron layouts."""
    sq, b, heads, dim = q.shape
    repeat = heads // k.size(2)
    out = torch.empty(sq, b, heads, dim, dtype=q.dtype)
    causal = torch.ones(sq, k.size(0), dtype=torch.bool).triu(1)  # True above the diagonal
    for batch in range(b):
        for head in range(heads):
            qh = q[:, batch, head]  # [sq, d]
            kh, vh = k[:, batch, head // repeat], v[:, batch, head // repeat]  # [sk, d]
            scores = (qh @ kh.T) * scale
            scores = scores.masked_fill(causal, float("-inf"))
            out[:, batch, head] = scores.softmax(dim=-1) @ vh
    return out.reshape(sq, b, heads * dim)


@pytest.mark.parametrize("softmax_scale", [None, 0.3])
@pytest.mark.parametrize("heads,groups", [(8, 2), (8, 8)], ids=["gqa", "mha"])
def test_sdpa_core_attention_matches_reference(heads, groups, softmax_scale):
    attention = SDPACoreAttention(
        config=attention_config(heads, groups),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=softmax_scale,
        pg_collection=None,
    )
    generator = torch.Generator().manual_seed(0)
    sq, b, dim = 7, 3, 8
    q = torch.randn(sq, b, heads, dim, generator=generator, requires_grad=True)
    k = torch.randn(sq, b, groups, dim, generator=generator, requires_grad=True)
    v = torch.randn(sq, b, groups, dim, generator=generator, requires_grad=True)
    scale = 1 / math.sqrt(dim) if softmax_scale is None else softmax_scale

    out = attention(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=None)
    expected = reference_attention(q, k, v, scale)
    assert out.shape == (sq, b, heads * dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)

    grad_out = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=0)


def test_sdpa_core_attention_rejects_unsupported_options():
    config = attention_config(8, 2)
    with pytest.raises(ValueError, match="arbitrary"):
        SDPACoreAttention(config, 1, AttnMaskType.arbitrary, "self")
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    q, kv = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="packed"):
        attention(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="sq == sk"):
        attention(q[:1], kv, kv, None)
    with pytest.raises(ValueError, match="softmax_type"):
        learnable = attention_config(8, 2, softmax_type="learnable")
        SDPACoreAttention(learnable, 1, AttnMaskType.causal, "self")


def test_cpu_layer_spec_swaps_core_attention_without_leaking():
    spec = gpt_layer_spec(use_cuda=False)
    assert spec.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    fresh = get_gpt_layer_local_spec()
    assert fresh.submodules.self_attention.submodules.core_attention is DotProductAttention


# --- the model at TP=1 ------------------------------------------------------------------------


def test_forward_backward_on_cpu(tp1):
    settings = GPTModelSettings()
    model = build_gpt_model(settings)
    tokens = fixed_tokens(settings)

    loss = gpt_loss(model, tokens)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(settings.vocab_size)) < 0.5

    # gpt_loss is the mean next-token cross entropy of the model's logits.
    logits = model(
        input_ids=tokens[:, :-1],
        position_ids=torch.arange(settings.seq_length).expand(tokens.size(0), -1),
        attention_mask=None,
    )
    expected = F.cross_entropy(logits.reshape(-1, settings.vocab_size), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)

    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} got an all-zero gradient"
    qkv = dict(model.named_parameters())[QKV]
    assert qkv.tensor_model_parallel and qkv.partition_dim == 0


def test_adamw_reduces_loss(tp1):
    settings = GPTModelSettings()
    model = build_gpt_model(settings)
    tokens = fixed_tokens(settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train_steps(model, optimizer, tokens, 8, take_step=unchecked_step).losses
    assert losses[-1] < losses[0] - 0.5, losses


def test_bf16_model_has_bf16_parameters(tp1):
    model = build_gpt_model(GPTModelSettings(bf16=True))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(gpt_loss(model, fixed_tokens(GPTModelSettings())))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_attention_heads": 8, "num_query_groups": 3}, "divisible by num_query_groups"),
        ({"hidden_size": 60, "num_attention_heads": 8}, "divisible by num_attention_heads"),
        ({"seq_length": 64, "max_position_embeddings": 32}, "max_position_embeddings"),
        ({"num_layers": 0}, "num_layers"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
        ({"normalization": "BatchNorm"}, "normalization"),
    ],
)
def test_settings_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTModelSettings(**kwargs)


def test_build_rejects_what_tp_cannot_split():
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size \(3\)"):
        GPTModelSettings().check_tensor_parallel(3)


def test_experts_with_tensor_parallelism_need_sequence_parallelism():
    """megatron's MoELayer refuses TP without it in training: refused when the model is built."""
    with pytest.raises(ValueError, match=r"num_moe_experts \(4\) with tensor_model_parallel_size \(2\) "
                                         r"needs sequence_parallel \(False\)"):
        GPTModelSettings(num_moe_experts=4).check_tensor_parallel(2)
    GPTModelSettings(num_moe_experts=4, sequence_parallel=True).check_tensor_parallel(2)


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rope_runs_on_cpu_with_the_rope_angles(tp1, rotary_percent):
    """RoPE's angles from its definition (position p, pair i of the rotated d dimensions:
    p * base^(-2i / d), each angle used by the i-th component of both halves), and a model
    with RoPE (no position table) trains on CPU."""
    settings = GPTModelSettings(position_embedding_type="rope", rotary_base=500, rotary_percent=rotary_percent)
    model = build_gpt_model(settings)
    assert not any("position_embeddings" in name for name, _ in model.named_parameters())
    rotated = int(settings.hidden_size // settings.num_attention_heads * rotary_percent)
    inverse_frequency = 500.0 ** (-torch.arange(0, rotated, 2, dtype=torch.float32) / rotated)
    angles = torch.arange(settings.seq_length, dtype=torch.float32)[:, None] * inverse_frequency
    expected = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    torch.testing.assert_close(model.rotary_pos_emb(settings.seq_length), expected)
    loss = gpt_loss(model, fixed_tokens(settings))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_xavier_uniform_init_draws_within_the_full_matrices_bound(tp1):
    """--init-method-xavier-uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of each full
    matrix, so the largest |w| is just under a and the std a / sqrt(3); N(0, 0.02) is not."""
    xavier = build_gpt_model(GPTModelSettings(init_method_xavier_uniform=True))
    normal = build_gpt_model(GPTModelSettings())
    for model, expected in ((xavier, True), (normal, False)):
        for name, weight in model.named_parameters():
            if weight.dim() != 2:
                continue
            bound = math.sqrt(6 / sum(weight.shape))
            within = 0.95 * bound < weight.abs().max() <= bound
            spread = abs(weight.std().item() - bound / math.sqrt(3)) < 0.05 * bound
            assert (within and spread) == expected, (name, weight.abs().max(), bound)


def test_embedding_init_std_is_the_embeddings_own(tp1):
    weights = dict(build_gpt_model(GPTModelSettings(embedding_init_method_std=0.5)).named_parameters())
    for name, std in (("embedding.word_embeddings.weight", 0.5), ("embedding.position_embeddings.weight", 0.5),
                      ("decoder.layers.0.self_attention.linear_qkv.weight", 0.02)):
        assert weights[name].std().item() == pytest.approx(std, rel=0.1), name


@pytest.mark.parametrize("activation", ["squared_relu", "quick_geglu"])
def test_mlp_activations_are_megatron_lms(tp1, activation):
    """--squared-relu: fc2(relu(fc1 x)^2); --quick-geglu: a gated unit, fc2(q(gate) * up) with
    q(z) = z * sigmoid(1.702 z), gate and up the two halves of fc1's output."""
    settings = GPTModelSettings(swiglu=False, activation=activation)
    mlp = build_gpt_model(settings).decoder.layers[0].mlp
    x = torch.randn(5, 2, settings.hidden_size, generator=torch.Generator().manual_seed(0))
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    hidden = x @ fc1.T
    if activation == "squared_relu":
        assert fc1.shape[0] == settings.ffn_hidden_size
        hidden = torch.relu(hidden) ** 2
    else:
        assert fc1.shape[0] == 2 * settings.ffn_hidden_size
        gate, up = hidden.chunk(2, dim=-1)
        hidden = gate * torch.sigmoid(1.702 * gate) * up
    output, _ = mlp(x)
    torch.testing.assert_close(output, hidden @ fc2.T, rtol=1e-5, atol=1e-6)


def test_llama3_rope_scaling_and_position_interpolation_angles(tp1):
    """Llama 3.x's frequency scaling written out (original context 8192, low/high frequency
    factors 1 and 4): wavelengths below 8192/4 kept, above 8192 divided by the factor, smoothed
    between; with interpolation factor 2 the positions are halved. Base 500000 and head width 8
    give one frequency of each kind."""
    settings = GPTModelSettings(position_embedding_type="rope", rotary_base=500000, rope_scaling=True,
                                rope_scaling_factor=8.0, rotary_seq_len_interpolation_factor=2)
    model = build_gpt_model(settings)
    frequencies = [500000.0 ** (-i / 8) for i in (0, 2, 4, 6)]
    wavelengths = [2 * math.pi / f for f in frequencies]
    assert [w < 2048 for w in wavelengths] == [True, True, False, False] and wavelengths[3] > 8192
    scaled = []
    for frequency, wavelength in zip(frequencies, wavelengths):
        smooth = (8192 / wavelength - 1) / (4 - 1)
        scaled.append(frequency if wavelength < 2048 else frequency / 8 if wavelength > 8192
                      else (1 - smooth) * frequency / 8 + smooth * frequency)
    angles = (torch.arange(settings.seq_length, dtype=torch.float64)[:, None] / 2) * torch.tensor(scaled, dtype=torch.float64)
    expected = torch.cat((angles, angles), dim=-1)[:, None, None, :].float()
    torch.testing.assert_close(model.rotary_pos_emb(settings.seq_length), expected)


def test_interleaved_rope_is_half_rope_with_permuted_query_key_rows(tp1):
    """Interleaved RoPE rotates dimensions (2i, 2i + 1) by angle i, the default (i, i + d/2):
    giving the default model the interleaved one's weights with each query/key head's rows
    reordered 0, 2, 4, 6, 1, 3, 5, 7 gives the same loss (the dot products are unchanged by a
    common permutation); without the reordering it differs. Rows from megatron's QKV layout: per
    group 4 query heads, a key, a value."""
    settings = GPTModelSettings(position_embedding_type="rope", init_method_std=0.2)  # logits of order 1
    interleaved = build_gpt_model(dataclasses.replace(settings, rotary_interleaved=True))
    halves = build_gpt_model(settings)
    state = {name: tensor.clone() for name, tensor in interleaved.state_dict().items() if tensor is not None}
    tokens = fixed_tokens(settings)
    halves.load_state_dict(state, strict=False)
    unordered = gpt_loss(halves, tokens)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    for name, weight in state.items():
        if name.endswith("linear_qkv.weight"):
            heads = weight.view(2, 6, 8, -1)  # groups, (4 query heads, key, value), head width, hidden
            heads[:, :5] = heads[:, :5, order].clone()
    halves.load_state_dict(state, strict=False)
    expected = gpt_loss(interleaved, tokens)
    torch.testing.assert_close(gpt_loss(halves, tokens), expected, rtol=1e-6, atol=1e-6)
    assert abs(unordered.item() - expected.item()) > 1e-3 * expected.item()


def test_initialize_model_parallel_needs_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        initialize_model_parallel(tensor_model_parallel_size=1, seed=SEED)


# --- tensor parallelism -----------------------------------------------------------------------


def tp_losses_and_qkv(rank: int, world_size: int, seed: int) -> dict:
    """On every rank: loss and linear_qkv weight/grad at TP=1, then at TP=world_size."""
    settings = GPTModelSettings()
    tokens = fixed_tokens(settings)
    results = {}
    for tp in (1, world_size):  # TP=1 here is data parallel: every rank holds the full model
        initialize_model_parallel(tensor_model_parallel_size=tp, seed=seed)
        try:
            model = build_gpt_model(settings)
            loss = gpt_loss(model, tokens)
            loss.backward()
            qkv = dict(model.named_parameters())[QKV]
            results[tp] = {
                "loss": loss.item(),
                "qkv": qkv.detach().clone(),
                "qkv_grad": qkv.grad.clone(),
                "partition_dim": qkv.partition_dim,
            }
        finally:
            destroy_model_parallel()
    return results


def test_tensor_parallel_2_matches_tp1(run_distributed):
    per_rank = run_distributed(tp_losses_and_qkv, 2, args=(SEED,))
    reference = per_rank[0][1]
    for rank, results in enumerate(per_rank):
        assert results[2]["loss"] == pytest.approx(reference["loss"], abs=1e-5), rank
    dim = per_rank[0][2]["partition_dim"]
    shards = [results[2]["qkv"] for results in per_rank]
    assert shards[0].shape[dim] * 2 == reference["qkv"].shape[dim]
    torch.testing.assert_close(torch.cat(shards, dim=dim), reference["qkv"], atol=0, rtol=0)
    grads = torch.cat([results[2]["qkv_grad"] for results in per_rank], dim=dim)
    torch.testing.assert_close(grads, reference["qkv_grad"], atol=1e-6, rtol=1e-5)


# --- The QKV split Muon uses, against megatron-core's own ---------------------------------------


def test_qkv_row_blocks_are_the_rows_megatron_core_takes_each_projection_from(tp1):
    """Each of our blocks (q[, gate], k, v over all query groups) is exactly the set of
    linear_qkv rows that megatron-core's `get_query_key_value_tensors` reads one projection from.

    Independent of our code: the weight maps row r to the value r, so each projection megatron
    returns lists its rows. Checked with and without the output gate, with k/v smaller than q
    so that a misplaced gate block is caught.
    """
    from megatron.core.transformer.spec_utils import build_module

    from megatron_eopt.ops.splits import MatrixLayout, qkv_row_blocks, split_blocks

    for gate in (False, True):
        config = attention_config(heads=4, groups=2, attention_output_gate=gate)
        spec = get_gpt_layer_local_spec().submodules.self_attention
        attention = build_module(spec, config=config, layer_number=1)
        weight = attention.linear_qkv.weight
        rows = weight.shape[0]
        with torch.no_grad():
            weight.zero_()
            weight[:, 0] = torch.arange(rows, dtype=weight.dtype)
        hidden = torch.zeros(1, 1, config.hidden_size)
        hidden[..., 0] = 1.0
        projections = attention.get_query_key_value_tensors(hidden, None, output_gate=gate)
        megatron_rows = {frozenset(p.flatten().round().long().tolist()) for p in projections}

        groups, blocks = qkv_row_blocks(config, tp_size=1, name="linear_qkv.weight")
        layout = MatrixLayout("linear_qkv.weight", tuple(weight.shape), num_row_groups=groups, row_blocks=blocks)
        ours = split_blocks(torch.arange(rows).unsqueeze(1), layout)
        assert {frozenset(b.flatten().tolist()) for b in ours} == megatron_rows, f"attention_output_gate={gate}"
