"""Megatron-Bridge style set-up: SchedulerConfig, setup_optimizer, provide, (de)serialisation.

The expected learning rates and weight decays are computed here from the formulas (linear
warmup, then cosine / WSD decay to each group's own min_lr; linear or cosine weight-decay
increment times wd_mult), with steps counted in samples, independently of megatron-core's
OptimizerParamScheduler. Tolerance 1e-12 relative: the same few float operations in another order.
"""

import dataclasses
import json
import math
import sys
import types

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_eopt import ChainedOptimizer, OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron_eopt.integrations.megatron_bridge import (
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
    SchedulerConfig,
    from_dict,
    from_yaml,
    setup_optimizer,
    to_dict,
    to_yaml,
)

GBS = 4  # global batch size: the scheduler advances by GBS samples per iteration
REL = 1e-12


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(16, 8)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.fc1 = torch.nn.Linear(8, 12)
        self.fc2 = torch.nn.Linear(12, 8)


def optimizer_config(**changes) -> OptimizerConfig:
    values = dict(optimizer="muon", lr=0.02, min_lr=0.002, decoupled_lr=0.05, decoupled_min_lr=0.005,
                  weight_decay=0.1)
    return OptimizerConfig(**{**values, **changes})


def groups_by_role(optimizer) -> dict[str, dict]:
    groups = optimizer.param_groups
    return {
        "muon": next(g for g in groups if g["optimizer"] == "muon"),
        "decoupled": next(g for g in groups if g["is_decoupled_lr"]),
        "no_wd": next(g for g in groups if g["wd_mult"] == 0.0),
    }


# Independent references --------------------------------------------------------------------------

def warmup_then(decay, samples: int, max_lr: float, min_lr: float, init: float, warmup: int) -> float:
    if warmup > 0 and samples <= warmup:
        return init + (max_lr - init) * samples / warmup
    return decay(samples, max_lr, min_lr)


def cosine(decay_samples: int, warmup: int):
    def lr(samples: int, max_lr: float, min_lr: float) -> float:
        if samples > decay_samples:
            return min_lr
        progress = (samples - warmup) / (decay_samples - warmup)
        return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


def wsd(decay_samples: int, anneal_samples: int, style: str):
    def lr(samples: int, max_lr: float, min_lr: float) -> float:
        if samples > decay_samples:
            return min_lr
        anneal_start = decay_samples - anneal_samples
        if samples <= anneal_start:
            return max_lr
        t = (samples - anneal_start) / anneal_samples
        fraction = {"linear": 1.0 - t, "cosine": 0.5 * (1.0 + math.cos(math.pi * t)),
                    "exponential": 2.0 * 0.5**t - 1.0}[style]
        return min_lr + (max_lr - min_lr) * fraction
    return lr


def step_to(scheduler, iteration: int) -> None:
    while scheduler.num_steps < iteration * GBS:
        scheduler.step(GBS)


# setup_optimizer ---------------------------------------------------------------------------------

