"""Per-head orthogonalization of linear_qkv (`muon_split_qkv_per_head`), single process.

The reference slices the fused gradient by hand, head by head, in megatron-core's row order
(per query group: its q heads, then its gate heads with an output gate, then k, then v), and
runs emerging_optimizers' plain `newton_schulz` on each kv_channels x hidden head in fp32
('highest'), scaled by the head's own shape. The optimizer batches the heads into one call, so
only the batched matmul's summation order differs: 2e-6 times the scale (the unscaled heads
differ by up to 1.1e-6 between 2-D and batched calls).
TP, layer-wise and FSDP2 runs are in test_tensor_parallel_muon.py, test_gpt_muon.py,
test_layer_wise_gpt.py and test_fsdp2.py.
"""

import argparse
import math
from types import SimpleNamespace

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

from megatron_eopt import OptimizerConfig
from arguments import add_optimizer_args, validate_args
from megatron_eopt.ops.qk_clip import QKVRows
from megatron_eopt.ops.splits import MatrixLayout, merge_blocks, qkv_row_blocks, split_blocks
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
from tests.newton_schulz_calls import recording_newton_schulz_calls

HEADS, GROUPS, KV, HIDDEN = 6, 2, 4, 20  # GQA: 3 q heads per query group
SCALES = {
    "spectral": lambda m, n: math.sqrt(max(m, n)),
    "shape_scaling": lambda m, n: math.sqrt(max(1.0, m / n)),
    "unit_rms_norm": lambda m, n: math.sqrt(m / n),
}


def head_starts(gate: bool) -> list[int]:
    """First row of every head of the fused weight, written out from megatron-core's layout."""
    per_group = HEADS // GROUPS
    group_rows = (2 * per_group if gate else per_group) * KV + 2 * KV
    starts = []
    for g in range(GROUPS):
        q = [g * group_rows + h * KV for h in range(per_group)]
        gates = [g * group_rows + (per_group + h) * KV for h in range(per_group)] if gate else []
        after_q = g * group_rows + (2 if gate else 1) * per_group * KV
        starts += q + gates + [after_q, after_q + KV]  # k, then v
    return starts


def model_config(gate: bool) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=KV,
                           hidden_size=HIDDEN, attention_output_gate=gate)


def per_head_layout(gate: bool) -> MatrixLayout:
    groups, blocks = qkv_row_blocks(model_config(gate), 1, "qkv")
    return MatrixLayout("qkv", (groups * sum(blocks), HIDDEN), 0, 1, groups, blocks, head_rows=blocks[-1])


@pytest.mark.parametrize("gate", [False, True], ids=["gqa", "gqa_output_gate"])
@pytest.mark.parametrize("scale_mode", list(SCALES))
def test_per_head_update_equals_hand_sliced_heads(gate: bool, scale_mode: str) -> None:
    layout = per_head_layout(gate)
    grad = torch.randn(layout.local_shape, generator=torch.Generator().manual_seed(7))
    param = torch.nn.Parameter(torch.zeros(layout.local_shape))
    optimizer = TensorParallelMuon([{"params": [param], "param_fqns": ["qkv"]}], lr=1.0, momentum=0.0,
                                   weight_decay=0.0, fp32_matmul_prec="highest", scale_mode=scale_mode,
                                   layouts={"qkv": layout})
    param.grad = grad.clone()
    with recording_newton_schulz_calls() as calls:
        optimizer.step()
    expected = torch.zeros_like(grad)
    starts = head_starts(gate)
    assert len(starts) * KV == grad.shape[0] and len(set(starts)) == len(starts)
    for start in starts:
        expected[start:start + KV] = newton_schulz(grad[start:start + KV], steps=5) * SCALES[scale_mode](KV, HIDDEN)
    torch.testing.assert_close(-param.detach(), expected, rtol=0, atol=2e-6 * SCALES[scale_mode](KV, HIDDEN))
    assert calls == [(len(starts), KV, HIDDEN)]  # all heads in one batched call, not a loop


