"""OptimizerConfig: megatron-core's field names and defaults, re-runnable validation, conversion.

The reference is megatron-core's own `OptimizerConfig` (imported once per module: importing
`megatron.core.optimizer` costs several seconds).
"""

import dataclasses
import math
import re

import pytest
import torch

from megatron_eopt.config.choices import plain_value
from megatron_eopt.config.optimizer_config import (
    AdamOptimizerConfig,
    OptimizerConfig,
    SGDOptimizerConfig,
    as_optimizer_config,
)


@pytest.fixture(scope="module")
def mcore_config_cls():
    from megatron.core.optimizer.optimizer_config import OptimizerConfig as McoreOptimizerConfig

    return McoreOptimizerConfig


def _default_of(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    a, b = plain_value(a), plain_value(b)  # ours marks megatron-core's defaults (MegatronCoreDefault)
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------------------------------
# Field names and defaults
# ------------------------------------------------------------------------------------------------


def test_every_megatron_core_field_exists_with_the_same_default(mcore_config_cls):
    ours = {f.name: f for f in dataclasses.fields(OptimizerConfig)}
    theirs = {f.name: f for f in dataclasses.fields(mcore_config_cls)}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"megatron-core fields missing from ours: {missing}"

    different = {}
    for name, their_field in theirs.items():
        their_default, our_default = _default_of(their_field), _default_of(ours[name])
        if not _same(their_default, our_default):
            different[name] = (their_default, our_default)
    # The one documented difference: TP must never change the update.
    assert different == {"muon_tp_mode": ("blockwise", "duplicated")}


def test_extra_field_muon_use_syrk(mcore_config_cls):
    ours = {f.name: f for f in dataclasses.fields(OptimizerConfig)}
    theirs = {f.name for f in dataclasses.fields(mcore_config_cls)}
    assert "muon_use_syrk" not in theirs
    assert "muon_use_syrk" in ours and _default_of(ours["muon_use_syrk"]) is False


def test_default_instances_agree_field_by_field(mcore_config_cls):
    ours, theirs = OptimizerConfig(), mcore_config_cls()
    for field in dataclasses.fields(mcore_config_cls):
        if field.name == "muon_tp_mode":
            continue
        assert _same(getattr(ours, field.name), getattr(theirs, field.name)), field.name


def test_aliases_are_the_same_class():
    assert AdamOptimizerConfig is OptimizerConfig
    assert SGDOptimizerConfig is OptimizerConfig


def test_is_a_plain_dataclass_with_every_field_defaulted():
    assert dataclasses.is_dataclass(OptimizerConfig)
    for field in dataclasses.fields(OptimizerConfig):
        assert _default_of(field) is not dataclasses.MISSING, field.name


# ------------------------------------------------------------------------------------------------
# Re-runnable validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, bad, good",
    [
        ("lr", -1.0, 1e-3),
        ("min_lr", 5.0, 1e-5),  # above lr
        ("adam_beta2", 1.5, 0.95),
        ("muon_tp_mode", "dist", "blockwise"),
        ("clip_grad", -0.5, 0.0),
        ("hysteresis", 0, 1),
    ],
)
def test_validation_is_rerunnable_after_mutation(field, bad, good):
    config = OptimizerConfig(lr=1e-3)
    setattr(config, field, bad)
    with pytest.raises(ValueError, match=re.escape(field)):
        config.finalize()
    setattr(config, field, good)
    assert config.finalize() is config
    assert getattr(config, field) == good


def test_mutation_to_wrong_type_is_caught_on_finalize():
    config = OptimizerConfig(lr=1e-3)
    config.weight_decay = "0.1"
    with pytest.raises(TypeError, match=r"weight_decay"):
        config.finalize()
    config.weight_decay = 0.1
    config.finalize()


def test_subclass_with_extra_fields_validates():
    """Downstream code subclasses the config and adds its own fields."""

    @dataclasses.dataclass
    class TrainerOptimizerConfig(OptimizerConfig):
        extra_knob: int = 3
        label: str = "run"

    config = TrainerOptimizerConfig(lr=0.1, extra_knob=7)
    assert config.extra_knob == 7 and config.lr == 0.1
    # The inherited checks still apply.
    with pytest.raises(ValueError, match=r"\blr\b"):
        TrainerOptimizerConfig(lr=-0.1)
    config.adam_beta1 = 1.0
    with pytest.raises(ValueError, match=r"adam_beta1"):
        config.finalize()


