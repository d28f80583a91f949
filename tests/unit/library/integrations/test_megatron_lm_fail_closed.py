"""`install()` fails closed (issue 75 item 2): an optimizer setting that megatron_eopt's optimizer
would ignore is refused in one line naming it; a default value passes.

Two kinds: a Megatron-LM argument under an optimizer's name that our OptimizerConfig has no field
for (upstream's open work adds `use_layer_sharding_muon`, `muon_ns_batch_size`, `muon_lsh_scope`,
`muon_ht_radius`), and a field the installed emerging-optimizers ignores (`soap_precondition_frequency`:
emerging-optimizers 0.3.0's SOAP takes no precondition frequency). A newer Megatron-LM's parser is
simulated by adding its flags to the installed one's, so "default" means what that parser says.
"""

import argparse
import inspect

import pytest

# Upstream's names, with a value a user would set and the default its parser would give.
NEWER_MEGATRON_LM_FLAGS = {
    "use_layer_sharding_muon": (True, False),
    "muon_ns_batch_size": (8, None),
    "muon_lsh_scope": ("global", "layer"),
    "muon_ht_radius": (2.0, 1.0),
}


@pytest.fixture
def newer_megatron_lm_parser(monkeypatch):
    """The installed Megatron-LM's parser plus NEWER_MEGATRON_LM_FLAGS, as a newer Megatron-LM's would be."""
    import megatron.training.arguments as megatron_lm_arguments

    from megatron_eopt.integrations import megatron_lm

    installed = megatron_lm_arguments.add_megatron_arguments

    def newer(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = installed(parser)
        for name, (_, default) in NEWER_MEGATRON_LM_FLAGS.items():
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=default)
        return parser

    monkeypatch.setattr(megatron_lm_arguments, "add_megatron_arguments", newer)
    megatron_lm._megatron_lm_parser_facts.cache_clear()
    yield
    megatron_lm._megatron_lm_parser_facts.cache_clear()


def _config_from(**args):
    from megatron_eopt.integrations.megatron_lm import optimizer_config_from_megatron_lm

    return optimizer_config_from_megatron_lm(argparse.Namespace(**{"optimizer": "muon", "lr": 1e-3, **args}),
                                             argparse.Namespace())


@pytest.mark.parametrize("name", sorted(NEWER_MEGATRON_LM_FLAGS))
def test_an_unread_megatron_lm_optimizer_argument_is_refused_by_name(name: str, newer_megatron_lm_parser) -> None:
    value, default = NEWER_MEGATRON_LM_FLAGS[name]
    with pytest.raises(ValueError, match=rf"^megatron_eopt's optimizer does not read args\.{name}={value!r}: ") as error:
        _config_from(**{name: value})
    assert "\n" not in str(error.value) and "without megatron_lm.install()" in str(error.value)
    assert _config_from(**{name: default}).optimizer == "muon"  # the parser's default changes nothing


def test_validate_args_refuses_it_before_megatron_lms_own_checks(newer_megatron_lm_parser) -> None:
    from megatron_eopt.integrations.megatron_lm import validate_args_for_megatron_eopt

    with pytest.raises(ValueError, match=r"args\.muon_ns_batch_size=8"):
        validate_args_for_megatron_eopt(argparse.Namespace(optimizer="muon", muon_ns_batch_size=8))


def test_names_the_installed_parser_lacks_pass_only_when_off() -> None:
    """Without a parser default to compare with, None and False are off; anything else is refused."""
    assert _config_from(use_layer_sharding_muon=False, muon_ns_batch_size=None).optimizer == "muon"
    with pytest.raises(ValueError, match=r"args\.muon_ht_radius=1\.0, args\.use_layer_sharding_muon=True"):
        _config_from(use_layer_sharding_muon=True, muon_ht_radius=1.0)


def test_every_megatron_lm_default_passes() -> None:
    """No false alarm: Megatron-LM's own parser defaults, every optimizer word in them included."""
    import megatron.training.arguments as megatron_lm_arguments

    from megatron_eopt.integrations.megatron_lm import add_megatron_eopt_args, check_optimizer_args_read

    parser = add_megatron_eopt_args(megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser()))
    check_optimizer_args_read(argparse.Namespace(**{a.dest: a.default for a in parser._actions if a.dest != "help"}))


def test_a_field_the_installed_soap_ignores_is_refused_by_its_flag() -> None:
    from emerging_optimizers.soap.soap import SOAP

    assert "precondition_frequency" not in inspect.signature(SOAP).parameters  # emerging-optimizers >= 0.3.0
    with pytest.raises(ValueError, match=r"^--soap-precondition-frequency=10 has no effect with optimizer 'soap': "
                                         r"the installed emerging_optimizers \S+ SOAP takes no such setting"):
        _config_from(optimizer="soap", soap_precondition_frequency=10)
    assert _config_from(optimizer="soap", soap_precondition_frequency=1).soap_precondition_frequency == 1
    assert _config_from(optimizer="soap", soap_shampoo_beta=0.9).soap_shampoo_beta == 0.9  # SOAP takes this one


def test_the_library_and_our_trainer_refuse_it_too(monkeypatch) -> None:
    """The factory checks when it builds (any caller); the trainer's flag checks before any process group."""
    import torch

    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt import OptimizerConfig, get_megatron_optimizer

    model = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"OptimizerConfig\.soap_precondition_frequency=10 has no effect"):
        get_megatron_optimizer(OptimizerConfig(optimizer="soap", lr=1e-3, soap_precondition_frequency=10), [model])
    monkeypatch.setenv("WORLD_SIZE", "1")
    for argv in (["--optimizer", "soap", "--soap-precondition-frequency", "10"],
                 ["--optimizer", "muon", "--muon-ns-batch-size", "8"]):  # unknown flags stay refused
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--lr", "1e-3", *argv])
        assert exit_.value.code == 2
