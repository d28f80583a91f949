"""The optimizer registry: names, loud import failures, entry points, kwargs from the config,
eager state.

Tests that change the table use a fresh `OptimizerTable` (monkeypatched in), which loads
emerging_optimizers and the entry points on its first use, as the process's table does.
"""

import pathlib
import subprocess
import sys
import typing

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt import registry
from megatron_eopt.registry import BuildContext, EmergingOptimizerEntry, OptimizerTable

PLUGIN_SITE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "plugin_site"
ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def fresh_table(monkeypatch):
    table = OptimizerTable()
    monkeypatch.setattr(registry.table, "_TABLE", table)
    return table


@pytest.fixture
def plugin_on_path(monkeypatch, fresh_table):
    monkeypatch.syspath_prepend(str(PLUGIN_SITE))
    yield fresh_table
    sys.modules.pop("eopt_test_plugin", None)


class _Plain(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1, weight_decay=0.0, *, beta: float = 0.5, mode: typing.Literal["a", "b"] = "a"):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.beta, self.mode = beta, mode

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])


# ------------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------------


def test_every_emerging_optimizer_is_registered():
    from emerging_optimizers import registry as eo_registry

    names = registry.list_optimizers()
    assert names == sorted(names)
    assert {"adam", "sgd"} | set(eo_registry.get_optimizer_name_list()) == set(names)
    for name in eo_registry.get_optimizer_name_list():
        spec = registry.lookup_optimizer(name)
        assert spec.emerging and spec.routing in registry.ROUTINGS
        if name in ("mop", "polargrad", "scion"):  # theirs, over TP shards
            assert spec.entry.optimizer_cls.__mro__[2] is eo_registry.get_optimizer_cls(name)
        elif name not in ("muon", "adaptive_muon"):  # ours: tensor-parallel subclasses of theirs
            assert spec.entry.optimizer_cls is eo_registry.get_optimizer_cls(name)
    assert registry.lookup_optimizer("muon").entry.optimizer_cls.__name__ == "TensorParallelMuon"
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon, Muon

    assert issubclass(registry.lookup_optimizer("muon").entry.optimizer_cls, Muon)
    assert issubclass(registry.lookup_optimizer("adaptive_muon").entry.optimizer_cls, AdaptiveMuon)


# What each optimizer of emerging_optimizers 0.3 takes (the decision the registry documents).
EXPECTED_ROUTING = {
    "adam": "all", "sgd": "all", "lion": "all", "laprop": "all",
    # The oblique optimizers too: their first step would renormalize an embedding's columns (issue #18).
    **{name: "hidden_matrices" for name in ("muon", "adaptive_muon", "mop", "polargrad", "scion", "spel",
                                            "muon_hyperball", "sinkhorn_muon", "soap", "rekls", "psgd_pro",
                                            "oblique_sgd", "oblique_adam")},
}


def test_routing_decision_per_optimizer():
    assert {name: registry.lookup_optimizer(name).routing for name in registry.list_optimizers()} == EXPECTED_ROUTING


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"^unknown optimizer 'soapp'; valid names: adam, adaptive_muon, .*muon, .*soap, spel\. Deprecated spelling: 'dist_muon'"):
        registry.lookup_optimizer("soapp")


@pytest.mark.parametrize("name", ["Muon2", "", "2x", "with-dash", " muon"])
def test_bad_names_are_rejected(fresh_table, name):
    with pytest.raises(ValueError, match="optimizer names are lower-case identifiers"):
        registry.register_emerging_optimizer(name, EmergingOptimizerEntry(_Plain))


@pytest.mark.parametrize("name", ["muon", "adam", "lion"])
def test_duplicate_names_are_rejected(fresh_table, name):
    with pytest.raises(ValueError, match=rf"an optimizer named '{name}' is already registered"):
        registry.register_emerging_optimizer(name, EmergingOptimizerEntry(_Plain))


def test_bad_entries_are_rejected(fresh_table):
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        EmergingOptimizerEntry(dict)
    with pytest.raises(ValueError, match="routing must be one of 'hidden_matrices', 'matrices', 'all'; got 'rows'"):
        EmergingOptimizerEntry(_Plain, routing="rows")
    with pytest.raises(ValueError, match="sets 'optimizer'"):
        EmergingOptimizerEntry(_Plain, default_param_overrides={registry_key(): {"optimizer": "adam"}})
    with pytest.raises(TypeError, match="takes an EmergingOptimizerEntry"):
        registry.register_emerging_optimizer("plain", _Plain)
    registry.register_emerging_optimizer("plain", EmergingOptimizerEntry(_Plain))
    assert "plain" in registry.list_optimizers()


