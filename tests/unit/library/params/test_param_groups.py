"""build_param_groups: bucketing against megatron-core's `_get_param_groups`, stable group keys,
rank alignment, and what `get_megatron_optimizer` does with overrides.
"""

import json
import os

import pytest
import torch

import megatron_eopt
from megatron_eopt.config.optimizer_config import OptimizerConfig
from megatron_eopt.params.groups import build_param_groups
from megatron_eopt.params.overrides import ParamKey, ParamPredicate, get_standard_config_overrides

REQUIRED_GROUP_KEYS = {
    "params",
    "wd_mult",
    "lr_mult",
    "is_decoupled_lr",
    "is_expert_parallel",
    "max_lr",
    "min_lr",
    "default_config",
    "group_key",
}
# Values that megatron-core's groups carry too and that must agree for the same parameters.
SHARED_VALUE_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "max_lr", "min_lr", "default_config")


@pytest.fixture
def single_rank_gather(monkeypatch):
    """megatron-core's `_get_param_groups` all-gathers its group keys; one rank gathers itself."""
    assert not torch.distributed.is_initialized()

    def all_gather_object(output, obj, group=None):
        assert len(output) == 1
        output[0] = obj

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)


class _DenseModel(torch.nn.Module):
    """An embedding, a dense linear (weight+bias), a norm and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


class _Chunk(_DenseModel):
    """The dense model's parameters, QK-layernorm, an expert and an output layer."""

    def __init__(self):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.q_layernorm = torch.nn.RMSNorm(8)
        self.self_attention.k_layernorm = torch.nn.RMSNorm(8)
        self.experts = torch.nn.Linear(8, 8)
        for param in self.experts.parameters():
            param.allreduce = False
        self.output_layer = torch.nn.Linear(8, 16, bias=False)
        self.output_layer.weight.is_embedding_or_output_parameter = True


def _configs(mcore, **kwargs):
    return OptimizerConfig(**kwargs), mcore.OptimizerConfig(**kwargs)


def _partition(groups) -> set[frozenset]:
    return {frozenset(id(p) for p in g["params"]) for g in groups if g["params"]}


def _group_of(groups, param):
    found = [g for g in groups if any(p is param for p in g["params"])]
    assert len(found) == 1
    return found[0]


CONFIG_CASES = [
    pytest.param({"lr": 0.1, "min_lr": 0.001}, id="plain"),
    pytest.param({"lr": 0.1, "weight_decay": 0.2, "apply_wd_to_qk_layernorm": True}, id="qk_wd"),
    pytest.param({"lr": 0.1, "decoupled_lr": 0.7, "decoupled_min_lr": 0.07}, id="decoupled"),
    pytest.param({"lr": 0.1, "min_lr": 0.0, "decoupled_lr": 0.7}, id="decoupled_no_min"),
]


@pytest.mark.parametrize("kwargs", CONFIG_CASES)
def test_standard_groups_match_megatron_core(mcore, single_rank_gather, kwargs):
    chunks = [_Chunk(), _Chunk()]
    ours_config, their_config = _configs(mcore, **kwargs)
    ours, records = build_param_groups(chunks, ours_config, get_standard_config_overrides(ours_config))
    theirs = mcore.get_param_groups(
        chunks, their_config, mcore.get_standard_config_overrides(their_config)
    )

    # Same partition of the parameters, by identity.
    assert _partition(ours) == _partition(theirs)
    assert all(g["params"] for g in ours), "a single rank has no empty groups"
    assert len(ours) == len(theirs)

    for group in ours:
        assert REQUIRED_GROUP_KEYS <= group.keys(), group.keys()
        reference = _group_of(theirs, group["params"][0])
        for key in SHARED_VALUE_KEYS:
            assert group[key] == reference[key], (group["group_key"], key)
        # Ready before any scheduler runs.
        assert group["lr"] == group["max_lr"]
        assert group["weight_decay"] == pytest.approx(ours_config.weight_decay * group["wd_mult"])
        is_embedding = [getattr(p, "is_embedding_or_output_parameter", False) for p in group["params"]]
        assert group["is_decoupled_lr"] == (ours_config.decoupled_lr is not None and all(is_embedding))
        assert isinstance(group["group_key"], str)
    assert len({g["group_key"] for g in ours}) == len(ours)
    assert len(records) == sum(len(g["params"]) for g in ours)


