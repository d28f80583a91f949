"""The deprecated `megatron_eopt.muon.get_megatron_muon_optimizer` forwards to get_megatron_optimizer.

References: the optimizer that `get_megatron_optimizer` builds from the config the shim should
pass on (written out by hand in each test), compared group by group.
"""

import copy
import dataclasses
import warnings

import pytest

import megatron_eopt.factory
from megatron_eopt import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_eopt.distributed.layer_wise import LayerWiseDistributedOptimizer
from megatron_eopt.muon import get_megatron_muon_optimizer
from tests.unit.library.integrations.test_megatron_bridge import Model

GROUP_VALUES = ("group_key", "optimizer", "lr", "weight_decay", "max_lr", "min_lr", "wd_mult", "is_decoupled_lr")


def muon_config(**changes) -> OptimizerConfig:
    return OptimizerConfig(optimizer="muon", lr=0.02, min_lr=0.001, weight_decay=0.1, **changes)


def group_summary(optimizer) -> list[tuple]:
    """Each group's values and the identities of its parameters."""
    return [
        tuple(group[k] for k in GROUP_VALUES) + (tuple(id(p) for p in group["params"]),)
        for group in optimizer.param_groups
    ]


def call_shim(*args, **kwargs):
    with pytest.warns(DeprecationWarning) as record:
        optimizer = get_megatron_muon_optimizer(*args, **kwargs)
    # (The first build also imports emerging_optimizers, whose torch.jit use warns too.)
    ours = [w for w in record if "get_megatron_muon_optimizer" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is DeprecationWarning
    assert ours[0].filename == __file__, "the warning must point at the caller"
    return optimizer, str(ours[0].message)


def test_shim_warns_and_builds_what_get_megatron_optimizer_builds() -> None:
    model = Model()
    shimmed, message = call_shim(muon_config(), [model])
    expected = get_megatron_optimizer(muon_config(), [model])
    assert "get_megatron_optimizer" in message and "deprecated" in message
    assert type(shimmed) is type(expected) is ChainedOptimizer
    assert [type(c.optimizer) for c in shimmed.chained_optimizers] == [
        type(c.optimizer) for c in expected.chained_optimizers
    ]
    assert group_summary(shimmed) == group_summary(expected)
    # Muon took the two hidden matrices, Adam the embedding and the biases.
    muon_params = [p for g in shimmed.param_groups if g["optimizer"] == "muon" for p in g["params"]]
    assert {id(p) for p in muon_params} == {id(model.fc1.weight), id(model.fc2.weight)}


def test_shim_forwards_every_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(megatron_eopt.factory, "get_megatron_optimizer", lambda *a, **k: calls.append((a, k)))
    config, model, overrides = muon_config(), Model(), {}
    call_shim(config, [model], config_overrides=overrides, use_gloo_process_groups=False,
              pg_collection="groups", dump_param_to_param_group_map="/tmp/map")
    (args, kwargs), = calls
    assert args[1] == [model]
    assert kwargs == dict(config_overrides=overrides, use_gloo_process_groups=False, pg_collection="groups",
                          dump_param_to_param_group_map="/tmp/map")
    assert dataclasses.asdict(args[0]) == dataclasses.asdict(config)  # nothing else forced


def test_layer_wise_flag_sets_the_field_on_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    config = muon_config()
    before = copy.deepcopy(dataclasses.asdict(config))
    model = Model()
    optimizer, message = call_shim(config, [model], layer_wise_distributed_optimizer=True)
    assert "use_layer_wise_distributed_optimizer=True" in message
    assert dataclasses.asdict(config) == before and not config.use_layer_wise_distributed_optimizer
    assert isinstance(optimizer, LayerWiseDistributedOptimizer)
    assert optimizer.config is not config and optimizer.config.use_layer_wise_distributed_optimizer
    reference = get_megatron_optimizer(dataclasses.replace(config, use_layer_wise_distributed_optimizer=True), [model])
    assert type(reference) is type(optimizer)
    assert group_summary(optimizer) == group_summary(reference)

    # Exactly that one field differs from the caller's config.
    calls = []
    monkeypatch.setattr(megatron_eopt.factory, "get_megatron_optimizer", lambda *a, **k: calls.append(a[0]))
    call_shim(config, [model], layer_wise_distributed_optimizer=True)
    passed = dataclasses.asdict(calls[0])
    assert {k for k in passed if passed[k] != before[k]} == {"use_layer_wise_distributed_optimizer"}


def test_legacy_dist_name_means_layer_wise(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(megatron_eopt.factory, "get_megatron_optimizer", lambda *a, **k: calls.append(a[0]))
    config = muon_config()
    config.optimizer = "dist_muon"
    _, message = call_shim(config, [Model()])
    assert calls[0].optimizer == "muon" and calls[0].use_layer_wise_distributed_optimizer
    assert config.optimizer == "dist_muon" and not config.use_layer_wise_distributed_optimizer
    assert "optimizer='muon'" in message


@pytest.mark.parametrize("name", ["adam", "sgd", "lion"])
def test_elementwise_optimizer_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="takes every parameter. Call megatron_eopt.get_megatron_optimizer"):
        get_megatron_muon_optimizer(OptimizerConfig(optimizer=name, lr=0.01), [Model()])


def test_unknown_optimizer_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names"):
        get_megatron_muon_optimizer(OptimizerConfig(optimizer="muonn", lr=0.01), [Model()])


def test_layer_wise_with_distributed_optimizer_is_the_layer_wise_optimizer() -> None:
    # use_distributed_optimizer=True means the layer-wise optimizer too, so the two agree.
    config = muon_config(use_distributed_optimizer=True)
    optimizer, _ = call_shim(config, [Model()], layer_wise_distributed_optimizer=True)
    assert isinstance(optimizer, LayerWiseDistributedOptimizer)
    assert config.use_distributed_optimizer and not config.use_layer_wise_distributed_optimizer  # caller's copy kept
    both = OptimizerConfig(optimizer="adam", lr=0.01, use_distributed_optimizer=True,
                           use_layer_wise_distributed_optimizer=True)
    assert isinstance(get_megatron_optimizer(both, [Model()]), LayerWiseDistributedOptimizer)


def test_legacy_arguments_accepted_only_at_their_defaults() -> None:
    optimizer, _ = call_shim(muon_config(), [Model()], no_weight_decay_cond=None, scale_lr_cond=None, lr_mult=1.0)
    assert isinstance(optimizer, ChainedOptimizer)
    with pytest.raises(TypeError, match="lr_mult=2.0"):
        get_megatron_muon_optimizer(muon_config(), [Model()], lr_mult=2.0)
    with pytest.raises(TypeError, match="bogus"):
        get_megatron_muon_optimizer(muon_config(), [Model()], bogus=1)


def test_no_warning_leaks_from_get_megatron_optimizer() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        get_megatron_optimizer(muon_config(), [Model()])
