"""`optimizer_cpu_offload`: state on the host, streamed through the device for the step.

Reference: the same optimizer without offload, stepped with the same gradients: parameters, fp32
main weights and state bitwise equal (on this machine host and device are both the CPU, and the
mechanism still copies each window's state into fresh tensors and back). The fraction rule is
checked against megatron-core's, worked by hand; checkpoints move between the two.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.offload.host_resident import offloaded_indices
from tests.small_model import small_model, step_on_random_grads

BF16_STATE = dict(bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                  exp_avg_sq_dtype=torch.bfloat16)
CONFIGS = {
    "adam fp32": dict(optimizer="adam"),
    "sgd bf16": dict(optimizer="sgd", bf16=True),
    "adam bf16, bf16 moments, remainders": dict(optimizer="adam", store_param_remainders=True, **BF16_STATE),
    "muon bf16, bf16 momentum, fp32 copies": dict(optimizer="muon", store_param_remainders=False, **BF16_STATE),
    "muon bf16, remainders": dict(optimizer="muon", bf16=True, use_precision_aware_optimizer=True),
    "soap fp32": dict(optimizer="soap"),
}


def test_the_fraction_takes_whole_parameters_in_order_as_megatron_core() -> None:
    # megatron-core: offload while the elements taken are fewer than fraction * all (50 of 100 here).
    assert offloaded_indices([10, 20, 30, 40], 0.5) == [0, 1, 2]
    assert offloaded_indices([10, 20, 30, 40], 1.0) == [0, 1, 2, 3]
    assert offloaded_indices([10, 20, 30, 40], 0.0) == []
    assert offloaded_indices([10, 20, 30, 40], 0.1) == [0]


def _config(name: str, **offload) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, muon_fp32_matmul_prec="highest", **CONFIGS[name], **offload)


def _snapshot(model: torch.nn.Module, optimizer) -> dict:
    values = {f"param {i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for child_name, child in ((c.name, c.state_dict()) for c in optimizer.chained_optimizers):
        for fqn, main in child.get("main_params", {}).items():
            values[f"{child_name} main {fqn}"] = main.clone()
        for fqn, tensors in child["state"].items():
            values.update({f"{child_name} {fqn} {key}": v.clone() for key, v in tensors.items() if torch.is_tensor(v)})
    return values


def _run(config: OptimizerConfig, steps: range, load: dict = None):
    model = small_model(config)
    optimizer = get_megatron_optimizer(config, [model])
    if load is not None:
        with torch.no_grad():
            for param, value in zip(model.parameters(), load["model"]):
                param.copy_(value)
        optimizer.load_state_dict(load["optimizer"])
    for seed in steps:
        step_on_random_grads(model, optimizer, seed)
    return model, optimizer


def _assert_stepped_on_copies(model: torch.nn.Module, optimizer, child) -> None:
    """The inner step sees fresh copies of an offloaded parameter's state, not the host tensors
    that hold it between steps, and those stay the same tensors."""
    offloaded = child.main_params[child.host_state.indices[-1]]
    held = {key: value for key, value in child.optimizer.state[offloaded].items() if torch.is_tensor(value) and value.dim()}
    seen = {}
    inner_step = child.optimizer.step

    def recording_step(*args, **kwargs):
        if any(p is offloaded for group in child.optimizer.param_groups for p in group["params"]):
            seen.update(child.optimizer.state[offloaded])
        return inner_step(*args, **kwargs)

    child.optimizer.step = recording_step
    step_on_random_grads(model, optimizer, seed=9)
    assert held and all(seen[key] is not value for key, value in held.items())
    assert all(child.optimizer.state[offloaded][key] is value for key, value in held.items())


def _assert_equal(mine: dict, reference: dict, where: str) -> None:
    assert mine.keys() == reference.keys(), where
    for key in mine:
        assert mine[key].dtype == reference[key].dtype and torch.equal(mine[key], reference[key]), f"{where}: {key}"


@pytest.mark.parametrize("fraction", [0.5, pytest.param(1.0, marks=pytest.mark.slow)])  # 1.0: the loop test has it
@pytest.mark.parametrize("name", CONFIGS)
def test_offloaded_steps_equal_the_steps_without_offload(name: str, fraction: float) -> None:
    with torch.compiler.set_stance("force_eager"):
        plain = _snapshot(*_run(_config(name), range(3)))
        model, optimizer = _run(_config(name, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction), range(3))
    _assert_equal(_snapshot(model, optimizer), plain, f"{name}, fraction {fraction}")
    child = optimizer.chained_optimizers[0]
    assert child.host_state.indices  # the mechanism ran: some parameter's state lived on the host
    _assert_stepped_on_copies(model, optimizer, child)
    if fraction == 1.0 and child.model_params[0].dtype == torch.bfloat16:
        assert child.main_param_bytes() == 0  # no fp32 main weight (or remainder) left on the device


@pytest.mark.parametrize("name", ["adam bf16, bf16 moments, remainders", "muon bf16, remainders"])
def test_a_checkpoint_moves_between_offload_and_none(name: str) -> None:
    """Saved at 2 with offload (or without), loaded without (or with), stepped to 4: equal to 4 straight."""
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    with torch.compiler.set_stance("force_eager"):
        straight = _snapshot(*_run(_config(name), range(4)))
        for saver, loader in ((offload, {}), ({}, offload)):
            model, optimizer = _run(_config(name, **saver), range(2))
            saved = {"model": [p.detach().clone() for p in model.parameters()], "optimizer": optimizer.state_dict()}
            assert _snapshot(model, optimizer).keys() == _snapshot(*_run(_config(name), range(2))).keys()
            resumed = _run(_config(name, **loader), range(2, 4), load=saved)
            _assert_equal(_snapshot(*resumed), straight, f"{name}: saved with {saver}, loaded with {loader}")


def test_bad_offload_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"optimizer_offload_fraction must be in \[0, 1\] .*; got 1.5"):
        OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5)
    with pytest.raises(ValueError, match=r"needs decoupled_weight_decay=True \(AdamW mode\)"):
        OptimizerConfig(optimizer_cpu_offload=True, decoupled_weight_decay=False)


def test_offload_with_fraction_zero_says_once_that_it_offloads_nothing() -> None:
    """megatron-core's default fraction, 0.0, with offload on: nothing goes to the host, said once per
    process; any other fraction, or no offload, says nothing."""
    import warnings

    from megatron_eopt.runtime import once

    def build_twice(**offload) -> tuple[list, list[str]]:
        once._GIVEN.clear()  # a fresh process, for this warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = [get_megatron_optimizer(_config("adam fp32", **offload), [small_model(OptimizerConfig())])
                     for _ in range(2)]
        return built, [str(w.message) for w in caught if "offloads nothing" in str(w.message)]

    built, said = build_twice(optimizer_cpu_offload=True, optimizer_offload_fraction=0.0)
    assert [child.host_state.indices for optimizer in built for child in optimizer.chained_optimizers] == [[], []]
    assert len(said) == 1 and said[0].startswith("OptimizerConfig.optimizer_cpu_offload=True with "
                                                 "optimizer_offload_fraction=0.0"), said
    assert build_twice(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)[1] == []
    assert build_twice(optimizer_offload_fraction=0.0)[1] == []