def test_frozen_parameters_are_excluded():
    chunk = _Chunk()
    config = OptimizerConfig(lr=0.1)
    groups, records = build_param_groups([chunk], config, get_standard_config_overrides(config))
    grouped = {id(p) for g in groups for p in g["params"]}
    trainable = {id(p) for p in chunk.parameters() if p.requires_grad}
    assert grouped == trainable
    assert not any(id(p) in grouped for p in chunk.frozen.parameters())
    assert {id(r.param) for r in records} == trainable


def test_expert_parameters_get_expert_groups():
    chunk = _Chunk()
    config = OptimizerConfig(lr=0.1)
    groups, records = build_param_groups([chunk], config, get_standard_config_overrides(config))
    for param in chunk.parameters():
        if not param.requires_grad:
            continue
        group = _group_of(groups, param)
        assert group["is_expert_parallel"] == (param in set(chunk.experts.parameters()))
    expert_groups = [g for g in groups if g["is_expert_parallel"]]
    assert len(expert_groups) == 2  # weight (decayed) and bias (not)
    dense_keys = {g["group_key"] for g in groups if not g["is_expert_parallel"]}
    assert not dense_keys & {g["group_key"] for g in expert_groups}


def test_fqns_get_model_chunk_prefixes_only_with_several_chunks():
    config = OptimizerConfig(lr=0.1)
    overrides = get_standard_config_overrides(config)
    chunks = [_Chunk(), _Chunk()]
    _, records = build_param_groups(chunks, config, overrides)
    expected = {
        f"model_chunk{i}.{name}"
        for i, chunk in enumerate(chunks)
        for name, p in chunk.named_parameters()
        if p.requires_grad
    }
    assert {r.fqn for r in records} == expected
    assert len(records) == len(expected)
    by_id = {id(r.param): r for r in records}
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                assert by_id[id(param)].fqn == f"model_chunk{i}.{name}"
                assert by_id[id(param)].name == name  # globs see the in-chunk name

    single = _Chunk()
    _, records = build_param_groups([single], config, overrides)
    assert {r.fqn for r in records} == {n for n, p in single.named_parameters() if p.requires_grad}


def test_custom_overrides_refine_megatron_core_partition(mcore, single_rank_gather):
    """Ours buckets by which keys matched, megatron-core by merged values: ours may split a
    megatron-core group whose members matched different keys with equal values, never merge."""
    config, their_config = _configs(mcore, lr=0.1)
    spec = [
        ("linear.weight", {"wd_mult": 0.5}),
        ("embedding.*", {"wd_mult": 0.5}),  # same values as above, different key
        ("*.bias", {"max_lr": 0.2, "eps": 1e-6}),
    ]
    ours_overrides = {ParamKey(name=glob): dict(o) for glob, o in spec}
    their_overrides = {mcore.ParamKey(name=glob): dict(o) for glob, o in spec}
    chunk = _Chunk()
    ours, _ = build_param_groups([chunk], config, ours_overrides)
    theirs = mcore.get_param_groups([chunk], their_config, their_overrides)

    our_parts, their_parts = _partition(ours), _partition(theirs)
    assert set().union(*our_parts) == set().union(*their_parts)
    for part in our_parts:
        assert any(part <= theirs_part for theirs_part in their_parts)
    # The equal-valued keys stay apart in ours, so the key (not the value) names the group.
    assert _group_of(ours, chunk.linear.weight) is not _group_of(ours, chunk.embedding.weight)
    assert _group_of(theirs, chunk.linear.weight) is _group_of(theirs, chunk.embedding.weight)
    assert _group_of(ours, chunk.linear.weight)["wd_mult"] == 0.5
    assert _group_of(ours, chunk.embedding.weight)["wd_mult"] == 0.5
    # Extra override keys reach the torch group; values agree with megatron-core's.
    for group in ours:
        reference = _group_of(theirs, group["params"][0])
        for key in (*SHARED_VALUE_KEYS, "eps"):
            assert group.get(key) == reference.get(key), (group["group_key"], key)
        assert group["lr"] == group["max_lr"]