def test_int_is_accepted_where_a_float_is_expected():
    config = OptimizerConfig(lr=1, min_lr=0, weight_decay=0)
    assert config.lr == 1


# ------------------------------------------------------------------------------------------------
# Bad inputs: each a ValueError or TypeError that names the field and what is allowed
# ------------------------------------------------------------------------------------------------

# (kwargs, exception, regexes that must all appear in the message)
BAD_INPUTS = {
    "lr_negative": ({"lr": -1e-3}, ValueError, [r"\blr\b", r">= 0"]),
    "lr_nan": ({"lr": float("nan")}, ValueError, [r"\blr\b", r"finite"]),
    "lr_inf": ({"lr": float("inf")}, ValueError, [r"\blr\b", r"finite"]),
    "min_lr_above_lr": ({"lr": 1e-4, "min_lr": 1e-3}, ValueError, [r"\bmin_lr\b", r"\blr\b"]),
    "decoupled_min_lr_above": (
        {"lr": 1.0, "decoupled_lr": 1e-4, "decoupled_min_lr": 1e-3},
        ValueError,
        [r"decoupled_min_lr", r"decoupled_lr"],
    ),
    "decoupled_lr_negative": ({"decoupled_lr": -1.0}, ValueError, [r"decoupled_lr", r">= 0"]),
    "adam_beta1_one": ({"adam_beta1": 1.0}, ValueError, [r"adam_beta1", re.escape("[0, 1)")]),
    "adam_beta2_negative": ({"adam_beta2": -0.1}, ValueError, [r"adam_beta2", re.escape("[0, 1)")]),
    "adam_eps_negative": ({"adam_eps": -1e-8}, ValueError, [r"adam_eps", r">= 0"]),
    "weight_decay_negative": ({"weight_decay": -0.01}, ValueError, [r"weight_decay", r">= 0"]),
    "weight_decay_nan": ({"weight_decay": float("nan")}, ValueError, [r"weight_decay"]),
    "sgd_momentum_negative": ({"sgd_momentum": -0.9}, ValueError, [r"sgd_momentum", r">= 0"]),
    "muon_momentum_one": ({"muon_momentum": 1.0}, ValueError, [r"muon_momentum"]),
    "lion_beta2_one": ({"lion_beta2": 1.0}, ValueError, [r"lion_beta2"]),
    "fp16_and_bf16": ({"fp16": True, "bf16": True}, ValueError, [r"fp16", r"bf16"]),
    "muon_tp_mode_bad": (
        {"muon_tp_mode": "dist"},
        ValueError,
        [r"muon_tp_mode", r"'dist'", r"blockwise", r"duplicated", r"distributed"],
    ),
    "muon_scale_mode_bad": (
        {"muon_scale_mode": "rms"},
        ValueError,
        [r"muon_scale_mode", r"spectral", r"unit_rms_norm", r"shape_scaling"],
    ),
    "muon_fp32_matmul_prec_bad": (
        {"muon_fp32_matmul_prec": "low"},
        ValueError,
        [r"muon_fp32_matmul_prec", r"got 'low'", r"'highest', 'high', 'medium'"],
    ),
    "muon_scalar_optimizer_bad": (
        {"muon_scalar_optimizer": "sgd"},
        ValueError,
        [r"muon_scalar_optimizer", r"adam", r"lion"],
    ),
    "adaptive_muon_moment2_method_bad": (
        {"adaptive_muon_moment2_method": "adam"},
        ValueError,
        [r"adaptive_muon_moment2_method", r"adamuon", r"normuon"],
    ),
    "muon_num_ns_steps_zero": ({"muon_num_ns_steps": 0}, ValueError, [r"muon_num_ns_steps", r">= 1"]),
    "muon_extra_scale_factor_zero": (
        {"muon_extra_scale_factor": 0.0},
        ValueError,
        [r"muon_extra_scale_factor", r"> 0"],
    ),
    "soap_precondition_frequency_zero": (
        {"soap_precondition_frequency": 0},
        ValueError,
        [r"soap_precondition_frequency", r">= 1"],
    ),
    "clip_grad_negative": ({"clip_grad": -1.0}, ValueError, [r"clip_grad", r">= 0"]),
    "clip_grad_nan": ({"clip_grad": float("nan")}, ValueError, [r"clip_grad"]),
    "grad_norm_skip_threshold_zero": (
        {"grad_norm_skip_threshold": 0.0},
        ValueError,
        [r"grad_norm_skip_threshold", r"> 0"],
    ),
    "grad_norm_skip_threshold_nan": (
        {"grad_norm_skip_threshold": float("nan")},
        ValueError,
        [r"grad_norm_skip_threshold"],
    ),
    "loss_scale_zero": ({"loss_scale": 0.0}, ValueError, [r"loss_scale", r"> 0"]),
    "loss_scale_negative": ({"loss_scale": -4.0}, ValueError, [r"loss_scale", r"> 0"]),
    "min_loss_scale_zero": ({"min_loss_scale": 0.0}, ValueError, [r"min_loss_scale"]),
    "min_loss_scale_above_initial": (
        {"min_loss_scale": 1024.0, "initial_loss_scale": 16.0},
        ValueError,
        [r"min_loss_scale", r"initial_loss_scale"],
    ),
    "loss_scale_window_zero": ({"loss_scale_window": 0}, ValueError, [r"loss_scale_window", r">= 1"]),
    "hysteresis_zero": ({"hysteresis": 0}, ValueError, [r"hysteresis", r">= 1"]),
    "optimizer_empty": ({"optimizer": "  "}, ValueError, [r"optimizer"]),
    "lr_string": ({"lr": "abc"}, TypeError, [r"\blr\b", r"number", r"'abc'"]),
    "lr_bool": ({"lr": True}, TypeError, [r"\blr\b", r"number"]),
    "muon_nesterov_string": ({"muon_nesterov": "yes"}, TypeError, [r"muon_nesterov", r"bool"]),
    "muon_num_ns_steps_float": ({"muon_num_ns_steps": 5.0}, TypeError, [r"muon_num_ns_steps", r"int"]),
    "optimizer_not_string": ({"optimizer": 3}, TypeError, [r"optimizer", r"string"]),
    "params_dtype_string": ({"params_dtype": "bf16"}, TypeError, [r"params_dtype", r"torch.dtype"]),
    "precision_aware_fp8_state": (
        {"use_precision_aware_optimizer": True, "exp_avg_dtype": torch.float8_e4m3fn},
        ValueError,
        [r"exp_avg_dtype", r"torch.bfloat16", r"fp8"],
    ),
    "optimizer_offload_fraction_above_1": (
        {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.5},
        ValueError,
        [r"optimizer_offload_fraction", r"\[0, 1\]", r"1.5"],
    ),
    "main_params_dtype_bf16": (
        {"main_params_dtype": torch.bfloat16},
        ValueError,
        [r"main_params_dtype", r"float32"],
    ),
    "exp_avg_dtype_fp16": ({"exp_avg_dtype": torch.float16}, ValueError, [r"exp_avg_dtype", r"float32"]),
}


