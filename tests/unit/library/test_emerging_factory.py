"""Emerging optimizers through get_megatron_optimizer.

- every registered name steps megatron-core's GPTModel (TP=1, one gloo rank, one model build)
  and changes every parameter; each parameter reaches the optimizer its routing says;
- Muon routing on the GPTModel, read back from `dump_param_to_param_group_map` and from the
  chain's children, with adam and with lion as the scalar optimizer;
- the 'muon' step equals a hand-written Muon (EMA momentum, emerging_optimizers'
  newton_schulz, spectral scale, decoupled weight decay) to 1e-6;
- the factory hands TP group and per-fqn MatrixLayouts (QKV and gate/up blocks) to an optimizer
  class that takes them;
- bad input fails at construction with the messages below.
"""

import json
import math
import os
import types

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, ParamKey, get_megatron_optimizer
from megatron_eopt import registry
from megatron_eopt.params.groups import build_param_groups, matrix_layouts
from megatron_eopt.params.overrides import get_standard_config_overrides

HIDDEN_MATRICES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


# ------------------------------------------------------------------------------------------------
# megatron-core GPTModel (one rank)
# ------------------------------------------------------------------------------------------------


def _gpt_settings():
    from megatron_eopt.training.model.gpt import GPTModelSettings

    return GPTModelSettings(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=8)


def _expected_optimizer(routing: str, name: str, param: torch.nn.Parameter, primary: str, scalar: str) -> str:
    """Routing, written independently of the library: by name, shape and megatron's tags."""
    if routing == "all":
        return primary
    if param.dim() != 2:
        return scalar
    if routing == "matrices":
        return primary
    return primary if name.endswith(HIDDEN_MATRICES) else scalar


def _step_every_optimizer(rank: int, world_size: int, dump_dir: str) -> dict:
    from megatron_eopt.training.model.gpt import build_gpt_model, destroy_model_parallel, gpt_loss, initialize_model_parallel

    initialize_model_parallel(1, seed=3)
    try:
        settings = _gpt_settings()
        model = build_gpt_model(settings)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, settings.vocab_size, (2, settings.seq_length + 1), generator=generator)
        gpt_loss(model, tokens).backward()
        named = dict(model.named_parameters())
        initial = {n: p.detach().clone() for n, p in named.items()}
        grads = {n: p.grad.detach().clone() for n, p in named.items()}
        results = {}
        for name in registry.list_optimizers():
            for n, p in named.items():
                p.data.copy_(initial[n])
                p.grad = grads[n].clone()
            if name == "sinkhorn_muon":  # it takes only matrices already Sinkhorn-normalized (its docs)
                _sinkhorn_normalize(p for n, p in named.items() if n.endswith(HIDDEN_MATRICES))
            # Uncompiled: what this checks (routing, a finite step that moves every parameter) is the same,
            # and a cold compile cache costs tens of seconds here; the compiled updates: test_compiled_step.py.
            config = OptimizerConfig(optimizer=name, lr=0.01, min_lr=0.0, emerging_optimizers_compile=False)
            dump = os.path.join(dump_dir, name)
            optimizer = get_megatron_optimizer(config, model, dump_param_to_param_group_map=dump)
            ok, grad_norm, _ = optimizer.step()
            spec = registry.lookup_optimizer(name)
            with open(os.path.join(dump_dir, name, "rank_00000.json")) as handle:
                dumped = json.load(handle)
            results[name] = {
                "ok": ok,
                "finite": all(torch.isfinite(p).all().item() for p in named.values()),
                "unchanged": sorted(n for n, p in named.items() if torch.equal(p.detach(), initial[n])),
                "wrong_route": sorted(
                    n for n, p in named.items()
                    if dumped[n]["optimizer"] != _expected_optimizer(spec.routing, n, p, name, "adam")
                ),
                "children": [child.name for child in optimizer.chained_optimizers],
                "classes": sorted({type(child.optimizer).__name__ for child in optimizer.chained_optimizers}),
            }
        results["__muon__"] = _muon_routing(model, dump_dir)
        results["__layouts__"] = _gpt_layouts(model)
        return results
    finally:
        destroy_model_parallel()


