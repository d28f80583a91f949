"""ParamKey matching, override merging/checking and the standard overrides.

References are megatron-core's own `ParamKey`, `combine_param_group_overrides` and
`get_standard_config_overrides` (imported once per module).
"""

import dataclasses
import re
import types

import pytest
import torch

from megatron_eopt.config.optimizer_config import OptimizerConfig
from megatron_eopt.params.overrides import (
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    check_config_overrides,
    get_standard_config_overrides,
    matching_keys,
    merge_overrides,
)


OURS = types.SimpleNamespace(
    ParamKey=ParamKey, ParamPredicate=ParamPredicate, ParamWithNamePredicate=ParamWithNamePredicate
)


def _param(*shape, **attrs) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(*shape))
    for name, value in attrs.items():
        setattr(param, name, value)
    return param


def _named_params() -> list[tuple[str, torch.nn.Parameter]]:
    return [
        ("embedding.word_embeddings.weight", _param(32, 8, is_embedding_or_output_parameter=True)),
        ("layers.0.linear.weight", _param(8, 8)),
        ("layers.0.linear.bias", _param(8)),
        ("layers.0.norm.weight", _param(8)),
        ("layers.1.linear.weight", _param(8, 8, allreduce=False)),
        ("layers.1.linear.bias", _param(8, allreduce=True)),
        ("layers.1.self_attention.q_layernorm.weight", _param(8)),
        ("layers.1.self_attention.k_layernorm.bias", _param(8)),
        ("layers.12.mlp.weight", _param(16, 8, shared=True)),
        ("output_layer.weight", _param(32, 8, is_embedding_or_output_parameter=True)),
        ("bias", _param(2, 2)),  # top-level, no dot: "*.bias" must not match
        ("alpha", _param(1, is_embedding_or_output_parameter=False)),
        ("big.bias.weight", _param(4, 4)),
    ]


def _dim1(mod):
    return mod.ParamPredicate(name="dim1", fn=lambda p: p.dim() == 1)


def _big(mod):
    return mod.ParamPredicate(name="big", fn=lambda p: p.numel() > 100)


def _norm_name(mod):
    return mod.ParamWithNamePredicate(name="norm", fn=lambda p, n: "norm" in n)


def _wide_expert(mod):
    return mod.ParamWithNamePredicate(
        name="wide_expert", fn=lambda p, n: n.startswith("layers.1.") and p.dim() == 2
    )


# Each spec builds the same key with ours or megatron-core's classes.
KEY_SPECS = {
    "name_glob": lambda m: m.ParamKey(name="*.bias"),
    "name_tuple": lambda m: m.ParamKey(name=("*.weight", "embedding.*")),
    "name_single_char": lambda m: m.ParamKey(name="layers.?.linear.weight"),
    "name_char_class": lambda m: m.ParamKey(name="[ab]*"),
    "name_exact": lambda m: m.ParamKey(name="output_layer.weight"),
    "attr": lambda m: m.ParamKey(attr="is_embedding_or_output_parameter"),
    "attr_tuple": lambda m: m.ParamKey(attr=("shared", "is_embedding_or_output_parameter")),
    "attr_falsy_value": lambda m: m.ParamKey(attr="allreduce"),
    "predicate": lambda m: m.ParamKey(predicate=_dim1(m)),
    "predicate_tuple": lambda m: m.ParamKey(predicate=(_dim1(m), _big(m))),
    "with_name_predicate": lambda m: m.ParamKey(with_name_predicate=_norm_name(m)),
    "with_name_predicate_tuple": lambda m: m.ParamKey(
        with_name_predicate=(_norm_name(m), _wide_expert(m))
    ),
    "name_or_predicate": lambda m: m.ParamKey(name="*.bias", predicate=_dim1(m)),
    "everything": lambda m: m.ParamKey(
        name="output_*", attr="shared", predicate=_big(m), with_name_predicate=_norm_name(m)
    ),
    "empty": lambda m: m.ParamKey(),
}