def test_setup_optimizer_warmup_then_cosine_per_group() -> None:
    model = Model()
    config = optimizer_config()
    scheduler_config = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=5, train_iters=50,
                                       lr_warmup_init=0.001, global_batch_size=GBS)
    optimizer, scheduler = setup_optimizer(config, scheduler_config, model)
    assert isinstance(optimizer, ChainedOptimizer) and isinstance(scheduler, OptimizerParamScheduler)
    assert (scheduler.lr_warmup_steps, scheduler.lr_decay_steps, scheduler.wd_incr_steps) == (5 * GBS, 50 * GBS, 50 * GBS)
    groups = groups_by_role(optimizer)
    assert (groups["decoupled"]["max_lr"], groups["decoupled"]["min_lr"]) == (0.05, 0.005)
    decay = cosine(50 * GBS, 5 * GBS)
    for iteration in (0, 1, 3, 5, 6, 20, 37, 50, 53):
        step_to(scheduler, iteration)
        samples = iteration * GBS
        lr_ranges = {"muon": (0.02, 0.002), "no_wd": (0.02, 0.002), "decoupled": (0.05, 0.005)}
        for role, (max_lr, min_lr) in lr_ranges.items():
            expected = warmup_then(decay, samples, max_lr, min_lr, 0.001, 5 * GBS)
            assert groups[role]["lr"] == pytest.approx(expected, rel=REL), (role, iteration)
        # Constant weight decay (start/end default to the optimizer's), times wd_mult.
        assert groups["muon"]["weight_decay"] == pytest.approx(0.1, rel=REL)
        assert groups["no_wd"]["weight_decay"] == 0.0
    # The torch optimizers inside see the lrs the scheduler wrote.
    inner = [g["lr"] for child in optimizer.chained_optimizers for g in child.optimizer.param_groups]
    assert inner == [g["lr"] for g in optimizer.param_groups]


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential"])
def test_wsd_schedule(style: str) -> None:
    scheduler_config = SchedulerConfig(lr_decay_style="WSD", lr_wsd_decay_style=style, lr_warmup_iters=2,
                                       lr_wsd_decay_iters=10, train_iters=40, global_batch_size=GBS)
    optimizer, scheduler = setup_optimizer(optimizer_config(), scheduler_config, Model())
    assert scheduler.wsd_decay_steps == 10 * GBS
    groups = groups_by_role(optimizer)
    decay = wsd(40 * GBS, 10 * GBS, style)
    for iteration in (1, 2, 10, 30, 31, 35, 40, 41):
        step_to(scheduler, iteration)
        for role, (max_lr, min_lr) in {"muon": (0.02, 0.002), "decoupled": (0.05, 0.005)}.items():
            expected = warmup_then(decay, iteration * GBS, max_lr, min_lr, 0.0, 2 * GBS)
            assert groups[role]["lr"] == pytest.approx(expected, rel=REL, abs=1e-15), (role, iteration)
    assert groups["muon"]["lr"] == pytest.approx(0.002, rel=REL)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style: str) -> None:
    scheduler_config = SchedulerConfig(lr_decay_style="linear", train_iters=20, start_weight_decay=0.0,
                                       end_weight_decay=0.2, weight_decay_incr_style=style, global_batch_size=GBS)
    optimizer, scheduler = setup_optimizer(optimizer_config(), scheduler_config, Model())
    groups = groups_by_role(optimizer)
    for iteration in (0, 3, 10, 20, 25):
        step_to(scheduler, iteration)
        ratio = min(iteration / 20, 1.0)
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        assert groups["muon"]["weight_decay"] == pytest.approx(0.2 * coeff, rel=REL, abs=1e-15), iteration
        assert groups["decoupled"]["weight_decay"] == pytest.approx(0.2 * coeff, rel=REL, abs=1e-15)
        assert groups["no_wd"]["weight_decay"] == 0.0
        # linear lr decay, no warmup, in samples
        expected = 0.002 + (0.02 - 0.002) * max(0.0, 1.0 - iteration / 20)
        assert groups["muon"]["lr"] == pytest.approx(expected, rel=REL)


def test_sample_based_run_with_warmup_fraction() -> None:
    scheduler_config = SchedulerConfig(lr_decay_style="cosine", train_samples=400, lr_warmup_fraction=0.1)
    _, scheduler = setup_optimizer(optimizer_config(), scheduler_config, Model())
    assert (scheduler.lr_warmup_steps, scheduler.lr_decay_steps, scheduler.wd_incr_steps) == (40, 400, 400)


def test_provide_equals_get_megatron_optimizer() -> None:
    model, config = Model(), optimizer_config()
    overrides = {ParamKey(name="fc2.*"): {"wd_mult": 0.5}}
    provided = config.provide(model_chunks=[model], config_overrides=overrides, use_gloo_process_groups=False)
    expected = get_megatron_optimizer(config, [model], config_overrides=overrides)
    assert type(provided) is type(expected)
    keys = ("group_key", "optimizer", "lr", "weight_decay", "max_lr", "min_lr", "wd_mult")
    summary = lambda opt: [(tuple(g[k] for k in keys), [id(p) for p in g["params"]]) for g in opt.param_groups]
    assert summary(provided) == summary(expected)
    assert any(g["wd_mult"] == 0.5 for g in provided.param_groups)