def test_group_keys_do_not_depend_on_override_values():
    chunks = [_Chunk()]
    first = OptimizerConfig(lr=0.1, min_lr=0.01, decoupled_lr=0.5, decoupled_min_lr=0.05)
    second = OptimizerConfig(
        lr=0.3, min_lr=0.0, decoupled_lr=0.9, decoupled_min_lr=0.02, weight_decay=0.1
    )
    groups_a, _ = build_param_groups(chunks, first, get_standard_config_overrides(first))
    groups_b, _ = build_param_groups(chunks, second, get_standard_config_overrides(second))
    assert [g["group_key"] for g in groups_a] == [g["group_key"] for g in groups_b]
    assert [[id(p) for p in g["params"]] for g in groups_a] == [
        [id(p) for p in g["params"]] for g in groups_b
    ]
    # ... while the values did change.
    assert [g["max_lr"] for g in groups_a] != [g["max_lr"] for g in groups_b]


def test_group_keys_do_not_depend_on_parameter_order():
    chunk = _Chunk()
    config = OptimizerConfig(lr=0.1, decoupled_lr=0.5)
    overrides = get_standard_config_overrides(config)
    forward, _ = build_param_groups([chunk], config, overrides)
    reordered = torch.nn.Module()
    for name, module in reversed(list(chunk.named_children())):
        reordered.add_module(name, module)
    backward, _ = build_param_groups([reordered], config, overrides)
    assert [g["group_key"] for g in forward] == [g["group_key"] for g in backward]


@pytest.mark.parametrize(
    "first, second",
    [
        # Equal in meaning, different as dict keys: megatron-core applies both overrides.
        (ParamKey(name="*.bias"), ParamKey(name=("*.bias",))),
        # Same predicate name (predicates compare by name) but different functions.
        (
            ParamKey(predicate=ParamPredicate(name="sel", fn=lambda p: p.dim() == 1)),
            ParamKey(predicate=(ParamPredicate(name="sel", fn=lambda p: p.dim() == 2),)),
        ),
    ],
)
def test_distinct_keys_with_one_description_are_rejected(first, second):
    """Groups are identified by key descriptions; two keys sharing one must not silently share a
    group (which kept only one of their overrides)."""
    assert first != second
    overrides = {first: {"wd_mult": 0.0}, second: {"max_lr": 0.5}}
    with pytest.raises(ValueError, match=r"two different keys"):
        build_param_groups([_Chunk()], OptimizerConfig(lr=0.1), overrides)


# ------------------------------------------------------------------------------------------------
# Through get_megatron_optimizer
# ------------------------------------------------------------------------------------------------


def test_factory_empty_overrides_give_one_dense_group():
    optimizer = megatron_eopt.get_megatron_optimizer(
        OptimizerConfig(lr=0.1, decoupled_lr=0.5), _DenseModel(), config_overrides={}
    )
    assert len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert group["wd_mult"] == 1.0 and group["max_lr"] == 0.1 and not group["is_expert_parallel"]


@pytest.mark.parametrize("decoupled_lr", [None, 0.5])
def test_factory_none_overrides_mean_standard(mcore, single_rank_gather, decoupled_lr):
    model = _DenseModel()
    ours_config, their_config = _configs(mcore, lr=0.1, decoupled_lr=decoupled_lr)
    optimizer = megatron_eopt.get_megatron_optimizer(ours_config, model, config_overrides=None)
    theirs = mcore.get_param_groups(
        [model], their_config, mcore.get_standard_config_overrides(their_config)
    )
    assert len(optimizer.param_groups) == len(theirs) > 1
    assert sorted(len(g["params"]) for g in optimizer.param_groups) == sorted(
        len(g["params"]) for g in theirs
    )
    assert sorted((g["max_lr"], g["wd_mult"]) for g in optimizer.param_groups) == sorted(
        (g["max_lr"], g["wd_mult"]) for g in theirs
    )


def test_factory_without_lr_raises():
    with pytest.raises(ValueError, match=r"\blr\b"):
        megatron_eopt.get_megatron_optimizer(OptimizerConfig(), _DenseModel())


def test_factory_rejects_optimizer_override():
    with pytest.raises(ValueError, match=r"optimizer"):
        megatron_eopt.get_megatron_optimizer(
            OptimizerConfig(lr=0.1), _DenseModel(), config_overrides={ParamKey(name="*"): {"optimizer": "sgd"}}
        )