@pytest.mark.parametrize("spec", KEY_SPECS.values(), ids=KEY_SPECS.keys())
def test_matches_agrees_with_megatron_core(mcore, spec):
    ours, theirs = spec(OURS), spec(mcore)
    named = _named_params()
    our_verdicts = {name: ours.matches(p, name) for name, p in named}
    their_verdicts = {name: theirs.matches(p, name) for name, p in named}
    assert our_verdicts == their_verdicts
    assert all(type(v) is bool for v in our_verdicts.values())


@pytest.mark.parametrize("spec", KEY_SPECS.values(), ids=KEY_SPECS.keys())
def test_each_key_is_selective(spec):
    """Guards the comparison above: no key (but the empty one) matches all or nothing."""
    verdicts = [spec(OURS).matches(p, name) for name, p in _named_params()]
    if spec is KEY_SPECS["empty"]:
        assert not any(verdicts)
    else:
        assert any(verdicts) and not all(verdicts)


def test_glob_uses_the_full_name():
    weight = _param(4, 4)
    assert ParamKey(name="*linear.weight").matches(weight, "decoder.layers.3.linear.weight")
    assert not ParamKey(name="linear.weight").matches(weight, "decoder.layers.3.linear.weight")


def test_any_field_matching_is_enough():
    bias = _param(4)
    never = ParamPredicate(name="never", fn=lambda p: False)
    assert ParamKey(name="nomatch", attr="missing", predicate=(never, _dim1(OURS))).matches(bias, "x")
    assert not ParamKey(name="nomatch", attr="missing", predicate=never).matches(bias, "x")


def test_predicates_hash_and_compare_by_name():
    first = ParamPredicate(name="p", fn=lambda p: True)
    second = ParamPredicate(name="p", fn=lambda p: False)
    other = ParamPredicate(name="q", fn=lambda p: True)
    assert first == second and hash(first) == hash(second)
    assert first != other
    assert len({first, second, other}) == 2

    named_first = ParamWithNamePredicate(name="p", fn=lambda p, n: True)
    named_second = ParamWithNamePredicate(name="p", fn=lambda p, n: False)
    assert named_first == named_second and hash(named_first) == hash(named_second)
    assert named_first != ParamWithNamePredicate(name="q", fn=lambda p, n: True)


def test_param_key_is_a_frozen_hashable_dict_key():
    key = ParamKey(name="*.bias", predicate=ParamPredicate(name="dim1", fn=lambda p: p.dim() == 1))
    same = ParamKey(name="*.bias", predicate=ParamPredicate(name="dim1", fn=lambda p: False))
    table = {key: "no-wd"}
    assert table[same] == "no-wd"
    assert ParamKey(name="*.weight") not in table
    assert ParamKey(name="*.bias") not in table
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.name = "*.weight"


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"name": 3}, "name"),
        ({"name": ("*.bias", None)}, "name"),
        ({"name": ["*.bias"]}, "name"),
        ({"attr": 1.5}, "attr"),
        ({"predicate": lambda p: True}, "predicate"),
        ({"predicate": ParamWithNamePredicate(name="w", fn=lambda p, n: True)}, "predicate"),
        ({"with_name_predicate": ParamPredicate(name="p", fn=lambda p: True)}, "with_name_predicate"),
        ({"with_name_predicate": (lambda p, n: True,)}, "with_name_predicate"),
    ],
)
def test_bad_field_types_raise_type_error(kwargs, field_name):
    with pytest.raises(TypeError, match=rf"ParamKey\.{field_name}\b"):
        ParamKey(**kwargs)


# ------------------------------------------------------------------------------------------------
# merge_overrides
# ------------------------------------------------------------------------------------------------