def test_setup_optimizer_calls_the_provide_hook() -> None:
    calls = []

    @dataclasses.dataclass
    class HookedConfig(OptimizerConfig):
        def provide(self, **kwargs):
            calls.append(kwargs)
            return get_megatron_optimizer(self, kwargs["model_chunks"])

    model = Model()
    setup_optimizer(HookedConfig(optimizer="adam", lr=0.01, min_lr=0.0), SchedulerConfig(train_iters=10), model,
                    use_gloo_process_groups=True, pg_collection=None)
    assert calls == [dict(model_chunks=model, config_overrides=None, use_gloo_process_groups=True, pg_collection=None)]


def test_setup_optimizer_without_provide_uses_get_megatron_optimizer() -> None:
    # Any object with OptimizerConfig's field names (as megatron-core's config is) works.
    plain = types.SimpleNamespace(optimizer="adam", lr=0.01, min_lr=0.001, weight_decay=0.05)
    optimizer, scheduler = setup_optimizer(plain, SchedulerConfig(train_iters=10, lr_decay_style="constant"), Model())
    assert isinstance(optimizer, ChainedOptimizer)
    assert {g["lr"] for g in optimizer.param_groups} == {0.01} and scheduler.start_wd == 0.05


def test_override_providers() -> None:
    seen = []

    class NoOverrides(OptimizerConfigOverrideProvider):
        def build_config_overrides(self, context):
            seen.append(context)
            return {}

    model, config, scheduler_config = Model(), optimizer_config(), SchedulerConfig(train_iters=10)
    optimizer, _ = setup_optimizer(config, scheduler_config, model, optimizer_config_override_provider=NoOverrides())
    assert seen == [OptimizerConfigOverrideProviderContext(scheduler_config, config, model)]
    # {} means no overrides: no group without weight decay, no decoupled lr.
    assert all(g["wd_mult"] == 1.0 and not g["is_decoupled_lr"] for g in optimizer.param_groups)

    # A callable taking the context; the default provider gives the standard overrides.
    biases_only = {ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    optimizer, _ = setup_optimizer(config, scheduler_config, model,
                                   optimizer_config_override_provider=lambda context: biases_only)
    assert sum(g["wd_mult"] == 0.0 for g in optimizer.param_groups) == 1
    assert not any(g["is_decoupled_lr"] for g in optimizer.param_groups)
    optimizer, _ = setup_optimizer(config, scheduler_config, model,
                                   optimizer_config_override_provider=OptimizerConfigOverrideProvider())
    assert any(g["is_decoupled_lr"] for g in optimizer.param_groups)
    with pytest.raises(TypeError, match="build_config_overrides"):
        setup_optimizer(config, scheduler_config, model, optimizer_config_override_provider=42)


def test_setup_optimizer_errors_name_what_to_set() -> None:
    with pytest.raises(ValueError, match="min_lr"):
        setup_optimizer(optimizer_config(min_lr=None), SchedulerConfig(train_iters=10), Model())
    # Without decoupled_min_lr the decoupled group decays to min_lr (megatron-core's rule).
    optimizer, scheduler = setup_optimizer(optimizer_config(decoupled_min_lr=None),
                                           SchedulerConfig(train_iters=10, lr_decay_style="linear"), Model())
    step_to(scheduler, 10)
    assert groups_by_role(optimizer)["decoupled"]["lr"] == pytest.approx(0.002, rel=REL)
    with pytest.raises(ValueError, match="lr_warmup_init"):
        setup_optimizer(optimizer_config(), SchedulerConfig(train_iters=10, lr_warmup_init=1.0), Model())
    # start_weight_decay above the optimizer's weight_decay (the default end) would shrink it.
    with pytest.raises(ValueError, match="end_weight_decay"):
        setup_optimizer(optimizer_config(), SchedulerConfig(train_iters=10, start_weight_decay=0.5,
                                                            weight_decay_incr_style="linear"), Model())


# SchedulerConfig validation ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(lr_decay_style="exponential"), "lr_decay_style"),
        (dict(lr_wsd_decay_style="step"), "lr_wsd_decay_style"),
        (dict(weight_decay_incr_style="square"), "weight_decay_incr_style"),
        (dict(global_batch_size=0), "global_batch_size"),
        (dict(lr_warmup_iters=-1), "lr_warmup_iters"),
        (dict(lr_decay_iters=0), "lr_decay_iters"),
        (dict(lr_warmup_init=-0.1), "lr_warmup_init"),
        (dict(train_iters=None), "train_iters"),
        (dict(train_samples=100), "train_iters"),
        (dict(lr_warmup_samples=8), "lr_warmup_samples"),
        (dict(lr_warmup_iters=10), "lr_warmup_iters"),
        (dict(lr_warmup_fraction=1.5), "lr_warmup_fraction"),
        (dict(lr_warmup_fraction=0.1, lr_warmup_iters=1), "lr_warmup_fraction"),
        (dict(lr_decay_style="WSD"), "lr_wsd_decay_iters"),
        (dict(lr_decay_style="WSD", lr_wsd_decay_iters=11), "lr_wsd_decay_iters"),
        (dict(start_weight_decay=-0.1), "start_weight_decay"),
        (dict(start_weight_decay=0.2, end_weight_decay=0.1, weight_decay_incr_style="linear"), "end_weight_decay"),
        (dict(start_weight_decay=0.1, end_weight_decay=0.2), "weight_decay_incr_style"),
        (dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True), "override_opt_param_scheduler"),
    ],
)
def test_bad_scheduler_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SchedulerConfig\.{field}\b"):
        SchedulerConfig(**{"train_iters": 10, **kwargs})


