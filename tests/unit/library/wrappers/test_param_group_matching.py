"""Loading matches saved param groups to live ones by their identifying keys, as megatron-core's
`MegatronOptimizer._filter_and_reorder_param_groups` does.

Expected results: megatron-core's own static method (it runs on CPU) on the same groups, and
round trips whose saved groups carry known, distinct hyperparameters: each live group must get
the hyperparameters of the saved group with its identifying values, and each parameter its own
state.
"""

import copy

import pytest
import torch

from megatron_eopt import OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron_eopt.wrappers.base import MegatronOptimizer
from megatron_eopt.checkpointable.child import PARAM_GROUP_IDENTIFIER_KEYS

COMMON = dict(lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)

# (current groups, saved groups): megatron-core's cases (Megatron-LM's
# tests/unit_tests/optimizer/test_param_group_identifier_keys.py describes them).
CASES = {
    "by_max_lr": ([dict(COMMON, wd_mult=1.0, max_lr=2e-5, min_lr=2e-6), dict(COMMON, wd_mult=1.0, max_lr=5e-4, min_lr=5e-5)],
                  [dict(COMMON, wd_mult=1.0, max_lr=5e-4, min_lr=5e-5, tag="b"),
                   dict(COMMON, wd_mult=1.0, max_lr=2e-5, min_lr=2e-6, tag="a")]),
    "missing_is_none": ([dict(COMMON, wd_mult=1.0, max_lr=1e-3, min_lr=None)],
                        [dict(COMMON, wd_mult=1.0, max_lr=1e-3, tag="a")]),
    "optional_key": ([dict(COMMON, wd_mult=1.0, max_lr=1e-3, start_wd=0.05), dict(COMMON, wd_mult=1.0, max_lr=1e-3)],
                     [dict(COMMON, wd_mult=1.0, max_lr=1e-3, tag="default"),
                      dict(COMMON, wd_mult=1.0, max_lr=1e-3, start_wd=0.05, tag="explicit")]),
    "nemo_pre_prefix": ([dict(COMMON, wd_mult=1.0, max_lr=1e-3)],
                        [dict(is_expert_parallel=False, is_decoupled_lr=False, pre_lr_mult=1.0, pre_wd_mult=1.0,
                              max_lr=1e-3, tag="nemo")]),
}


def _with_params(groups: list[dict]) -> list[dict]:
    return [dict(group, params=[10 * i, 10 * i + 1]) for i, group in enumerate(groups)]


def test_identifier_keys_are_megatron_cores() -> None:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    assert PARAM_GROUP_IDENTIFIER_KEYS == tuple(param_group_identifier_keys)


@pytest.mark.parametrize("case", sorted(CASES))
def test_filter_and_reorder_equals_megatron_cores(case: str) -> None:
    from megatron.core.optimizer.optimizer import MegatronOptimizer as McoreOptimizer

    current, saved = (_with_params(groups) for groups in CASES[case])
    expected = McoreOptimizer._filter_and_reorder_param_groups(copy.deepcopy(current), copy.deepcopy(saved))
    assert MegatronOptimizer._filter_and_reorder_param_groups(current, saved) == expected


def test_filter_and_reorder_refuses_an_unknown_group() -> None:
    current = _with_params([dict(COMMON, wd_mult=1.0, max_lr=1e-3)])
    saved = _with_params([dict(COMMON, wd_mult=0.0, max_lr=1e-3)])
    with pytest.raises(ValueError, match=r"no saved param group has the identifying values \(None, 0.001"):
        MegatronOptimizer._filter_and_reorder_param_groups(current, saved)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def _trained_optimizer(overrides: dict):
    model = _model()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1), model, overrides)
    for step in range(2):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step))
        optimizer.step()
    for index, group in enumerate(optimizer.param_groups):  # as a scheduler would, one value per group
        group["lr"] = 0.01 * (index + 1)
    return model, optimizer


def _expected_by_fqn(optimizer) -> dict[str, tuple[float, torch.Tensor]]:
    return {fqn: (group["lr"], optimizer.state[p]["exp_avg"].clone())
            for group in optimizer.param_groups for p, fqn in zip(group["params"], group["param_fqns"])}


def _assert_loaded(optimizer, expected: dict) -> None:
    for group in optimizer.param_groups:
        for p, fqn in zip(group["params"], group["param_fqns"]):
            assert group["lr"] == expected[fqn][0], fqn
            assert torch.equal(optimizer.state[p]["exp_avg"], expected[fqn][1]), fqn


def test_renamed_and_reordered_override_rules_load_into_the_right_groups() -> None:
    """The same overrides under other ParamKeys (so other group keys) in the other order: the
    groups are told apart by max_lr and wd_mult."""
    _, saved = _trained_optimizer({ParamKey(name="1.*"): dict(max_lr=0.5), ParamKey(name="*.bias"): dict(wd_mult=0.0)})
    expected = _expected_by_fqn(saved)
    renamed = {ParamKey(name=("0.bias", "1.bias")): dict(wd_mult=0.0), ParamKey(name=("1.weight", "1.bias")): dict(max_lr=0.5)}
    _, live = _trained_optimizer(renamed)
    assert {g["group_key"] for g in live.param_groups} != {g["group_key"] for g in saved.param_groups}
    live.load_state_dict(saved.state_dict())
    _assert_loaded(live, expected)


def test_megatron_core_format_loads_with_groups_in_another_order() -> None:
    """megatron-core's FP32Optimizer state dict (torch's own) with its group entries listed in
    another order; as megatron-core assumes, the parameters keep their positions."""
    _, saved = _trained_optimizer(None)
    expected = _expected_by_fqn(saved)
    torch_state = saved.chained_optimizers[0].optimizer.state_dict()
    groups = torch_state["param_groups"]
    torch_state["param_groups"] = [dict(group, params=position["params"]) for group, position in zip(groups[::-1], groups)]
    _, live = _trained_optimizer(None)
    live.load_state_dict(torch_state)
    _assert_loaded(live, expected)