NO_WD = ParamKey(name="*.bias")
EMBEDDING = ParamKey(attr="is_embedding_or_output_parameter")
FULL_WD = ParamKey(predicate=ParamPredicate(name="is_matrix", fn=lambda p: p.dim() == 2))
NO_WD_LOW_LR = ParamKey(with_name_predicate=ParamWithNamePredicate(name="norms", fn=lambda p, n: True))
OVERRIDES = {
    NO_WD: {"wd_mult": 0.0},
    EMBEDDING: {"max_lr": 0.5, "min_lr": 0.05},
    FULL_WD: {"wd_mult": 1.0},
    NO_WD_LOW_LR: {"wd_mult": 0.0, "min_lr": 0.05, "eps": 1e-6},
}


@pytest.mark.parametrize(
    "keys", [[NO_WD, EMBEDDING], [EMBEDDING, NO_WD], [NO_WD, NO_WD_LOW_LR], [NO_WD, EMBEDDING, NO_WD_LOW_LR], []]
)
def test_merge_overrides_agrees_with_megatron_core(mcore, keys):
    merged = merge_overrides(keys, OVERRIDES, "layer.bias")
    assert merged == dict(mcore.combine([OVERRIDES[k] for k in keys]))


@pytest.mark.parametrize("first, second", [(NO_WD, FULL_WD), (FULL_WD, NO_WD_LOW_LR)])
def test_merge_overrides_conflict_names_parameter_field_and_both_keys(first, second):
    with pytest.raises(ValueError) as excinfo:
        merge_overrides([EMBEDDING, first, second], OVERRIDES, "decoder.layers.0.linear.bias")
    message = str(excinfo.value)
    assert "decoder.layers.0.linear.bias" in message
    assert "wd_mult" in message
    assert "*.bias" in message or "norms" in message  # the key with wd_mult=0
    assert "is_matrix" in message  # the key with wd_mult=1
    assert "0.0" in message and "1.0" in message


def test_merge_overrides_conflict_also_for_megatron_core_keys(mcore):
    theirs = {mcore.ParamKey(name="*.bias"): {"max_lr": 0.1}, mcore.ParamKey(attr="foo"): {"max_lr": 0.2}}
    with pytest.raises(ValueError, match=r"max_lr") as excinfo:
        merge_overrides(list(theirs), theirs, "x.bias")
    assert "*.bias" in str(excinfo.value) and "foo" in str(excinfo.value)


def test_matching_keys_follows_dict_order():
    bias = _param(8)
    assert matching_keys(OVERRIDES, bias, "a.bias") == [NO_WD, NO_WD_LOW_LR]
    assert matching_keys({}, bias, "a.bias") == []


# ------------------------------------------------------------------------------------------------
# check_config_overrides
# ------------------------------------------------------------------------------------------------


def test_check_config_overrides_accepts_valid(mcore):
    check_config_overrides({})
    check_config_overrides(OVERRIDES)
    check_config_overrides(get_standard_config_overrides(OptimizerConfig(lr=1.0, decoupled_lr=0.5)))
    check_config_overrides({mcore.ParamKey(name="*.bias"): {"wd_mult": 0.0}})


def test_override_may_not_change_the_optimizer():
    with pytest.raises(ValueError, match=r"'optimizer'") as excinfo:
        check_config_overrides({ParamKey(name="*.weight"): {"optimizer": "sgd", "max_lr": 0.1}})
    assert "*.weight" in str(excinfo.value)


@pytest.mark.parametrize("protected", ["params", "is_expert_parallel", "group_key"])
def test_override_may_not_set_protected_group_keys(protected):
    with pytest.raises(ValueError, match=re.escape(protected)):
        check_config_overrides({ParamKey(name="*.weight"): {protected: []}})


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({ParamKey(name="*.bias"): [("wd_mult", 0.0)]}, r"must be a dict"),
        ({ParamKey(name="*.bias"): None}, r"must be a dict"),
        ({"*.bias": {"wd_mult": 0.0}}, r"ParamKey"),
        ({("*.bias",): {"wd_mult": 0.0}}, r"ParamKey"),
        ([(ParamKey(name="*.bias"), {"wd_mult": 0.0})], r"config_overrides"),
    ],
)
def test_check_config_overrides_type_errors(overrides, pattern):
    with pytest.raises(TypeError, match=pattern):
        check_config_overrides(overrides)