def test_scheduler_config_types_and_revalidation() -> None:
    with pytest.raises(TypeError, match="SchedulerConfig.train_iters"):
        SchedulerConfig(train_iters="10")
    with pytest.raises(TypeError, match="SchedulerConfig.override_opt_param_scheduler"):
        SchedulerConfig(train_iters=10, override_opt_param_scheduler=1)
    config = SchedulerConfig(train_iters=10)
    config.lr_decay_style = "WSD"  # mutated after construction: setup_optimizer validates again
    with pytest.raises(ValueError, match="SchedulerConfig.lr_wsd_decay_iters"):
        setup_optimizer(optimizer_config(), config, Model())


# Serialisation -----------------------------------------------------------------------------------

def comparable(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if not callable(v) and k != "timers"}


def custom_configs() -> tuple[OptimizerConfig, SchedulerConfig]:
    optimizer = optimizer_config(params_dtype=torch.bfloat16, bf16=True, muon_scale_mode="shape_scaling",
                                 muon_num_ns_steps=3, adam_eps=1e-12, timers=lambda *a: None)
    scheduler = SchedulerConfig(lr_decay_style="WSD", lr_wsd_decay_style="cosine", lr_wsd_decay_iters=7,
                                lr_warmup_iters=3, train_iters=70, global_batch_size=32, start_weight_decay=0.0,
                                end_weight_decay=0.1, weight_decay_incr_style="cosine")
    return optimizer, scheduler


def test_dict_round_trip_without_yaml() -> None:
    optimizer, scheduler = custom_configs()
    values = to_dict(optimizer)
    assert "timers" not in values
    assert values["params_dtype"] == "bfloat16" and values["main_grads_dtype"] == "float32"
    # Plain values only: survives JSON.
    values = json.loads(json.dumps(values))
    restored = from_dict(OptimizerConfig, values)
    assert restored.params_dtype is torch.bfloat16 and restored.timers is None
    assert comparable(restored) == comparable(optimizer)
    assert comparable(from_dict(SchedulerConfig, json.loads(json.dumps(to_dict(scheduler))))) == comparable(scheduler)
    # Defaults round-trip too, and a missing key means its default.
    assert comparable(from_dict(OptimizerConfig, to_dict(OptimizerConfig()))) == comparable(OptimizerConfig())
    assert from_dict(SchedulerConfig, {"train_iters": 5}) == SchedulerConfig(train_iters=5)