def registry_key():
    from megatron_eopt import ParamKey

    return ParamKey(name="*")


def test_failed_emerging_import_is_loud(fresh_table, monkeypatch):
    # What a renamed module looks like: importing it fails.
    monkeypatch.setitem(sys.modules, "emerging_optimizers.soap", None)
    for name in ("muon", "lion", "soap", "not_a_name"):
        with pytest.raises(ImportError, match=r"optimizer '\w+' is unavailable: .*import emerging_optimizers\.soap failed"):
            registry.lookup_optimizer(name)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ImportError, match=r"emerging_optimizers\.soap"):
        get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1), model)
    for name in ("adam", "sgd"):  # built in: unaffected
        get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=0.1), model)


# ------------------------------------------------------------------------------------------------
# Third-party optimizers through entry points
# ------------------------------------------------------------------------------------------------


def test_entry_point_optimizers_work_by_name(plugin_on_path):
    with pytest.warns(RuntimeWarning, match="entry point 'broken_plugin'.*missing_attribute"):
        names = registry.list_optimizers()
    assert {"sign_descent", "matrix_sign_descent"} <= set(names) and "muon" in names
    with pytest.raises(ImportError, match=r"optimizer 'broken_plugin' is unavailable: entry point 'broken_plugin'"):
        registry.lookup_optimizer("broken_plugin")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    start = [p.detach().clone() for p in model.parameters()]
    grads = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    config = OptimizerConfig(optimizer="sign_descent", lr=0.1, weight_decay=0.0, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, model)
    assert type(optimizer.chained_optimizers[0].optimizer).__name__ == "SignDescent"
    assert optimizer.step()[0]
    for p, p0, g in zip(model.parameters(), start, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * torch.sign(g), rtol=0, atol=0)

    routed = get_megatron_optimizer(OptimizerConfig(optimizer="matrix_sign_descent", lr=0.1), model)
    assert [c.name for c in routed.chained_optimizers] == ["matrix_sign_descent/dense", "adam/dense"]