@pytest.mark.parametrize("kwargs, error, patterns", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_rejected_with_a_message_naming_the_field(kwargs, error, patterns):
    # pytest.raises(error) lets an AssertionError (megatron-core's style) through as a failure.
    with pytest.raises(error) as excinfo:
        OptimizerConfig(**kwargs)
    assert type(excinfo.value) is error
    message = str(excinfo.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"


@pytest.mark.parametrize("kwargs, error, patterns", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_set_after_construction_is_rejected_by_finalize(kwargs, error, patterns):
    config = OptimizerConfig()
    for name, value in kwargs.items():
        setattr(config, name, value)
    with pytest.raises(error):
        config.finalize()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0, "min_lr": 0.0},
        {"lr": 1e-3, "min_lr": 1e-3},
        {"adam_beta1": 0.0, "adam_beta2": 0.0, "adam_eps": 0.0},
        {"weight_decay": 0.0, "clip_grad": 0.0},
        {"bf16": True, "params_dtype": torch.bfloat16},
        {"fp16": True, "loss_scale": 128.0},
        {"muon_tp_mode": "blockwise"},
        {"muon_tp_mode": "distributed", "muon_scale_mode": "unit_rms_norm"},
        {"muon_scale_mode": "shape_scaling", "muon_scalar_optimizer": "lion"},
        {"use_layer_wise_distributed_optimizer": True},
        {"decoupled_min_lr": 1e-5},  # without decoupled_lr: nothing to compare against
        {"grad_norm_skip_threshold": 10.0},
        {"timers": print},
    ],
)
def test_valid_edge_values_are_accepted(kwargs):
    config = OptimizerConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