def test_from_dict_rejects_unknown_keys_and_bad_dtypes() -> None:
    with pytest.raises(ValueError, match="'lr_decay'"):
        from_dict(SchedulerConfig, {"train_iters": 5, "lr_decay": "cosine"})
    with pytest.raises(ValueError, match="params_dtype"):
        from_dict(OptimizerConfig, {"params_dtype": "float33"})
    assert from_dict(OptimizerConfig, {"lr": "1e-3", "params_dtype": "torch.float16"}).lr == 1e-3


def test_yaml_round_trip() -> None:
    pytest.importorskip("yaml")
    optimizer, scheduler = custom_configs()
    assert comparable(from_yaml(OptimizerConfig, to_yaml(optimizer))) == comparable(optimizer)
    assert comparable(from_yaml(SchedulerConfig, to_yaml(scheduler))) == comparable(scheduler)
    hand_written = "optimizer: muon\nlr: 3e-4\nmin_lr: 0.0\nparams_dtype: bfloat16\n"
    config = from_yaml(OptimizerConfig, hand_written)
    assert (config.lr, config.params_dtype) == (3e-4, torch.bfloat16)


def test_yaml_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    with pytest.raises(ImportError, match="PyYAML"):
        to_yaml(OptimizerConfig())
    with pytest.raises(ImportError, match="PyYAML"):
        from_yaml(SchedulerConfig, "train_iters: 3\n")


def test_dicts_and_yaml_take_the_backend_matmul_precisions_and_refuse_low() -> None:
    for value in ("highest", "high", "medium"):
        assert from_dict(OptimizerConfig, {"muon_fp32_matmul_prec": value}).muon_fp32_matmul_prec == value
    with pytest.raises(ValueError, match=r"muon_fp32_matmul_prec must be one of 'highest', 'high', 'medium'; got 'low'"):
        from_dict(OptimizerConfig, {"muon_fp32_matmul_prec": "low"})
    pytest.importorskip("yaml")
    assert from_yaml(OptimizerConfig, "muon_fp32_matmul_prec: highest\n").muon_fp32_matmul_prec == "highest"
    with pytest.raises(ValueError, match=r"'highest', 'high', 'medium'; got 'low'"):
        from_yaml(OptimizerConfig, "muon_fp32_matmul_prec: low\n")


# The precision-aware fields (docs/memory.md) ------------------------------------------------------

DEEPSEEK_V3_STYLE = {"optimizer": "muon", "lr": 0.02, "min_lr": 0.002, "bf16": True, "params_dtype": "bfloat16",
                     "use_precision_aware_optimizer": True, "exp_avg_dtype": "bfloat16",
                     "exp_avg_sq_dtype": "bfloat16", "main_grads_dtype": "bfloat16",
                     "muon_fp32_matmul_prec": "highest"}


@pytest.mark.parametrize("store_param_remainders,main_bytes", [(True, 2), (False, 4)], ids=["remainders", "fp32-main"])
def test_provide_builds_a_precision_aware_recipe(store_param_remainders: bool, main_bytes: int) -> None:
    """A recipe's dict (dtypes by name) through from_dict and provide(): every moment is stored in
    bf16 after a step, and the main weights take 2 bytes per element (remainders) or 4 (fp32)."""
    config = from_dict(OptimizerConfig, {**DEEPSEEK_V3_STYLE, "store_param_remainders": store_param_remainders})
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype, config.main_grads_dtype) == (torch.bfloat16,) * 3
    model = Model().bfloat16()
    optimizer = config.provide(model_chunks=[model], use_gloo_process_groups=False)
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.25)
    optimizer.step()
    children = optimizer.chained_optimizers
    moments = {(k, t.dtype) for child in children for state in child.state.values() for k, t in state.items()
               if torch.is_tensor(t) and t.dim() > 0}
    # Muon's momentum (the matrices) and Adam's moments (embedding, biases), all bf16.
    assert moments == {("momentum_buffer", torch.bfloat16), ("exp_avg", torch.bfloat16),
                       ("exp_avg_sq", torch.bfloat16)}, moments
    numel = sum(p.numel() for p in model.parameters())
    assert sum(child.main_param_bytes() for child in children) == main_bytes * numel