def _sinkhorn_normalize(params) -> None:
    from emerging_optimizers.utils.sinkhorn_mapper import SinkhornMapper

    mapper = SinkhornMapper(num_iters=50)
    with torch.no_grad():
        for p in params:
            p.copy_(mapper(p.abs() + 0.01))


def _muon_routing(model: torch.nn.Module, dump_dir: str) -> dict:
    """Per scalar optimizer: the dumped map and, per child, the fqns its groups hold."""
    out = {}
    for scalar in ("adam", "lion"):
        config = OptimizerConfig(optimizer="muon", lr=0.01, muon_scalar_optimizer=scalar)
        path = os.path.join(dump_dir, f"muon_{scalar}")
        optimizer = get_megatron_optimizer(config, model, dump_param_to_param_group_map=path)
        with open(os.path.join(path, "rank_00000.json")) as handle:
            dumped = json.load(handle)
        children = {}
        for child in optimizer.chained_optimizers:
            fqns = [f for g in child.param_groups for f in g["param_fqns"]]
            sizes = [len(g["params"]) for g in child.param_groups]
            assert sizes == [len(g["param_fqns"]) for g in child.param_groups]
            children[child.name] = {"class": type(child.optimizer).__name__, "fqns": sorted(fqns),
                                    "group_keys": [g["group_key"] for g in child.param_groups]}
        out[scalar] = {"dumped": dumped, "children": children}
    return out


def _gpt_layouts(model: torch.nn.Module) -> dict:
    config = OptimizerConfig(optimizer="muon", lr=0.01)
    _, records = build_param_groups([model], config, get_standard_config_overrides(config))
    layouts = matrix_layouts([r for r in records if r.param.dim() == 2], [model], 1, split_qkv=True)
    return {fqn: (layout.num_row_groups, layout.row_blocks) for fqn, layout in layouts.items()}


@pytest.fixture(scope="module")
def gpt_results(run_distributed, tmp_path_factory):
    return run_distributed(_step_every_optimizer, 1, args=(str(tmp_path_factory.mktemp("dump")),))[0]


def test_every_registered_optimizer_steps_gpt_model(gpt_results):
    names = set(registry.list_optimizers())
    from emerging_optimizers import registry as eo_registry

    assert set(eo_registry.get_optimizer_name_list()) | {"adam", "sgd"} <= names
    for name in names:
        result = gpt_results[name]
        assert result["ok"] and result["finite"], name
        assert result["unchanged"] == [], (name, result["unchanged"])
        assert result["wrong_route"] == [], (name, result["wrong_route"])


def test_muon_routing_on_gpt_model(gpt_results):
    for scalar in ("adam", "lion"):
        routed = gpt_results["__muon__"][scalar]
        dumped = routed["dumped"]
        to_muon = sorted(n for n, e in dumped.items() if e["optimizer"] == "muon")
        to_scalar = sorted(n for n, e in dumped.items() if e["optimizer"] == scalar)
        assert sorted(to_muon + to_scalar) == sorted(dumped)
        # Every hidden 2-D weight to muon, and nothing else.
        assert to_muon == sorted(n for n in dumped if n.endswith(HIDDEN_MATRICES))
        assert len(to_muon) == 4
        for expected in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                         "output_layer.weight", "decoder.final_layernorm.weight"):
            assert expected in to_scalar
        assert any(n.endswith("layernorm.weight") for n in to_scalar)
        assert all(e["group_key"].startswith(e["optimizer"] + "/dense/") for e in dumped.values())
        # The chain: one child per optimizer, holding exactly what the map says.
        children = routed["children"]
        assert list(children) == ["muon/dense", f"{scalar}/dense"]
        assert children["muon/dense"]["class"] == "TensorParallelMuon"
        assert children["muon/dense"]["fqns"] == to_muon
        assert children[f"{scalar}/dense"]["class"] == {"adam": "AdamW", "lion": "Lion"}[scalar]
        assert children[f"{scalar}/dense"]["fqns"] == to_scalar
        for child, info in children.items():
            assert all(key.startswith(child.split("/")[0] + "/") for key in info["group_keys"])