def test_entry_point_found_by_a_fresh_interpreter_from_the_command_line(tmp_path):
    """`--optimizer sign_descent` in a new process with the plugin on PYTHONPATH: nothing else."""
    code = (
        "import argparse, torch, warnings\n"
        "from megatron_eopt import OptimizerConfig, get_megatron_optimizer\n"
        "warnings.simplefilter('ignore')\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--optimizer', default='adam')\n"
        "parser.add_argument('--lr', type=float)\n"
        "args = parser.parse_args(['--optimizer', 'sign_descent', '--lr', '0.5'])\n"
        "model = torch.nn.Linear(3, 2)\n"
        "before = model.weight.detach().clone()\n"
        "model.weight.grad = torch.ones(2, 3); model.bias.grad = -torch.ones(2)\n"
        "optimizer = get_megatron_optimizer(OptimizerConfig(**vars(args), clip_grad=0.0, weight_decay=0.0), model)\n"
        "assert optimizer.step()[0]\n"
        "assert torch.equal(model.weight.detach(), before - 0.5), model.weight\n"
        "print('PLUGIN-OK', type(optimizer.chained_optimizers[0].optimizer).__name__)\n"
    )
    env = {"PYTHONPATH": f"{PLUGIN_SITE}:{ROOT}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PLUGIN-OK SignDescent" in result.stdout


# ------------------------------------------------------------------------------------------------
# Constructor kwargs from the config
# ------------------------------------------------------------------------------------------------


def _kwargs(name, context=BuildContext(), **config):
    spec = registry.lookup_optimizer(name)
    return registry.optimizer_kwargs(name, spec.entry, OptimizerConfig(lr=0.5, **config), context)[0]


def test_muon_kwargs_follow_the_muon_fields():
    kwargs = _kwargs("muon", muon_momentum=0.8, muon_nesterov=True, muon_num_ns_steps=7, muon_scale_mode="unit_rms_norm",
                     muon_extra_scale_factor=0.2, muon_tp_mode="sharded", muon_coefficient_type="polar_express",
                     weight_decay=0.3, decoupled_weight_decay=False)
    layouts = kwargs.pop("layouts")
    assert layouts == {}
    assert kwargs == dict(lr=0.5, momentum=0.8, weight_decay=0.3, nesterov=True, weight_decay_method="l2",
                          fp32_matmul_prec="medium", coefficient_type="polar_express", num_ns_steps=7,
                          scale_mode="unit_rms_norm", extra_scale_factor=0.2, use_syrk=False, tp_mode="sharded",
                          tp_group=None, gram_newton_schulz=False, gram_newton_schulz_package=False,
                          aol_preconditioner=False)


def test_matmul_precision_is_the_configs_on_every_device():
    assert _kwargs("muon", muon_fp32_matmul_prec="medium")["fp32_matmul_prec"] == "medium"
    assert _kwargs("muon", muon_fp32_matmul_prec="highest")["fp32_matmul_prec"] == "highest"
    accelerator = BuildContext(on_cpu=False)
    assert _kwargs("muon", accelerator, muon_fp32_matmul_prec="high")["fp32_matmul_prec"] == "high"
    for context in (accelerator, BuildContext()):  # SOAP's own defaults, on CPU too
        soap = _kwargs("soap", context)
        assert "fp32_matmul_prec" not in soap and "qr_fp32_matmul_prec" not in soap


def test_other_optimizers_kwargs():
    assert _kwargs("lion", lion_beta1=0.8, lion_beta2=0.9) == dict(lr=0.5, weight_decay=0.01, weight_decay_method="decoupled",
                                                                    betas=(0.8, 0.9))
    soap = _kwargs("soap", adam_beta1=0.7, adam_beta2=0.8, adam_eps=1e-6, soap_shampoo_beta=0.5, soap_use_kl_shampoo=False)
    assert (soap["betas"], soap["eps"], soap["shampoo_beta"], soap["use_kl_shampoo"]) == ((0.7, 0.8), 1e-6, 0.5, False)
    assert "precondition_frequency" not in soap  # emerging_optimizers 0.3's SOAP has no such argument
    assert _kwargs("rekls", soap_shampoo_beta=0.6)["shampoo_beta"] == 0.6
    adaptive = _kwargs("adaptive_muon", muon_momentum=0.7, adaptive_muon_beta2=0.5, adaptive_muon_eps=1e-5,
                       adaptive_muon_moment2_method="normuon")
    assert (adaptive["momentum"], adaptive["beta2"], adaptive["eps"], adaptive["moment2_method"]) == (0.7, 0.5, 1e-5, "normuon")
    mop = _kwargs("mop", muon_momentum=0.7, muon_scale_mode="spectral")
    assert "momentum" not in mop and "scale_mode" not in mop  # mop keeps its own defaults
    assert _kwargs("muon_hyperball", muon_momentum=0.7)["momentum"] == 0.7


def test_bad_values_fail_at_construction_naming_the_field():
    model = torch.nn.Linear(4, 4, bias=False)
    accelerator = BuildContext(on_cpu=False)
    spec = registry.lookup_optimizer("muon")
    groups = [{"params": list(model.parameters()), "param_fqns": ["weight"], "lr": 0.1}]
    with pytest.raises(ValueError, match=r"OptimizerConfig\.muon_fp32_matmul_prec must be one of 'highest', 'high', 'medium'.*got 'low'"):
        spec.build(groups, OptimizerConfig(lr=0.1, muon_fp32_matmul_prec="low"), accelerator)
    with pytest.raises(ValueError, match=r"OptimizerConfig\.muon_coefficient_type must be one of .*got 'custom'"):
        spec.build(groups, OptimizerConfig(lr=0.1, muon_coefficient_type="custom"))


def test_entry_kwargs_are_checked_against_the_signature(fresh_table):
    registry.register_emerging_optimizer(
        "plain", EmergingOptimizerEntry(_Plain, config_to_kwargs=lambda config: {"betas": (0.1, 0.2)}))
    with pytest.raises(TypeError, match=r"_Plain takes no argument\(s\) \['betas'\] \(from config_to_kwargs of optimizer 'plain'\)"):
        get_megatron_optimizer(OptimizerConfig(optimizer="plain", lr=0.1), torch.nn.Linear(2, 2))
    registry.register_emerging_optimizer(
        "plain_modes", EmergingOptimizerEntry(_Plain, config_to_kwargs=lambda config: {"mode": "c", "beta": 0.9}))
    with pytest.raises(ValueError, match=r"must be one of 'a', 'b' for _Plain\.mode .*got 'c'"):
        get_megatron_optimizer(OptimizerConfig(optimizer="plain_modes", lr=0.1), torch.nn.Linear(2, 2))


def test_one_d_parameter_forced_into_a_matrix_optimizer_names_it():
    weight, bias = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4))
    groups = [{"params": [weight, bias], "param_fqns": ["layer.weight", "layer.bias"], "lr": 0.1}]
    for name in ("muon", "soap", "oblique_adam"):
        with pytest.raises(ValueError, match=rf"parameter 'layer\.bias' has shape \(4,\).*'{name}' steps 2-D matrices only"):
            registry.lookup_optimizer(name).build(groups, OptimizerConfig(lr=0.1))


