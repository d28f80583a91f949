"""optimizer='muon' through get_megatron_optimizer on megatron-core's GPTModel shards.

TP=2 and TP=4 (GQA 8 heads / 4 query groups, SwiGLU) take the same steps as TP=1 in the
'duplicated', 'distributed', 'sharded' and 'auto' (calibrated here) modes: every rank's shard
of every parameter matches the TP=1 parameter to 1e-5 after 3 steps (fp32; Newton-Schulz
round-off differs with the matrix split), and the losses agree to 1e-5. Each mode is one call on
4 ranks: TP=1 (DP=4), TP=2 (DP=2) and TP=4 run one after the other on the same batch. With
`muon_split_qkv_per_head` as well (each of the 16 q, k and v heads per layer its own matrix;
TP=4 holds one query group per rank), where linear_qkv must also differ from the per-group split.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig
from megatron_eopt.ops.muon_cost import clear_calibrations
from megatron_eopt.training.model.gpt import GPTModelSettings
from tests.gpt_training import local_shard, token_batch, train_gpt

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=16)


def batch() -> torch.Tensor:
    return token_batch(SETTINGS, batch=4, seed=5)


def train_muon(tp: int, tp_mode: str, steps: int, per_head: bool = False) -> dict:
    config = OptimizerConfig(optimizer="muon", lr=0.02, min_lr=0.0, weight_decay=0.05, clip_grad=1.0,
                             muon_tp_mode=tp_mode, muon_momentum=0.9, muon_split_qkv_per_head=per_head,
                             muon_fp32_matmul_prec="highest")  # fp32: TP=n equals TP=1 to 1e-5
    try:
        return train_gpt(SETTINGS, config, tp, steps, seed=11, tokens=batch())
    finally:
        clear_calibrations()  # 'auto' calibrates over the TP group; the reused workers start clean


def _modes_body(rank: int, world_size: int, tp_mode: str, per_head: bool) -> dict:
    reference = train_muon(1, tp_mode, steps=3, per_head=per_head)
    result = {}
    if per_head:  # the option reaches the optimizer: linear_qkv moves otherwise than per group
        per_group = train_muon(1, tp_mode, steps=3)["params"]
        result["qkv_difference"] = max((value - per_group[name][0]).abs().max().item()
                                       for name, (value, _, _) in reference["params"].items() if "linear_qkv" in name)
    for tp in (2, 4):
        run = train_muon(tp, tp_mode, steps=3, per_head=per_head)
        tp_rank = run["tp_rank"]
        errors = {
            name: (shard - local_shard(reference["params"][name][0], dim, stride, tp_rank, tp)).abs().max().item()
            for name, (shard, dim, stride) in run["params"].items()
        }
        result[tp] = {"errors": errors, "losses": list(zip(reference["losses"], run["losses"]))}
    return result


# `make test` runs every mode per head and the duplicated mode on the fused qkv (also at TP=2 x DP=2 in
# test_layer_wise_gpt.py); the other modes on the fused qkv run in `make test-slow` (~13 s at 4 ranks).
MODES = [pytest.param(mode, per_head, marks=[pytest.mark.slow] if not per_head and mode != "duplicated" else [],
                      id=f"{mode}-{'per_head' if per_head else 'qkv'}")
         for per_head in (False, True) for mode in ("duplicated", "distributed", "sharded", "auto")]


@pytest.mark.parametrize("tp_mode,per_head", MODES)
def test_muon_on_gpt_shards_equals_tp1(run_distributed, tp_mode: str, per_head: bool) -> None:
    for per_rank in run_distributed(_modes_body, world_size=4, args=(tp_mode, per_head), timeout=600):
        if per_head:
            assert per_rank.pop("qkv_difference") > 1e-3
        for tp, result in per_rank.items():
            bad = {name: e for name, e in result["errors"].items() if e > 1e-5}
            assert not bad, (tp_mode, tp, bad)
            for tp1, tpn in result["losses"]:
                assert abs(tp1 - tpn) < 1e-5, (tp_mode, tp, result["losses"])
            assert result["losses"][-1][0] < result["losses"][0][0]  # it trains