def test_single_optimizer_runs_keep_dense_child_name(gpt_results):
    assert gpt_results["adam"]["children"] == ["dense"]
    assert gpt_results["lion"]["children"] == ["dense"]
    assert gpt_results["soap"]["children"] == ["soap/dense", "adam/dense"]
    assert gpt_results["soap"]["classes"] == ["AdamW", "SOAP"]


def test_gpt_layouts_split_qkv_and_gate_up(gpt_results):
    settings = _gpt_settings()
    kv = settings.hidden_size // settings.num_attention_heads
    q = settings.num_attention_heads // settings.query_groups * kv
    layouts = gpt_results["__layouts__"]
    qkv = [v for n, v in layouts.items() if n.endswith("linear_qkv.weight")]
    fc1 = [v for n, v in layouts.items() if n.endswith("linear_fc1.weight")]
    assert qkv == [(settings.query_groups, (q, kv, kv))]
    assert fc1 == [(1, (settings.ffn_hidden_size, settings.ffn_hidden_size))]
    others = [v for n, v in layouts.items() if not n.endswith(("linear_qkv.weight", "linear_fc1.weight"))]
    assert others and all(v == (1, ()) for v in others)


# ------------------------------------------------------------------------------------------------
# Muon against a hand-written reference
# ------------------------------------------------------------------------------------------------


def _reference_muon(weight, grads, lr, momentum, weight_decay):
    """Muon written out: EMA momentum, Newton-Schulz, spectral scale, decoupled weight decay."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    weight = weight.clone()
    buffer = torch.zeros_like(weight)
    rows, cols = weight.shape
    for grad in grads:
        buffer = momentum * buffer + (1 - momentum) * grad
        with torch.no_grad():
            previous = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
            try:
                orthogonal = newton_schulz(buffer, steps=5, coefficient_type="quintic")
            finally:
                torch.set_float32_matmul_precision(previous)
        weight = weight * (1 - lr * weight_decay) - lr * math.sqrt(max(rows, cols)) * orthogonal
    return weight


def test_muon_step_equals_reference():
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 16, bias=False)
    start = model.weight.detach().clone()
    grads = [torch.randn(16, 24) for _ in range(3)]
    config = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_momentum=0.9, clip_grad=0.0,
                             muon_fp32_matmul_prec="highest")  # the fp32 reference below
    optimizer = get_megatron_optimizer(config, model)
    assert [c.name for c in optimizer.chained_optimizers] == ["muon/dense"]
    for grad in grads:
        model.weight.grad = grad.clone()
        assert optimizer.step()[0]
    expected = _reference_muon(start, grads, lr=0.02, momentum=0.9, weight_decay=0.1)
    torch.testing.assert_close(model.weight.detach(), expected, rtol=0, atol=1e-6)
    assert not torch.allclose(expected, start)


def test_muon_state_dict_resume_is_exact():
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 4))
        config = OptimizerConfig(optimizer="muon", lr=0.05, muon_scalar_optimizer="lion")
        return model, get_megatron_optimizer(config, model)

    def run(model, optimizer, steps):
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator)
            assert optimizer.step()[0]

    straight, straight_opt = build(0)
    run(straight, straight_opt, range(4))
    first, first_opt = build(0)
    run(first, first_opt, range(2))
    saved = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "optimizer": first_opt.state_dict()}
    assert {g["optimizer_class"] for g in saved["optimizer"]["param_groups"]} == {
        type(child.optimizer).__name__ for child in first_opt.chained_optimizers}
    resumed, resumed_opt = build(1)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    run(resumed, resumed_opt, range(2, 4))
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_bf16_model_with_muon_steps_through_fp32_main_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.05, bf16=True), model)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    assert optimizer.step()[0]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    mains = [m for c in optimizer.chained_optimizers for m in c.main_params]
    assert all(m.dtype == torch.float32 for m in mains)


# ------------------------------------------------------------------------------------------------
# What the factory hands to a tensor-parallel optimizer class
# ------------------------------------------------------------------------------------------------


class _Attention(torch.nn.Module):
    def __init__(self, hidden, rows):
        super().__init__()
        self.linear_qkv = torch.nn.Linear(hidden, rows, bias=False)


class _TinyTransformer(torch.nn.Module):
    """The names and `.config` that megatron-core's layers have, without megatron-core."""

    def __init__(self, heads=4, groups=2, kv_channels=4, gate=False, ffn=10):
        super().__init__()
        self.config = types.SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=kv_channels,
                                            hidden_size=heads * kv_channels, attention_output_gate=gate,
                                            gated_linear_unit=True)
        hidden = heads * kv_channels
        q = heads // groups * kv_channels
        rows = groups * (q + 2 * kv_channels + (q if gate else 0))
        self.embedding = torch.nn.Embedding(32, hidden)
        self.self_attention = _Attention(hidden, rows)
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.mlp.linear_fc2 = torch.nn.Linear(ffn, hidden)
        self.norm = torch.nn.LayerNorm(hidden)


