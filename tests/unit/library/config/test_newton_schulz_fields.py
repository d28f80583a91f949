"""The Newton-Schulz fields reach every orthogonalizing optimizer; Turbo-Muon's defaults (config/newton_schulz.py).

- `muon_aol_preconditioner` gives muon and adaptive_muon quintic coefficients and 4 steps for
  the fields left at megatron-core's defaults, also when switched on after construction; a value
  the user sets is kept even where it equals the default. The built optimizer's Newton-Schulz
  takes the preconditioner, and its update equals ops/aol.py's on the momentum.
- Set, `muon_fp32_matmul_prec`, `muon_coefficient_type` and `muon_num_ns_steps` reach scion,
  polargrad, spel and the Muon subclasses; unset, each keeps its own default (PolarGrad's
  'highest'); an orthogonalized optimizer that takes no such argument (mop) refuses it in one line.
- The preconditioner is refused, in one line, for an optimizer whose Newton-Schulz is
  emerging_optimizers', and with the kernels that do not run it (syrk, the Gram package).
- The trainer's flags (`--muon-aol-preconditioner`) resolve the same way.
"""

import dataclasses

import pytest
import torch

from arguments.optimizer_args import add_optimizer_args
from arguments.to_config import optimizer_config_from_args
from megatron_eopt import registry
from megatron_eopt.config.newton_schulz import coefficients_and_steps
from megatron_eopt.config.optimizer_config import OptimizerConfig
from megatron_eopt.ops.aol import aol_newton_schulz
from megatron_eopt.registry import BuildContext


def kwargs_for(name: str, **fields) -> dict:
    config = OptimizerConfig(optimizer=name, lr=0.1, **fields)
    return registry.optimizer_kwargs(name, registry.lookup_optimizer(name).entry, config, BuildContext())[0]


@pytest.mark.parametrize("name", ["muon", "adaptive_muon"])
def test_turbo_muon_defaults_and_values_the_user_set(name: str) -> None:
    assert coefficients_and_steps(OptimizerConfig()) == ("quintic", 5)
    turbo = kwargs_for(name, muon_aol_preconditioner=True)
    assert (turbo["coefficient_type"], turbo["num_ns_steps"], turbo["aol_preconditioner"]) == ("quintic", 4, True)
    kept = kwargs_for(name, muon_aol_preconditioner=True, muon_num_ns_steps=5, muon_coefficient_type="polar_express")
    assert (kept["coefficient_type"], kept["num_ns_steps"]) == ("polar_express", 5)
    assert kwargs_for(name, muon_aol_preconditioner=True, muon_num_ns_steps=5)["num_ns_steps"] == 5  # set: kept
    config = OptimizerConfig(optimizer=name)
    config.muon_aol_preconditioner = True  # consumers mutate configs after construction
    assert coefficients_and_steps(config.finalize()) == ("quintic", 4)
    assert coefficients_and_steps(dataclasses.replace(config, muon_num_ns_steps=3)) == ("quintic", 3)


def test_the_built_muon_steps_with_the_preconditioner() -> None:
    param = torch.nn.Parameter(torch.randn(16, 48, generator=torch.Generator().manual_seed(0)))
    spec = registry.lookup_optimizer("muon")
    config = OptimizerConfig(optimizer="muon", lr=0.1, muon_aol_preconditioner=True, muon_fp32_matmul_prec="highest",
                             muon_momentum=0.0, weight_decay=0.0)
    optimizer = spec.build([{"params": [param], "param_fqns": ["w"], "lr": 0.1}], config)
    settings = optimizer.settings
    assert (settings.aol, settings.coefficient_type, settings.num_steps) == (True, "quintic", 4)
    before, grad = param.detach().clone(), torch.randn(16, 48, generator=torch.Generator().manual_seed(1))
    param.grad = grad.clone()
    optimizer.step()
    with torch.no_grad():
        expected = before - 0.1 * settings.scale(16, 48) * aol_newton_schulz(grad, 4, "quintic")
    assert (param.detach() - expected).abs().max() <= 1e-6


def test_newton_schulz_fields_reach_the_other_orthogonalizers() -> None:
    assert "fp32_matmul_prec" not in kwargs_for("polargrad")  # unset: PolarGrad's own 'highest'
    assert kwargs_for("scion", muon_fp32_matmul_prec="highest")["fp32_matmul_prec"] == "highest"
    polargrad = kwargs_for("polargrad", muon_coefficient_type="polar_express", muon_num_ns_steps=7)
    assert (polargrad["coefficient_type"], polargrad["num_ns_steps"]) == ("polar_express", 7)
    assert kwargs_for("spel", muon_num_ns_steps=6)["num_ns_steps"] == 6
    assert kwargs_for("muon_hyperball", muon_coefficient_type="cans")["coefficient_type"] == "cans"
    assert kwargs_for("mop", muon_fp32_matmul_prec="medium")["fp32_matmul_prec"] == "medium"
    with pytest.raises(ValueError, match=r"muon_num_ns_steps=3 does not apply to optimizer 'mop': it takes no "
                                         r"num_ns_steps") as refused:
        kwargs_for("mop", muon_num_ns_steps=3)
    assert "\n" not in str(refused.value)
    assert "coefficient_type" not in kwargs_for("soap", muon_coefficient_type="cans")  # not an orthogonalizer


@pytest.mark.parametrize("fields, words", [
    ({"optimizer": "scion"}, "implemented for optimizer 'muon', 'dist_muon', 'adaptive_muon'"),
    ({"optimizer": "muon", "muon_use_syrk": True}, "muon_use_syrk=True: that kernel does not run"),
    ({"optimizer": "muon", "muon_gram_newton_schulz": True, "muon_gram_newton_schulz_package": True,
      "muon_fp32_matmul_prec": "medium"}, "muon_gram_newton_schulz_package=True: that kernel does not run"),
])
def test_the_preconditioner_is_refused_where_it_cannot_run(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words) as refused:
        OptimizerConfig(muon_aol_preconditioner=True, **fields)
    assert "\n" not in str(refused.value)


def test_trainer_flags_resolve_the_same_way() -> None:
    import argparse

    def config_for(argv: str) -> OptimizerConfig:
        return optimizer_config_from_args(add_optimizer_args(argparse.ArgumentParser()).parse_args(argv.split()),
                                          device=torch.device("cpu"))

    assert coefficients_and_steps(config_for("--optimizer muon --muon-aol-preconditioner")) == ("quintic", 4)
    assert coefficients_and_steps(config_for("--optimizer muon --muon-aol-preconditioner --muon-num-ns-steps 5")) == (
        "quintic", 5)
    assert coefficients_and_steps(config_for("--optimizer muon")) == ("quintic", 5)
    # Chosen for the device, not given: scion keeps its own precision.
    assert "fp32_matmul_prec" not in registry.optimizer_kwargs(
        "scion", registry.lookup_optimizer("scion").entry, config_for("--optimizer scion"), BuildContext())[0]