def test_split_and_merge_are_inverse_and_follow_qk_clip_rows() -> None:
    """The per-head blocks are QK-clip's heads: the q rows QKVRows scales per group are the
    group's q heads here, and k/v follow (qk_clip.py's row view)."""
    layout = per_head_layout(gate=False)
    weight = torch.arange(layout.local_shape[0] * HIDDEN, dtype=torch.float32).view(layout.local_shape)
    heads = split_blocks(weight, layout)
    torch.testing.assert_close(merge_blocks(heads, layout), weight, rtol=0, atol=0)
    rows = QKVRows("qkv", GROUPS, HEADS // GROUPS, KV)
    grouped = weight.view(rows.groups, rows.heads_per_group + 2, rows.head_dim, HIDDEN)
    torch.testing.assert_close(torch.stack(heads), grouped.reshape(-1, KV, HIDDEN), rtol=0, atol=0)
    assert layout.global_block_shapes() == [(KV, HIDDEN)] * (GROUPS * (HEADS // GROUPS + 2))


def test_bad_values_raise() -> None:
    with pytest.raises(ValueError, match=r"muon_split_qkv_per_head=True is implemented for optimizer 'muon'.*"
                                         r"got optimizer='adam'"):
        OptimizerConfig(optimizer="adam", muon_split_qkv_per_head=True)
    with pytest.raises(ValueError, match=r"muon_split_qkv_per_head=True needs linear_qkv split into q, k and v "
                                         r"first, and muon_split_qkv says not to split it"):
        OptimizerConfig(optimizer="muon", muon_split_qkv=False, muon_split_qkv_per_head=True)
    with pytest.raises(ValueError, match=r"^--muon-split-qkv-per-head needs linear_qkv split into q, k and v "
                                         r"first, and --muon-no-split-qkv says not to split it"):
        validate_args(add_optimizer_args(argparse.ArgumentParser()).parse_args(
            ["--optimizer", "muon", "--muon-no-split-qkv", "--muon-split-qkv-per-head"]), 1)
    with pytest.raises(ValueError, match=r"^--muon-split-qkv-per-head is implemented for optimizer 'muon'.*"
                                         r"Turn --muon-split-qkv-per-head off"):
        validate_args(add_optimizer_args(argparse.ArgumentParser()).parse_args(
            ["--optimizer", "adam", "--lr", "1e-3", "--muon-split-qkv-per-head"]), 1)
    with pytest.raises(TypeError, match=r"muon_split_qkv_per_head must be a bool; got str 'yes'"):
        OptimizerConfig(optimizer="muon", muon_split_qkv_per_head="yes")
    with pytest.raises(ValueError, match=r"'qkv': head_rows=3 must be > 0 and divide every row block \(12\+4\+4\)"):
        MatrixLayout("qkv", (40, HIDDEN), 0, 1, 2, (12, 4, 4), head_rows=3)
    with pytest.raises(ValueError, match=r"per-head split of a row-parallel"):
        MatrixLayout("qkv", (20, HIDDEN), 1, 2, 1, (), head_rows=4)
    config = OptimizerConfig(optimizer="adaptive_muon", muon_split_qkv_per_head=True)
    assert config.muon_split_qkv_per_head  # adaptive_muon splits per head too


def test_gram_newton_schulz_takes_each_head() -> None:
    """With muon_gram_newton_schulz every 4 x 20 head takes the Gram path (fewer FLOPs there), and
    the update equals the standard iteration's to fp32 round-off (1e-5 of the scale)."""
    layout = per_head_layout(gate=False)
    grad = torch.randn(layout.local_shape, generator=torch.Generator().manual_seed(8))
    updates = {}
    for gram in (False, True):
        param = torch.nn.Parameter(torch.zeros(layout.local_shape))
        optimizer = TensorParallelMuon([{"params": [param], "param_fqns": ["qkv"]}], lr=1.0, momentum=0.0,
                                       weight_decay=0.0, fp32_matmul_prec="highest", layouts={"qkv": layout},
                                       gram_newton_schulz=gram)
        heads = len(layout.global_block_shapes())
        assert optimizer.newton_schulz_paths["qkv"] == ("gram" if gram else "standard",) * heads
        param.grad = grad.clone()
        optimizer.step()
        updates[gram] = -param.detach()
    torch.testing.assert_close(updates[True], updates[False], rtol=0, atol=1e-5 * math.sqrt(HIDDEN))


class LatentAttentionLike(torch.nn.Module):
    """MLA's key/value up-projection of 2 heads (key 3 rows, value 5 rows each, from a latent of 6),
    held as megatron-core's MLASelfAttention holds it: found by name with the MLA config fields."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=2, multi_latent_attention=True, qk_head_dim=3, v_head_dim=5,
                                      qk_pos_emb_head_dim=2, kv_lora_rank=6)
        self.linear_kv_up_proj = torch.nn.Linear(6, 16, bias=False)


def test_per_head_on_latent_attention_changes_nothing_and_says_so() -> None:
    """MLA has no fused linear_qkv: its projections run per head and component (each head's key, its
    value) with the option or without it, and the option says, once, that it does nothing."""
    import warnings
    from unittest import mock

    from megatron_eopt import ParallelGroups, get_megatron_optimizer
    from megatron_eopt.runtime import once

    calls, said = {}, {}
    for per_head in (False, True):
        torch.manual_seed(0)
        model = LatentAttentionLike()
        config = OptimizerConfig(optimizer="muon", lr=0.01, muon_split_qkv_per_head=per_head,
                                 muon_fp32_matmul_prec="highest")
        with mock.patch.object(once, "_GIVEN", set()), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())
        said[per_head] = [str(w.message) for w in caught if "muon_split_qkv_per_head" in str(w.message)]
        model.linear_kv_up_proj.weight.grad = torch.randn(16, 6)
        with recording_newton_schulz_calls() as calls[per_head]:
            optimizer.step()
    assert calls[True] == calls[False] and sorted(shape[-2:] for shape in calls[True]) == [(3, 6), (5, 6)], calls
    assert said == {False: [], True: [
        "OptimizerConfig.muon_split_qkv_per_head=True has no effect on this rank: it splits fused q/k/v weights "
        "only (linear_qkv, and those of docs/fsdp2.md's table), and none of the matrices 'muon' steps here is one "
        "(multi-latent attention's projections are orthogonalized per head and component without it; "
        "docs/tp-muon.md)."]}


def test_cost_model_counts_each_ranks_heads_with_nothing_sent() -> None:
    """muon_tp_mode='auto' and the planner cost a per-head qkv as the step runs it at TP=2: each
    rank its own 5 heads (3 q, k, v of its one query group), no bytes, no collectives."""
    from megatron_eopt.ops.gram_newton_schulz import standard_flops
    from megatron_eopt.ops.muon_cost import step_costs

    groups, blocks = qkv_row_blocks(model_config(gate=False), 2, "qkv")
    layout = MatrixLayout("qkv", (groups * sum(blocks), HIDDEN), 0, 2, groups, blocks, head_rows=KV)
    for mode in ("duplicated", "distributed", "sharded", "blockwise"):
        costs = step_costs([layout], [mode], 2)
        assert [(c.flops, c.bytes_sent, c.collectives) for c in costs] == [(5 * standard_flops(KV, HIDDEN, 5), 0.0, 0)] * 2
