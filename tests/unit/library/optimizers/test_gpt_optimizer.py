"""get_megatron_optimizer on megatron-core's real GPTModel (CPU, gloo).

Tensor parallelism must not change the math: TP=2 takes the same steps as TP=1 (losses,
gradient norms, and each rank's shard of every parameter, to 1e-5 in fp32: the matmuls are
split differently, so round-off differs). Process groups come from megatron-core's
parallel_state, as in a Megatron-LM run.
"""

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig
from megatron_eopt.training.model.gpt import GPTModelSettings
from tests.gpt_training import local_shard, token_batch, train_gpt

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, swiglu=True, vocab_size=64, seq_length=16)
CONFIG = dict(lr=3e-3, min_lr=3e-4, decoupled_lr=1e-3, weight_decay=0.1, clip_grad=0.3)


def fixed_batch() -> torch.Tensor:
    """One batch, reused every step, so that a falling loss shows the optimizer works."""
    return token_batch(SETTINGS, batch=4, seed=1000)


def train(tp: int, steps: int) -> dict:
    return train_gpt(SETTINGS, OptimizerConfig(**CONFIG), tp, steps, seed=7, tokens=fixed_batch())


def _tp_equivalence_body(rank: int, world_size: int, steps: int) -> dict:
    reference = train(tp=1, steps=steps)  # DP=2: both ranks take the same steps on the same batch
    sharded = train(tp=2, steps=steps)
    errors = {}
    for name, (shard, dim, stride) in sharded["params"].items():
        expected = local_shard(reference["params"][name][0], dim, stride, dist.get_rank(), 2)
        errors[name] = (shard - expected).abs().max().item()
    return {
        "loss_pairs": list(zip(reference["losses"], sharded["losses"])),
        "norm_pairs": list(zip(reference["norms"], sharded["norms"])),
        "errors": errors,
        "groups": sharded["groups"],
    }


def test_tensor_parallel_gpt_steps_equal_tp1(run_distributed) -> None:
    for result in run_distributed(_tp_equivalence_body, world_size=2, args=(4,)):
        for tp1, tp2 in result["loss_pairs"]:
            assert abs(tp1 - tp2) < 1e-5, result["loss_pairs"]
        for tp1, tp2 in result["norm_pairs"]:
            assert abs(tp1 - tp2) < 1e-5 * tp1, result["norm_pairs"]
        assert max(n for n, _ in result["norm_pairs"]) > CONFIG["clip_grad"]  # clipping active
        bad = {name: e for name, e in result["errors"].items() if e > 1e-5}
        assert not bad, bad
        assert result["loss_pairs"][-1][0] < result["loss_pairs"][0][0]  # it trains
        # default, no-decay and decoupled-lr groups, every one non-empty at TP=2
        assert len(result["groups"]) == 3 and all(n > 0 for _, n in result["groups"])