# ------------------------------------------------------------------------------------------------
# get_standard_config_overrides vs megatron-core's
# ------------------------------------------------------------------------------------------------


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_qkv = torch.nn.Linear(8, 24)
        self.q_layernorm = torch.nn.LayerNorm(8)  # weight and bias
        self.k_layernorm = torch.nn.RMSNorm(8)  # weight only


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention = _Attention()
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.linear_fc1 = torch.nn.Linear(8, 16, bias=False)
        self.gate_bias = torch.nn.Parameter(torch.zeros(2, 8))  # 2-D, name does not end in .bias


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 8)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.final_layernorm = torch.nn.LayerNorm(8)
        self.output_layer = torch.nn.Linear(8, 32)  # tagged: weight 2-D, bias 1-D
        self.output_layer.weight.is_embedding_or_output_parameter = True
        self.output_layer.bias.is_embedding_or_output_parameter = True
        self.matrix_bias = torch.nn.Module()
        self.matrix_bias.bias = torch.nn.Parameter(torch.zeros(4, 4))  # 2-D "*.bias"


STANDARD_CASES = [
    pytest.param(apply_qk, dlr, dmin, id=f"qk_wd={apply_qk}-decoupled_lr={dlr}-decoupled_min_lr={dmin}")
    for apply_qk in (False, True)
    for dlr, dmin in ((None, None), (0.5, None), (0.5, 0.05), (None, 0.05))
]


@pytest.mark.parametrize("apply_qk, decoupled_lr, decoupled_min_lr", STANDARD_CASES)
def test_standard_overrides_select_what_megatron_core_selects(
    mcore, apply_qk, decoupled_lr, decoupled_min_lr
):
    kwargs = dict(
        lr=1.0,
        min_lr=0.01,
        apply_wd_to_qk_layernorm=apply_qk,
        decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr,
    )
    ours = get_standard_config_overrides(OptimizerConfig(**kwargs))
    theirs = mcore.get_standard_config_overrides(mcore.OptimizerConfig(**kwargs))
    assert len(ours) == len(theirs)

    no_wd, decoupled = set(), set()
    for name, param in _Model().named_parameters():
        our_merged = merge_overrides(matching_keys(ours, param, name), ours, name)
        their_merged = dict(
            mcore.combine([o for k, o in theirs.items() if k.matches(param, name)])
        )
        is_decoupled = our_merged.pop("is_decoupled_lr", False)
        assert our_merged == their_merged, name
        # Ours additionally tags the decoupled group (megatron-core's logging reads it).
        assert is_decoupled == ("max_lr" in their_merged), name
        if their_merged.get("wd_mult") == 0.0:
            no_wd.add(name)
        if "max_lr" in their_merged:
            decoupled.add(name)

    # Guard: the reference really distinguishes the cases this test is about.
    assert "matrix_bias.bias" in no_wd and "layers.0.linear_fc1.weight" not in no_wd
    qk_weight = "layers.0.self_attention.q_layernorm.weight"
    assert (qk_weight in no_wd) == (not apply_qk)
    assert bool(decoupled) == (decoupled_lr is not None)


def test_standard_decoupled_override_values():
    config = OptimizerConfig(lr=1.0, decoupled_lr=0.25, decoupled_min_lr=0.025)
    overrides = get_standard_config_overrides(config)
    decoupled = [o for o in overrides.values() if "max_lr" in o]
    assert decoupled == [{"max_lr": 0.25, "min_lr": 0.025, "is_decoupled_lr": True}]


def test_standard_overrides_pass_check_config_overrides():
    for apply_qk in (False, True):
        config = OptimizerConfig(lr=1.0, decoupled_lr=0.5, apply_wd_to_qk_layernorm=apply_qk)
        check_config_overrides(get_standard_config_overrides(config))
