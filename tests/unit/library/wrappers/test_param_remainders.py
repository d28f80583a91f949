"""store_param_remainders: a bf16 parameter plus an int16 remainder is the exact fp32 main weight.

Reference: the fp32-main-copy path (MixedPrecisionOptimizer without the precision-aware
optimizer, itself tested against torch.optim in test_optimizer_step.py), run on the same
gradients. Tolerances: the main weights that bf16 + remainder encode must equal its fp32 main
copies BITWISE at every step; the bf16 parameters must equal its parameters (round to nearest
even) bitwise, except at exact ties (low half 0x8000 with an even high half), where ours is one
unit in the last place above (module docstring of wrappers/main_param_storage.py).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.wrappers.main_param_storage import join_fp32, split_fp32
from tests.unit.library.distributed import test_layer_wise as layer_wise

SHAPES = {"embedding.weight": (24, 16), "layers.0.in_proj.weight": (32, 16), "layers.0.out_proj.weight": (16, 32),
          "layers.0.norm.weight": (16,), "layers.1.in_proj.weight": (32, 16), "head.weight": (24, 16)}
CONFIG = dict(lr=0.03, weight_decay=0.1, clip_grad=0.0, muon_fp32_matmul_prec="highest",
              emerging_optimizers_compile=False, bf16=True)
REMAINDERS = dict(use_precision_aware_optimizer=True, store_param_remainders=True)
STEPS = 4


def test_split_and_join_are_exact_for_every_kind_of_value() -> None:
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=generator, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**15, (1000,), generator=generator, dtype=torch.int32) << 16) | 0x8000
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895314e38, -3.3895314e38,
                            1e-45, -1e-45, 1.0, -1.0], dtype=torch.float32).view(torch.int32)
    values = torch.cat([bits, ties, special]).view(torch.float32)
    high, remainder = split_fp32(values)
    assert high.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_fp32(high, remainder).view(torch.int32), values.view(torch.int32))
    finite = ~values.isnan()
    nearest_even = values[finite].to(torch.bfloat16).view(torch.int16).to(torch.int32)
    ours = high[finite].view(torch.int16).to(torch.int32)
    low_half = values[finite].view(torch.int32) & 0xFFFF
    is_tie = (low_half == 0x8000) & (nearest_even % 2 == 0) & (nearest_even != ours)
    assert torch.equal(ours[~is_tie], nearest_even[~is_tie])
    assert torch.equal(ours[is_tie], nearest_even[is_tie] + 1)  # one ulp away from zero
    assert is_tie.sum() >= 400  # the crafted ties with an even high half are there


def build_model() -> torch.nn.Module:
    return layer_wise.build_model(SHAPES, dtype=torch.bfloat16)


def grads_for(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: (torch.randint(-8, 9, shape, generator=generator).float() / 64) for name, shape in SHAPES.items()}


def build(model, name: str, dp_group, **extra):
    config = OptimizerConfig(optimizer=name, **CONFIG, **extra,
                             use_layer_wise_distributed_optimizer=dp_group is not None)
    groups = ParallelGroups.single_process() if dp_group is None else ParallelGroups.from_groups(
        tp=None, mp=None, dp_cp=dp_group)
    return get_megatron_optimizer(config, model, pg_collection=groups)


def main_weights(optimizer) -> list[torch.Tensor]:
    return [m.clone() for child in optimizer.chained_optimizers for m in child.fp32_main_params()]


def compare_runs(name: str, dp_group=None) -> dict:
    """Step the fp32-copy and the remainder run on the same gradients; what differs, per step."""
    reference_model, model = build_model(), build_model()
    reference, ours = build(reference_model, name, dp_group), build(model, name, dp_group, **REMAINDERS)
    result = {"main_mismatches": 0, "param_mismatches_not_ties": 0, "ties": 0, "mains_compared": 0}
    for step in range(STEPS):
        for m in (reference_model, model):
            for pname, param in m.named_parameters():
                param.grad = grads_for(step)[pname].to(param.dtype)
        assert reference.step()[0] and ours.step()[0]
        expected, actual = main_weights(reference), main_weights(ours)
        result["mains_compared"] += len(expected)
        result["main_mismatches"] += sum(not torch.equal(a.view(torch.int32), e.view(torch.int32))
                                         for a, e in zip(actual, expected))
        for (pname, p), r, in zip(model.named_parameters(), reference_model.parameters()):
            differ = p.view(torch.int16) != r.view(torch.int16)
            main = _fp32_main_of(ours, p)  # None where another rank owns it (and checks it)
            if differ.any() and main is not None:
                # Only ties may differ.
                low_half = main.view(torch.int32)[differ] & 0xFFFF
                one_ulp = (p.view(torch.int16).int() - r.view(torch.int16).int()).abs()[differ] == 1
                result["ties"] += int(((low_half == 0x8000) & one_ulp).sum())
                result["param_mismatches_not_ties"] += int(((low_half != 0x8000) | ~one_ulp).sum())
    children = ours.chained_optimizers
    result["remainder_dtypes"] = sorted({str(r.dtype) for c in children for r in c.storage.remainder_of.values()})
    result["placeholder_bytes"] = max((m.untyped_storage().nbytes() for c in children for mdl, m in c._half_pairs()),
                                      default=0)
    return result


def _fp32_main_of(optimizer, param) -> torch.Tensor:
    for child in optimizer.chained_optimizers:
        for model, value in zip(child.model_params, child.fp32_main_params()):
            if model is param:
                return value
    return None


def check(result: dict) -> None:
    assert result["mains_compared"] > 0
    assert result["main_mismatches"] == 0, result
    assert result["param_mismatches_not_ties"] == 0, result
    assert result["remainder_dtypes"] == ["torch.int16"], result
    assert result["placeholder_bytes"] <= 4, result  # no fp32 copy held between steps


@pytest.mark.parametrize("name", ["adam", "muon", "soap"])
def test_remainders_equal_fp32_main_copies_bitwise(name: str) -> None:
    check(compare_runs(name))


def _layer_wise_body(rank: int, world_size: int, name: str) -> dict:
    return compare_runs(name, dist.group.WORLD)


@pytest.mark.parametrize("name", ["adam", "muon", "soap"])
def test_remainders_equal_fp32_main_copies_bitwise_layer_wise_dp2(run_distributed, name: str) -> None:
    for result in run_distributed(_layer_wise_body, 2, args=(name,)):
        check(result)