@pytest.fixture
def spy_muon(monkeypatch):
    """'spy_muon': a Muon subclass taking tp_group/layouts, registered in a fresh table."""
    from emerging_optimizers.orthogonalized_optimizers.muon import Muon

    seen = {}

    class SpyMuon(Muon):
        def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.01, *, tp_group=None, layouts=None, **kwargs):
            seen.update(tp_group=tp_group, layouts=dict(layouts), kwargs=dict(kwargs, momentum=momentum))
            super().__init__(params, lr, momentum, weight_decay, **kwargs)

    monkeypatch.setattr(registry.table, "_TABLE", registry.OptimizerTable())
    entry = registry.EmergingOptimizerEntry(SpyMuon, config_prefixes=("muon",))
    registry.register_emerging_optimizer("spy_muon", entry)
    return seen


def test_factory_passes_layouts_and_tp_group(spy_muon):
    model = _TinyTransformer(gate=True)
    config = OptimizerConfig(optimizer="spy_muon", lr=0.1, muon_momentum=0.8, muon_fp32_matmul_prec="high")
    get_megatron_optimizer(config, model)
    layouts = spy_muon["layouts"]
    assert sorted(layouts) == ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "self_attention.linear_qkv.weight"]
    qkv = layouts["self_attention.linear_qkv.weight"]
    assert (qkv.num_row_groups, qkv.row_blocks, qkv.tp_size, qkv.partition_dim) == (2, (8, 8, 4, 4), 1, -1)  # q, gate, k, v (see test_gpt_model)
    assert layouts["mlp.linear_fc1.weight"].row_blocks == (10, 10)
    assert layouts["mlp.linear_fc2.weight"].row_blocks == ()
    assert spy_muon["tp_group"] is None
    assert spy_muon["kwargs"]["momentum"] == 0.8
    assert spy_muon["kwargs"]["fp32_matmul_prec"] == "high"  # the config's, on CPU too

    get_megatron_optimizer(OptimizerConfig(optimizer="spy_muon", lr=0.1, muon_split_qkv=False), model)
    assert spy_muon["layouts"]["self_attention.linear_qkv.weight"].row_blocks == ()


def test_layout_that_does_not_fit_names_the_parameter(spy_muon):
    model = _TinyTransformer()
    model.config.num_query_groups = 4  # the weight was built for 2 query groups
    with pytest.raises(ValueError, match=r"parameter 'self_attention\.linear_qkv\.weight': .*rows"):
        get_megatron_optimizer(OptimizerConfig(optimizer="spy_muon", lr=0.1), model)


def _tp_guard_body(rank: int, world_size: int) -> list[str]:
    model = torch.nn.Linear(4, 6, bias=False)
    model.weight.tensor_model_parallel, model.weight.partition_dim = True, 0
    groups = ParallelGroups.from_groups(tp=dist.group.WORLD, mp=dist.group.WORLD)
    errors = []
    for name in ("soap", "adaptive_muon", "muon", "lion"):
        try:
            get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=0.1), model, pg_collection=groups)
            errors.append(f"{name}: ok")
        except ValueError as error:
            errors.append(f"{name}: {error}")
    return errors