# ------------------------------------------------------------------------------------------------
# as_optimizer_config
# ------------------------------------------------------------------------------------------------


def test_as_optimizer_config_converts_megatron_core_config(mcore_config_cls):
    theirs = mcore_config_cls(
        lr=0.3,
        min_lr=0.01,
        optimizer="sgd",
        weight_decay=0.05,
        sgd_momentum=0.5,
        clip_grad=2.5,
        bf16=True,
        params_dtype=torch.bfloat16,
        decoupled_lr=0.7,
        decoupled_min_lr=0.07,
        adam_beta2=0.95,
        muon_num_ns_steps=3,
        log_num_zeros_in_grad=True,
    )
    ours = as_optimizer_config(theirs)
    assert type(ours) is OptimizerConfig
    for field in dataclasses.fields(mcore_config_cls):
        assert _same(getattr(ours, field.name), getattr(theirs, field.name)), field.name


def test_as_optimizer_config_validates_megatron_core_config(mcore_config_cls):
    # megatron-core accepts a negative lr; ours does not.
    theirs = mcore_config_cls(lr=-1.0)
    with pytest.raises(ValueError, match=r"\blr\b"):
        as_optimizer_config(theirs)


def test_as_optimizer_config_revalidates_ours():
    config = OptimizerConfig(lr=0.1)
    assert as_optimizer_config(config) is config
    config.lr = float("nan")
    with pytest.raises(ValueError, match=r"\blr\b"):
        as_optimizer_config(config)


@pytest.mark.parametrize("bad", [None, object(), "adam", {"optimizer": "adam", "lr": 0.1}, 3])
def test_as_optimizer_config_rejects_unrelated_objects(bad):
    with pytest.raises(TypeError, match=r"OptimizerConfig"):
        as_optimizer_config(bad)


# ------------------------------------------------------------------------------------------------
# muon_fp32_matmul_prec: the backend's vocabulary
# ------------------------------------------------------------------------------------------------


def test_matmul_precisions_are_what_emerging_optimizers_and_torch_accept():
    import typing

    from emerging_optimizers.utils import FP32MatmulPrecT

    from megatron_eopt.config.optimizer_config import MatmulPrecision

    assert set(typing.get_args(MatmulPrecision)) == set(typing.get_args(FP32MatmulPrecT))
    previous = torch.get_float32_matmul_precision()
    try:
        for value in typing.get_args(MatmulPrecision):
            torch.set_float32_matmul_precision(value)
            assert torch.get_float32_matmul_precision() == value
        # torch does not take 'low': it warns and keeps the previous value.
        with pytest.warns(UserWarning):
            torch.set_float32_matmul_precision("low")
        assert torch.get_float32_matmul_precision() == value
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("value", ["highest", "high", "medium"])
def test_every_backend_matmul_precision_is_accepted(value):
    assert OptimizerConfig(muon_fp32_matmul_prec=value).muon_fp32_matmul_prec == value


def test_low_matmul_precision_is_refused_with_the_valid_values():
    with pytest.raises(ValueError) as raised:
        OptimizerConfig(muon_fp32_matmul_prec="low")
    assert str(raised.value) == (
        "OptimizerConfig.muon_fp32_matmul_prec must be one of 'highest', 'high', 'medium'; got 'low'."
    )