# ------------------------------------------------------------------------------------------------
# Eager state: what a fresh optimizer holds is what its first step would have created
# ------------------------------------------------------------------------------------------------


def _state_summary(optimizer, params):
    def describe(value):
        if torch.is_tensor(value):
            return tuple(value.shape), value.dtype
        if isinstance(value, list):
            return [tuple(t.shape) for t in value]
        return type(value).__name__

    return [{key: describe(value) for key, value in optimizer.state[p].items()} for p in params]


@pytest.mark.parametrize("name", [n for n in EXPECTED_ROUTING if n not in ("adam", "sgd")])
def test_state_is_created_eagerly_and_equals_the_lazy_state(name):
    spec = registry.lookup_optimizer(name)
    torch.manual_seed(0)
    shapes = [(6, 4), (4, 6)] + ([(5,)] if spec.routing == "all" else [])
    values = [torch.rand(s) + 0.1 for s in shapes]
    if name == "sinkhorn_muon":
        from emerging_optimizers.utils.sinkhorn_mapper import SinkhornMapper

        values = [SinkhornMapper(num_iters=50)(v) for v in values]
    grads = [torch.randn(s) for s in shapes]
    eager = [torch.nn.Parameter(v.clone()) for v in values]
    config = OptimizerConfig(lr=0.01)
    optimizer = spec.build([{"params": eager, "param_fqns": [f"p{i}" for i in range(len(eager))], "lr": 0.01}], config)
    eager_state = _state_summary(optimizer, eager)
    assert all(eager_state), f"{name}: no eager state {eager_state}"
    # The same class built directly (lazy state), stepped once, from the same RNG state.
    lazy = [torch.nn.Parameter(v.clone()) for v in values]
    kwargs, _ = registry.optimizer_kwargs(name, spec.entry, config)
    reference = spec.entry.optimizer_cls([{"params": lazy, "lr": 0.01}], **kwargs)
    for params, opt in ((eager, optimizer), (lazy, reference)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch.manual_seed(1)
        # Both eager: the state is the question, and compiling PSGD-Pro's update alone took 27 s (cold cache).
        with torch.compiler.set_stance("force_eager"):
            opt.step()
    assert _state_summary(reference, lazy) == _state_summary(optimizer, eager) == eager_state
    for a, b in zip(eager, lazy):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer, given, unread", [
    ("adam", ["muon_momentum", "adam_beta2", "soap_shampoo_beta", "lr"], ["muon_momentum", "soap_shampoo_beta"]),
    ("sgd", ["sgd_momentum", "muon_momentum", "adam_beta1"], ["adam_beta1", "muon_momentum"]),
    ("muon", ["muon_momentum", "adam_beta1", "lion_beta1"], ["lion_beta1"]),  # Adam steps Muon's scalars
    ("soap", ["soap_shampoo_beta", "muon_tp_mode"], ["muon_tp_mode"]),
])
def test_fields_without_effect_are_other_optimizers_settings(optimizer: str, given: list[str], unread: list[str]) -> None:
    """What `--optimizer X` leaves unread among the given fields (both entries name them at start-up)."""
    from megatron_eopt.registry.fields_read import fields_without_effect

    assert sorted(fields_without_effect(OptimizerConfig(optimizer=optimizer, lr=1e-3), given)) == unread
