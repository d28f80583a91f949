"""Muon and adaptive Muon with the gram-newton-schulz package's torch path on megatron-core's GPTModel (CPU).

The GPT of test_gram_newton_schulz_gpt.py: fc1 (gate, up), fc2, k and v take the Gram path, q and
proj stay standard. The reference is the fp32 standard iteration ('highest', no Gram). With
`muon_gram_newton_schulz_package` at 'medium': the blocks that take our Gram path report
PACKAGE_PATH, the others as without it; after step 1 a matrix on the standard path equals ours
bitwise, every matrix is no farther from the reference than ours at 'medium' (bf16), and Muon's
fc1/fc2 are within 1e-2 relative (Frobenius; measured 4e-3/5e-3, ours 5e-2/6e-2: these gradients
have small singular values, which bf16's 8 bits resolve worse than float16's 11); after 5 steps
the largest parameter error is within 1.5x ours (measured muon 0.062 vs 0.083, adaptive_muon
0.87 vs 1.39 on a small bias: its elementwise-normalized update flips signs of near-zero entries).
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.ops.gram_newton_schulz_package import PACKAGE_PATH
from megatron_eopt.training.model.gpt import build_gpt_model
from tests.bf16_numerics import bf16_numerics
from tests.gpt_training import model_parallel, params, token_batch, train_steps, unchecked_step
from tests.unit.library.optimizers.test_gram_newton_schulz_gpt import SETTINGS

QKV, FC1, FC2 = (f"decoder.layers.0.{name}.weight" for name in ("self_attention.linear_qkv", "mlp.linear_fc1",
                                                                "mlp.linear_fc2"))

STEPS = 5


def train(optimizer: str, gram: bool, package: bool, precision: str) -> dict:
    """Parameters after step 1 and after STEPS, and `newton_schulz_paths`."""
    with model_parallel(1, seed=7):
        model = build_gpt_model(SETTINGS)
        config = OptimizerConfig(optimizer=optimizer, lr=0.01 if optimizer == "muon" else 0.001, min_lr=0.0,
                                 weight_decay=0.05, clip_grad=1.0, muon_momentum=0.9, muon_fp32_matmul_prec=precision,
                                 muon_gram_newton_schulz=gram, muon_gram_newton_schulz_package=package)
        opt = get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())
        batches = token_batch(SETTINGS, batch=8, seed=0, batches=4)  # 4 batches, taken in turn
        initial, first = params(model), {}

        def keep_first_update(step: int) -> None:
            if step == 0:
                first.update({n: p.detach() - initial[n] for n, p in model.named_parameters()})

        train_steps(model, opt, lambda step: batches[step % len(batches)], STEPS, take_step=unchecked_step,
                    after_step=keep_first_update)
        inner = [getattr(child, "optimizer", child) for child in opt.chained_optimizers]
        paths = {name: p for child in inner for name, p in getattr(child, "newton_schulz_paths", {}).items()}
        return {"first": first, "params": params(model), "paths": paths}


def _body(rank: int, world_size: int, optimizer: str) -> dict:
    with bf16_numerics():
        return {"package": train(optimizer, True, True, "medium"), "ours": train(optimizer, True, False, "medium"),
                "fp32": train(optimizer, False, False, "highest")}


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon"])
def test_package_against_ours_and_fp32(run_distributed, optimizer: str) -> None:
    runs = run_distributed(_body, world_size=1, args=(optimizer,), timeout=600)[0]
    package, ours, fp32 = runs["package"], runs["ours"], runs["fp32"]
    assert set(ours["paths"]) == set(package["paths"])
    for name, kinds in ours["paths"].items():
        assert package["paths"][name] == tuple(PACKAGE_PATH if kind == "gram" else kind for kind in kinds), name
    assert package["paths"][QKV] == ("standard", PACKAGE_PATH, PACKAGE_PATH)
    for name, update in package["first"].items():
        if set(package["paths"].get(name, ("standard",))) == {"standard"}:
            assert torch.equal(update, ours["first"][name]), name  # the same code ran
        elif name in (FC1, FC2) and optimizer == "muon":  # all blocks through the package: float16 round-off
            assert relative(update, fp32["first"][name]) <= 1e-2, name
        assert relative(update, fp32["first"][name]) <= relative(ours["first"][name], fp32["first"][name]), name
    band = max(relative(p, fp32["params"][n]) for n, p in ours["params"].items())
    assert max(relative(p, fp32["params"][n]) for n, p in package["params"].items()) <= 1.5 * band
