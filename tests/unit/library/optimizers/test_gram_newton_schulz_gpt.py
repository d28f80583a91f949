"""Muon and adaptive Muon with Gram Newton-Schulz on megatron-core's GPTModel (CPU, one rank).

A GPT whose fc1 blocks/fc2 (128 x 32, 32 x 128) and k/v blocks (16 x 32) take the Gram path and
whose q and proj (32 x 32) stay standard (`newton_schulz_paths` is checked).
- fp32 ('highest'), 10 steps (adaptive_muon at lr 1e-3: at 1e-2 its elementwise-normalized
  update makes this tiny GPT chaotic): every parameter within 1e-3 relative (Frobenius) of the standard
  iteration's run (measured <= 2e-5: Gram and standard are the same polynomial, summed in
  another order).
- bf16 ('medium', bf16 products as a native bf16 CPU runs them: tests/bf16_numerics.py), 100
  steps, data seeds 0-2 for each: the mean over seeds of the last-10-step mean loss is no worse
  than the standard iteration's mean by more than the standard's seed spread (max - min). One
  seed against another is noise: 8 seeds of the standard run spread 0.303-0.365 here, and the
  issue's AMX machine saw one seed 16% worse (docs/newton-schulz.md). A broken Gram path (a wrong
  polynomial or restart) trains far worse than that.
"""

import pytest

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model
from tests.bf16_numerics import bf16_numerics
from tests.gpt_training import model_parallel, params, token_batch, train_steps, unchecked_step

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, vocab_size=64, seq_length=8)


def train(optimizer: str, gram: bool, precision: str, steps: int, data_seed: int = 0) -> dict:
    with model_parallel(1, seed=7):
        model = build_gpt_model(SETTINGS)
        # adaptive_muon's update is elementwise normalized (RMS ~1 before the scale): a smaller lr.
        config = OptimizerConfig(optimizer=optimizer, lr=0.01 if optimizer == "muon" else 0.001, min_lr=0.0, weight_decay=0.05, clip_grad=1.0,
                                 muon_momentum=0.9, muon_fp32_matmul_prec=precision,
                                 muon_gram_newton_schulz=gram)
        opt = get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())
        batches = token_batch(SETTINGS, batch=8, seed=data_seed, batches=4)  # 4 batches, taken in turn
        run = train_steps(model, opt, lambda step: batches[step % len(batches)], steps, take_step=unchecked_step)
        inner = [getattr(child, "optimizer", child) for child in opt.chained_optimizers]  # FP32Optimizer's
        paths = {name: p for child in inner for name, p in getattr(child, "newton_schulz_paths", {}).items()}
        return {"losses": run.losses, "params": params(model), "paths": paths}


def _fp32_body(rank: int, world_size: int, optimizer: str) -> dict:
    return {"standard": train(optimizer, False, "highest", 10), "gram": train(optimizer, True, "highest", 10)}


@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon"])
def test_fp32_ten_steps_match_standard(run_distributed, optimizer: str) -> None:
    runs = run_distributed(_fp32_body, world_size=1, args=(optimizer,), timeout=600)[0]
    paths = runs["gram"]["paths"]
    assert set(paths["decoder.layers.0.mlp.linear_fc1.weight"]) == {"gram"}  # (gate, up) with SwiGLU
    assert paths["decoder.layers.0.mlp.linear_fc2.weight"] == ("gram",)
    assert paths["decoder.layers.0.self_attention.linear_qkv.weight"] == ("standard", "gram", "gram")
    assert paths["decoder.layers.0.self_attention.linear_proj.weight"] == ("standard",)
    assert set(runs["standard"]["paths"]) == set(paths)
    for name, expected in runs["standard"]["params"].items():
        got = runs["gram"]["params"][name]
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-3, name


BF16_SEEDS = (0, 1, 2)


def _bf16_body(rank: int, world_size: int) -> dict:
    with bf16_numerics():
        return {"standard": [train("muon", False, "medium", 100, seed)["losses"] for seed in BF16_SEEDS],
                "gram": [train("muon", True, "medium", 100, seed)["losses"] for seed in BF16_SEEDS]}


# make test-slow: a training-quality comparison (100 steps x seeds); the Gram path's numerics are checked
# against float64 in make test (test_gram_newton_schulz.py).
@pytest.mark.slow
def test_bf16_hundred_steps_loss_within_noise(run_distributed) -> None:
    runs = run_distributed(_bf16_body, world_size=1, timeout=900)[0]

    def tail(losses: list[float]) -> float:
        return sum(losses[-10:]) / 10

    standard = [tail(losses) for losses in runs["standard"]]
    gram = [tail(losses) for losses in runs["gram"]]
    assert runs["standard"][0][-1] < runs["standard"][0][0] - 0.5  # it trains
    spread = max(standard) - min(standard)
    assert sum(gram) / len(gram) <= sum(standard) / len(standard) + spread, (gram, standard)
