"""Muon per component on `transformers` models' fused weights and N-D experts, in one process.

Each model is built from a tiny config (no download) and takes one backward pass; Muon steps
once (fp32, muon_fp32_matmul_prec='highest', no weight decay, no clipping). Its first update of
every component (q, k, v of a fused QKV weight; gate and up of a fused MLP weight; every expert's
gate, up and down) must equal lr * sqrt(max(m, n)) times emerging_optimizers' plain single-matrix
Newton-Schulz of that component's own gradient block, cut out here from the layout transformers'
forward uses. Orthogonalizing a fused weight whole, or a batch of experts as one matrix, gives
another update (cosine ~0.6 to the per-component one, measured on Qwen3-MoE), so each check fails
without its feature. Also: which parameters take Muon (experts yes, their biases, a conv weight
and a 3-D tensor of an unknown module no).
"""

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

transformers = pytest.importorskip("transformers")

LR = 0.1
TOLERANCE = 2e-5  # relative to the update's largest entry: fp32 round-off of two Newton-Schulz orders
CONFIG = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.0, clip_grad=0.0, muon_fp32_matmul_prec="highest")


def reference_update(gradient_block: torch.Tensor) -> torch.Tensor:
    """lr * spectral scale * Newton-Schulz of one matrix, emerging_optimizers' own function."""
    torch.set_float32_matmul_precision("highest")
    rows, cols = gradient_block.shape
    return LR * max(rows, cols) ** 0.5 * muon_utils.newton_schulz(gradient_block.float(), 5, "quintic")


def first_update(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[dict, dict, dict]:
    """(gradients, updates, optimizer name) of every parameter after one Muon step."""
    torch.manual_seed(0)
    optimizer = get_megatron_optimizer(CONFIG, [model])
    model(input_ids, labels=input_ids).loss.backward()
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    gradients = {name: p.grad.detach().clone() for name, p in params.items() if p.grad is not None}
    optimizer.step()
    updates = {name: before[name] - p.detach() for name, p in params.items()}
    routed = {fqn: group["optimizer"] for child in optimizer.chained_optimizers
              for group in child.param_groups for fqn in group["param_fqns"]}
    return gradients, updates, routed


def assert_components(name: str, gradient: torch.Tensor, update: torch.Tensor, blocks: list) -> None:
    """Each `blocks` entry (an index into the last two dims' rows, or a row index tensor) is one
    matrix: its update must be the reference of its own gradient rows."""
    for index, rows in enumerate(blocks):
        expected = reference_update(gradient[rows])
        error = (update[rows] - expected).abs().max().item() / expected.abs().max().item()
        assert error <= TOLERANCE, (name, index, error)


def test_phi3_qkv_and_gate_up_per_component() -> None:
    config = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(config).float()
    gradients, updates, routed = first_update(model, torch.randint(0, 64, (2, 8)))
    head_dim, q_rows, kv_rows = 8, 4 * 8, 2 * 8
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert routed[qkv] == "muon"
    assert_components(qkv, gradients[qkv], updates[qkv], [slice(0, q_rows), slice(q_rows, q_rows + kv_rows),
                                                         slice(q_rows + kv_rows, q_rows + 2 * kv_rows)])
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    assert_components(gate_up, gradients[gate_up], updates[gate_up], [slice(0, 40), slice(40, 80)])
    assert head_dim * 4 == config.hidden_size


PER_HEAD_QKV = {
    "gpt_neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)),
        "gpt_neox.layers.0.attention.query_key_value.weight"),
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=64, hidden_size=32, n_layer=1, n_head=4)), "transformer.h.0.self_attention.query_key_value.weight"),
}


@pytest.mark.parametrize("family", sorted(PER_HEAD_QKV))
def test_per_head_query_key_value_per_component(family: str) -> None:
    build, name = PER_HEAD_QKV[family]
    torch.manual_seed(0)
    gradients, updates, _ = first_update(build().float(), torch.randint(0, 64, (2, 8)))
    head_dim, heads = 8, 4
    # transformers views the rows as [heads, 3, head_dim]: per head its q, k and v rows.
    rows = torch.arange(3 * heads * head_dim).view(heads, 3, head_dim)
    assert_components(name, gradients[name], updates[name], [rows[:, part].reshape(-1) for part in range(3)])


def _tiny_qwen3_moe() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(config).float()


def test_qwen3_moe_experts_per_expert_gate_and_up() -> None:
    torch.manual_seed(0)
    gradients, updates, routed = first_update(_tiny_qwen3_moe(), torch.randint(0, 64, (4, 8)))
    gate_up, down = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    assert routed[gate_up] == routed[down] == "muon"
    for expert in range(4):
        assert_components(gate_up, gradients[gate_up][expert], updates[gate_up][expert], [slice(0, 24), slice(24, 48)])
        assert_components(down, gradients[down][expert], updates[down][expert], [slice(0, 32)])


def test_gpt_oss_transposed_interleaved_experts_and_their_biases() -> None:
    """GPT-OSS stores each expert [in, out] (`is_transposed`) with gate and up rows alternating
    (`is_concatenated=False`: gate = columns 0, 2, 4, ...); its per-expert biases are vectors."""
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"])
    torch.manual_seed(0)
    gradients, updates, routed = first_update(transformers.GptOssForCausalLM(config).float(),
                                              torch.randint(0, 64, (4, 8)))
    gate_up, down = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    assert routed[gate_up] == routed[down] == "muon"
    assert routed[gate_up + "_bias"] == routed[down + "_bias"] == "adam"
    for expert in range(4):
        matrix = lambda t: t[expert].T  # [out, in]
        assert_components(gate_up, matrix(gradients[gate_up]), matrix(updates[gate_up]),
                          [torch.arange(0, 48, 2), torch.arange(1, 48, 2)])
        assert_components(down, matrix(gradients[down]), matrix(updates[down]), [slice(0, 32)])


class _NotExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.table = torch.nn.Parameter(torch.randn(2, 5, 6))  # a 3-D tensor of a module no table knows
        self.linear = torch.nn.Linear(6, 6)


def test_conv_and_unknown_nd_parameters_take_the_scalar_optimizer() -> None:
    optimizer = get_megatron_optimizer(CONFIG, [_NotExperts()])
    routed = {fqn: group["optimizer"] for child in optimizer.chained_optimizers
              for group in child.param_groups for fqn in group["param_fqns"]}
    assert routed == {"conv.weight": "adam", "conv.bias": "adam", "table": "adam", "linear.weight": "muon",
                      "linear.bias": "adam"}


def test_adaptive_muon_leaves_experts_to_the_scalar_optimizer() -> None:
    """Only optimizers that declare `orthogonalizes_matrix_batches` take N-D experts."""
    config = OptimizerConfig(optimizer="adaptive_muon", lr=LR, muon_fp32_matmul_prec="highest")
    optimizer = get_megatron_optimizer(config, [_tiny_qwen3_moe()])
    routed = {fqn: group["optimizer"] for child in optimizer.chained_optimizers
              for group in child.param_groups for fqn in group["param_fqns"]}
    assert routed["model.layers.0.mlp.experts.gate_up_proj"] == "adam"