def test_matrix_optimizer_without_tp_support_refuses_tp_shards(run_distributed):
    soap, adaptive, muon, lion = run_distributed(_tp_guard_body, 2)[0]
    assert "'soap' (SOAP) does not support tensor parallelism" in soap and "'weight' is split over 2 TP ranks" in soap
    assert adaptive == "adaptive_muon: ok"  # megatron_eopt's TensorParallelAdaptiveMuon
    assert muon == "muon: ok" and lion == "lion: ok"  # TP-aware, and elementwise


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_unknown_optimizer_lists_emerging_names():
    with pytest.raises(ValueError, match=r"unknown optimizer 'muonn'; valid names: adam, .*\bmuon\b.*\bsgd\b"):
        get_megatron_optimizer(OptimizerConfig(optimizer="muonn", lr=0.1), torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["muon", "lion", "soap"])
def test_fp16_with_emerging_optimizer_is_rejected(name):
    model = torch.nn.Linear(4, 4).half()
    with pytest.raises(ValueError, match=rf"fp16=True is not supported with optimizer '{name}': .*bf16 works"):
        get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=0.1, fp16=True), model)


def test_override_may_not_set_optimizer_in_muon_run():
    with pytest.raises(ValueError, match=r"sets 'optimizer'='adam'.*may not change the optimizer"):
        get_megatron_optimizer(
            OptimizerConfig(optimizer="muon", lr=0.1), torch.nn.Linear(4, 4),
            config_overrides={ParamKey(name="*.bias"): {"optimizer": "adam"}},
        )


def test_unknown_coefficient_type_lists_installed_ones():
    import typing

    from emerging_optimizers.orthogonalized_optimizers.muon_utils import NSCoeffT

    valid = [t for t in typing.get_args(NSCoeffT) if t != "custom"]
    listed = ", ".join(map(repr, valid))
    message = rf"OptimizerConfig\.muon_coefficient_type must be one of {listed} .*got 'quintik'"
    with pytest.raises(ValueError, match=message):
        get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, muon_coefficient_type="quintik"),
                               torch.nn.Linear(4, 4))


def test_scalar_lr_through_overrides():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    one_d = ParamKey(with_name_predicate=registry_free_1d())
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.02), model,
                                       config_overrides={one_d: {"max_lr": 0.5, "wd_mult": 0.0}})
    lrs = {g["group_key"]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups}
    assert lrs == {"muon/dense/default": (0.02, 0.01), "adam/dense/ParamKey(with_name_predicate=1d)": (0.5, 0.0)}


def registry_free_1d():
    from megatron_eopt import ParamWithNamePredicate

    return ParamWithNamePredicate(name="1d", fn=lambda p, name: p.dim() == 1)


def test_match_adamw_rms_is_extra_scale_point_two() -> None:
    """muon_match_adamw_rms=True takes the same step as hand-setting muon_extra_scale_factor=0.2."""

    def step(**fields) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False))
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="muon", lr=0.1, weight_decay=0.0, clip_grad=0.0, **fields), model
        )
        before = model[0].weight.detach().clone()
        model[0].weight.grad = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        assert optimizer.step()[0]
        return before - model[0].weight.detach()

    switched, by_hand, default = step(muon_match_adamw_rms=True), step(muon_extra_scale_factor=0.2), step()
    torch.testing.assert_close(switched, by_hand, rtol=0, atol=0)
    # p - (p - lr*u) rounds at the magnitude of p, hence an absolute tolerance
    torch.testing.assert_close(switched, 0.2 * default, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="muon_match_adamw_rms needs muon_scale_mode='spectral'"):
        OptimizerConfig(optimizer="muon", lr=0.1, muon_match_adamw_rms=True, muon_scale_mode="shape_scaling")


def test_dist_muon_is_the_deprecated_spelling_of_layer_wise_muon() -> None:
    from megatron_eopt.distributed.layer_wise import LayerWiseDistributedOptimizer

    config = OptimizerConfig(optimizer="dist_muon", lr=0.1)
    with pytest.warns(DeprecationWarning, match="write optimizer='muon' with use_layer_wise_distributed_optimizer=True"):
        optimizer = get_megatron_optimizer(config, torch.nn.Linear(4, 4))
    assert isinstance(optimizer, LayerWiseDistributedOptimizer)
    assert config.optimizer == "dist_muon" and not config.use_layer_wise_distributed_optimizer  # not mutated
