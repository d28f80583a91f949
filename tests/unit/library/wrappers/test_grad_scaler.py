"""Loss scaling rules (fp16): hysteresis before backing off, growth after a clean window,
the floor at min_scale, and an exact state round trip. The GPU tier (test_gpu.py) also
compares step by step with megatron-core's DynamicGradScaler, which needs CUDA.
"""

import pytest

from megatron_eopt import ConstantGradScaler, DynamicGradScaler
from megatron_eopt.wrappers.grad_scaler import make_grad_scaler
from megatron_eopt import OptimizerConfig


def scales(scaler, found_inf_sequence) -> list[float]:
    result = []
    for found_inf in found_inf_sequence:
        scaler.update(found_inf)
        result.append(scaler.scale.item())
    return result


def test_backs_off_only_after_hysteresis_overflows() -> None:
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=100, hysteresis=2)
    assert scales(scaler, [True, True, True]) == [1024.0, 512.0, 256.0]


def test_grows_after_growth_interval_clean_steps_and_resets_hysteresis() -> None:
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    # one overflow (hysteresis absorbs it), three clean steps grow the scale, hysteresis restored
    assert scales(scaler, [True, False, False, False, True, True]) == [8.0, 8.0, 8.0, 16.0, 16.0, 8.0]


def test_never_below_min_scale() -> None:
    scaler = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, growth_interval=10, hysteresis=1)
    assert scales(scaler, [True, True, True]) == [2.0, 2.0, 2.0]
    assert scaler.inv_scale.item() == 0.5


def test_state_round_trip_continues_identically() -> None:
    first = DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_interval=2, hysteresis=2)
    scales(first, [True, False])
    second = DynamicGradScaler(initial_scale=1.0, min_scale=1.0, growth_interval=2, hysteresis=2)
    second.load_state_dict(first.state_dict())
    sequence = [False, True, True, False, False]
    assert scales(second, sequence) == scales(first, sequence)


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="min_scale <= initial_scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        DynamicGradScaler(initial_scale=2.0, min_scale=1.0, backoff_factor=1.5)
    with pytest.raises(ValueError, match="loss scale must be > 0"):
        ConstantGradScaler(0.0)


def test_config_chooses_the_scaler() -> None:
    assert make_grad_scaler(OptimizerConfig(lr=0.1, bf16=True)) is None
    constant = make_grad_scaler(OptimizerConfig(lr=0.1, fp16=True, loss_scale=128.0))
    assert type(constant) is ConstantGradScaler and scales(constant, [True]) == [128.0]
    dynamic = make_grad_scaler(OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=2.0**16))
    assert type(dynamic) is DynamicGradScaler and dynamic.scale.item() == 2.0**16