def test_factory_conflicting_overrides_name_the_parameter():
    overrides = {ParamKey(name="linear.*"): {"wd_mult": 0.5}, ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    with pytest.raises(ValueError, match=r"linear\.bias"):
        megatron_eopt.get_megatron_optimizer(OptimizerConfig(lr=0.1), _DenseModel(), config_overrides=overrides)


@pytest.mark.parametrize("optimizer_name", ["adam", "sgd"])
def test_dump_param_to_param_group_map(mcore, single_rank_gather, tmp_path, optimizer_name):
    model = _DenseModel()
    config = OptimizerConfig(lr=0.1, optimizer=optimizer_name, decoupled_lr=0.5)
    optimizer = megatron_eopt.get_megatron_optimizer(
        config, model, dump_param_to_param_group_map=str(tmp_path / "map")
    )
    assert os.listdir(tmp_path / "map") == ["rank_00000.json"]
    with open(tmp_path / "map" / "rank_00000.json") as handle:
        entries = json.load(handle)

    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(entries) == set(trainable)
    group_keys = {g["group_key"] for g in optimizer.param_groups}
    for name, entry in entries.items():
        assert entry["optimizer"] == optimizer_name
        assert entry["group_key"] in group_keys
        assert entry["shape"] == list(trainable[name].shape)

    # Parameters that share a group_key in the file are exactly megatron-core's buckets.
    their_config = mcore.OptimizerConfig(lr=0.1, optimizer=optimizer_name, decoupled_lr=0.5)
    theirs = mcore.get_param_groups(
        [model], their_config, mcore.get_standard_config_overrides(their_config)
    )
    by_key: dict[str, set] = {}
    for name, entry in entries.items():
        by_key.setdefault(entry["group_key"], set()).add(id(trainable[name]))
    assert {frozenset(s) for s in by_key.values()} == _partition(theirs)


# ------------------------------------------------------------------------------------------------
# Rank alignment (2 gloo processes)
# ------------------------------------------------------------------------------------------------


def _aligned_groups_on_rank(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Module()
    # Rank 0 has biases and no experts; rank 1 no biases and an expert weight.
    model.linear = torch.nn.Linear(4, 4, bias=(rank == 0))
    if rank == 1:
        model.experts = torch.nn.Linear(4, 4, bias=False)
        model.experts.weight.allreduce = False
    config = OptimizerConfig(lr=0.1, weight_decay=0.1)
    groups, _ = build_param_groups(
        [model], config, get_standard_config_overrides(config), align_groups=(dist.group.WORLD,)
    )
    summary = []
    for group in groups:
        missing = REQUIRED_GROUP_KEYS - group.keys()
        summary.append(
            {
                "group_key": group["group_key"],
                "names": sorted(n for n, p in model.named_parameters() if any(p is q for q in group["params"])),
                "is_expert_parallel": group["is_expert_parallel"],
                "wd_mult": group["wd_mult"],
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "missing": sorted(missing),
            }
        )
    return summary


def test_group_keys_are_aligned_across_ranks(run_distributed):
    rank0, rank1 = run_distributed(_aligned_groups_on_rank, 2, timeout=300)
    keys0 = [g["group_key"] for g in rank0]
    keys1 = [g["group_key"] for g in rank1]
    assert keys0 == keys1
    assert len(keys0) == len(set(keys0)) == 3  # dense default, dense no-wd (bias), expert default

    names0 = {g["group_key"]: g["names"] for g in rank0}
    names1 = {g["group_key"]: g["names"] for g in rank1}
    bias_key = next(k for k, names in names0.items() if names == ["linear.bias"])
    expert_key = next(k for k, names in names1.items() if names == ["experts.weight"])
    assert names1[bias_key] == []  # rank 1 has no bias: its group exists, empty
    assert names0[expert_key] == []  # rank 0 has no expert
    assert names0[keys0[0]] == ["linear.weight"] == names1[keys0[0]]

    for per_rank in (rank0, rank1):
        for group in per_rank:
            assert group["missing"] == []  # empty groups carry every key too
            assert group["lr"] == 0.1
            assert group["weight_decay"] == pytest.approx(0.1 * group["wd_mult"])
        by_key = {g["group_key"]: g for g in per_rank}
        assert by_key[bias_key]["wd_mult"] == 0.0 and not by_key[bias_key]["is_expert_parallel"]
        assert by_key[expert_key]["is_expert_parallel"]
