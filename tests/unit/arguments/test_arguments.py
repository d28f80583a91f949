"""Command-line flags: dest == OptimizerConfig field, dataclass defaults, Megatron-LM rewrites,
one-line errors naming the flag, and a frozen list of flags (cf. torchtitan's
test_no_new_cli_options.py)."""

import argparse
import dataclasses
import subprocess
import sys
import warnings

import pytest
import torch

from arguments import add_optimizer_args, optimizer_config_from_args, parse_and_validate, validate_args
from arguments.optimizer_args import FLAGS, MEGATRON_LM_PARSER_DEFAULTS
from arguments.validate import check_before_import
from megatron_eopt.config.choices import plain_value
from megatron_eopt.config.optimizer_config import OptimizerConfig
from megatron_eopt.registry import list_optimizers

# Every option string add_optimizer_args adds. Adding, removing or renaming a flag is a change to
# the command line users script against: update this list on purpose, in the same change.
FROZEN_OPTIONS = sorted([
    "--optimizer", "--lr", "--min-lr", "--decoupled-lr", "--decoupled-min-lr", "--weight-decay",
    "--apply-wd-to-qk-layernorm", "--clip-grad", "--grad-norm-skip-threshold",
    "--log-num-zeros-in-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum",
    "--muon-momentum", "--muon-nesterov", "--muon-no-split-qkv", "--muon-split-qkv-per-head", "--muon-scale-mode",
    "--muon-fp32-matmul-prec", "--muon-aol-preconditioner", "--muon-coefficient-type", "--muon-num-ns-steps",
    "--muon-tp-mode",
    "--muon-expert-tp-mode", "--muon-tp-hardware-profile",
    "--muon-extra-scale-factor", "--muon-match-adamw-rms", "--muon-scalar-optimizer",
    "--muon-use-syrk", "--muon-gram-newton-schulz", "--muon-gram-newton-schulz-package",
    "--lion-beta1", "--lion-beta2", "--soap-shampoo-beta",
    "--soap-precondition-frequency", "--soap-no-kl-shampoo", "--adaptive-muon-moment2-method",
    "--adaptive-muon-beta2", "--adaptive-muon-eps", "--no-emerging-optimizers-compile",
    "--use-distributed-optimizer",
    "--use-layer-wise-distributed-optimizer", "--layer-wise-reduce-grads", "--overlap-param-gather",
    "--overlap-param-gather-with-optimizer-step", "--fp16", "--bf16", "--loss-scale",
    "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis",
    "--qk-clip", "--qk-clip-threshold", "--qk-clip-alpha", "--log-max-attention-logit",
    "--use-precision-aware-optimizer", "--no-store-param-remainders", "--main-params-dtype",
    "--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype",
    "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--use-torch-optimizer-for-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads", "--no-pin-cpu-params",
    "--allow-optimizer-change-on-load",
])
NEGATIVE_FLAGS = {"--muon-no-split-qkv": "muon_split_qkv", "--soap-no-kl-shampoo": "soap_use_kl_shampoo",
                  "--no-emerging-optimizers-compile": "emerging_optimizers_compile",
                  "--no-store-param-remainders": "store_param_remainders",
                  "--no-pin-cpu-grads": "pin_cpu_grads", "--no-pin-cpu-params": "pin_cpu_params"}
FLAG_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # Megatron-LM's names
FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
HARDWARE_DEFAULTS = {"muon_fp32_matmul_prec"}  # flags whose default is chosen from the hardware
RAW_HELP = {flag.dest: flag.help for flag in FLAGS}  # each flag's help as its table row writes it


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return add_optimizer_args(argparse.ArgumentParser(prog="train"))


def optimizer_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def parse(parser: argparse.ArgumentParser, *argv: str, tp: int = 1) -> argparse.Namespace:
    return validate_args(parser.parse_args(list(argv)), tensor_model_parallel_size=tp)


def test_every_dest_is_a_field_with_the_dataclass_default(parser) -> None:
    actions = optimizer_actions(parser)
    assert len(actions) == len(FROZEN_OPTIONS)
    for action in actions:
        assert action.dest in FIELD_DEFAULTS, f"{action.option_strings}: dest {action.dest!r} is no field"
        if action.dest in HARDWARE_DEFAULTS:  # None: chosen for the device by optimizer_config_from_args
            assert action.default is None, action.option_strings
            continue
        default = FLAG_DTYPES.get(action.default, action.default)  # a dtype flag's default by its name
        # Megatron-LM's parser's default where it differs (tests/unit/training/test_megatron_lm_parity.py checks it)
        expected = MEGATRON_LM_PARSER_DEFAULTS.get(action.dest, FIELD_DEFAULTS[action.dest])
        assert default == expected, action.option_strings
        assert type(default) is type(expected), action.option_strings


def test_defaults_give_the_default_config(parser) -> None:
    from megatron_eopt.config.optimizer_config import fp32_matmul_prec_for

    cpu = torch.device("cpu")
    chosen = fp32_matmul_prec_for(cpu)[0]
    assert optimizer_config_from_args(parse(parser), cpu) == OptimizerConfig(muon_fp32_matmul_prec=chosen,
                                                                             **MEGATRON_LM_PARSER_DEFAULTS)


def test_help_shows_every_flags_default(parser) -> None:
    """`--help` shows each optimizer flag's default as a command line resolves it: here the parser's own
    default (read from OptimizerConfig, Megatron-LM's where MEGATRON_LM_PARSER_DEFAULTS says), in this
    parser's help and in our trainer's, whose parser leaves the defaults None until torch is imported."""
    from megatron_eopt.training.arguments.parser import build_parser

    expected = {}
    for action in optimizer_actions(parser):
        if action.dest in HARDWARE_DEFAULTS:
            expected[action.dest] = "Default: chosen from the hardware"
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            expected[action.dest] = "Default: off."  # a switch: off unless given
        elif action.default is None:  # "none", whose meaning the help gives, or the help's own rule
            expected[action.dest] = None if "Default:" in RAW_HELP[action.dest] else "Default: none."
        else:
            expected[action.dest] = f"Default: {plain_value(action.default)}."
    assert {dest for dest, text in expected.items() if text is None} == {"muon_expert_tp_mode", "muon_tp_hardware_profile"}
    for shown_by in (parser, build_parser()):
        helps = {a.dest: " ".join(a.help.split()) for a in shown_by._actions if a.dest in expected}
        assert set(helps) == set(expected)
        for dest, text in expected.items():
            assert (text or "Default:") in helps[dest], (dest, helps[dest])
    muon_momentum = {a.dest: a.help for a in optimizer_actions(parser)}["muon_momentum"]
    assert "Default: 0.9." in muon_momentum and "0.95" in muon_momentum  # the library's default named too


def test_frozen_option_list(parser) -> None:
    options = sorted(s for a in optimizer_actions(parser) for s in a.option_strings)
    assert options == FROZEN_OPTIONS, (
        f"added: {sorted(set(options) - set(FROZEN_OPTIONS))}, "
        f"removed: {sorted(set(FROZEN_OPTIONS) - set(options))}; update FROZEN_OPTIONS on purpose"
    )


def test_booleans_are_store_true_except_megatron_negative_spellings(parser) -> None:
    for action in optimizer_actions(parser):
        if action.nargs != 0:
            continue
        (option,) = action.option_strings
        if option in NEGATIVE_FLAGS:
            assert isinstance(action, argparse._StoreFalseAction) and action.dest == NEGATIVE_FLAGS[option]
        else:
            assert isinstance(action, argparse._StoreTrueAction), option
    args = parse(parser, "--muon-no-split-qkv", "--soap-no-kl-shampoo")
    assert args.muon_split_qkv is False and args.soap_use_kl_shampoo is False


def test_choices_come_from_what_is_installed(parser) -> None:
    from megatron_eopt.ops.newton_schulz import TP_MODES, coefficient_types

    choices = {a.dest: a.choices for a in optimizer_actions(parser) if a.choices}
    assert list(choices["optimizer"]) == list_optimizers() + ["dist_muon"]
    assert tuple(choices["muon_coefficient_type"]) == coefficient_types()
    assert tuple(choices["muon_tp_mode"]) == (*TP_MODES, "auto")  # 'auto' resolves to those per matrix
    assert tuple(choices["muon_expert_tp_mode"]) == (*TP_MODES, "auto")
    assert tuple(choices["adaptive_muon_moment2_method"]) == ("adamuon", "normuon")
    assert tuple(choices["muon_fp32_matmul_prec"]) == ("highest", "high", "medium")


def test_dist_muon_is_deprecated_and_means_layer_wise_muon(parser) -> None:
    with pytest.warns(DeprecationWarning, match="--optimizer muon --use-distributed-optimizer"):
        args = parse(parser, "--optimizer", "dist_muon")
    assert args.optimizer == "muon"
    assert args.use_layer_wise_distributed_optimizer is True
    assert args.use_distributed_optimizer is False


def test_config_refuses_unvalidated_dist_muon(parser) -> None:
    with pytest.raises(ValueError, match="validate_args"):
        optimizer_config_from_args(parser.parse_args(["--optimizer", "dist_muon"]))


@pytest.mark.parametrize("optimizer", ["muon", "soap", "lion", "adaptive_muon"])
def test_emerging_with_distributed_optimizer_becomes_layer_wise(parser, optimizer) -> None:
    args = parse(parser, "--optimizer", optimizer, "--use-distributed-optimizer")
    assert args.use_layer_wise_distributed_optimizer is True
    assert args.use_distributed_optimizer is False
    config = optimizer_config_from_args(args)
    assert config.use_layer_wise_distributed_optimizer and not config.use_distributed_optimizer


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_adam_sgd_with_distributed_optimizer_become_layer_wise_too(parser, optimizer) -> None:
    # megatron_eopt has no byte-sharded optimizer; the layer-wise one shards Adam's state too.
    args = parse(parser, "--optimizer", optimizer, "--use-distributed-optimizer")
    assert args.use_distributed_optimizer is False
    assert args.use_layer_wise_distributed_optimizer is True


def test_fp16_with_emerging_optimizer_names_the_flag(parser) -> None:
    with pytest.raises(ValueError, match="--fp16") as raised:
        parse(parser, "--optimizer", "muon", "--fp16")
    assert "\n" not in str(raised.value)
    assert "fp16=" not in str(raised.value)  # the flag, not the field
    parse(parser, "--optimizer", "adam", "--fp16")  # fine with adam
    # A trainer's check before the import (the torch-free lists) refuses it in the same words, and dist_muon too.
    for name in ("muon", "dist_muon"):
        with pytest.raises(ValueError) as before_import:
            check_before_import(argparse.Namespace(optimizer=name, fp16=True))
        assert str(before_import.value) == str(raised.value)
    check_before_import(argparse.Namespace(optimizer="adam", fp16=True))
    check_before_import(argparse.Namespace(optimizer=None, fp16=True))  # not given: adam


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lr", "-1"], "--lr"),
        (["--adam-beta1", "1.5"], "--adam-beta1"),
        (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
        (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps"),
        (["--fp16", "--bf16"], "--fp16"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_flag(parser, capsys, argv, flag) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_and_validate(argv, parser)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("train: error: ") and flag in lines[0], err
    assert "OptimizerConfig" not in lines[0] and "Traceback" not in err


def test_bad_value_from_a_real_command_line() -> None:
    code = "from arguments import parse_and_validate; parse_and_validate()"
    result = subprocess.run(
        [sys.executable, "-c", code, "--adam-beta1", "1.5"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--adam-beta1 must be in [0, 1); got 1.5." in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_optimizer_lists_the_valid_names(parser, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(["--optimizer", "muonn"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizer" in err and "'muonn'" in err
    for name in ("adam", "muon", "dist_muon", "soap"):
        assert f"'{name}'" in err


def test_muon_tp_mode_without_tensor_parallelism_warns(parser) -> None:
    with pytest.warns(UserWarning, match="--muon-tp-mode sharded has no effect"):
        parse(parser, "--optimizer", "muon", "--muon-tp-mode", "sharded", tp=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse(parser, "--optimizer", "muon", "--muon-tp-mode", "sharded", tp=2)
        parse(parser, "--optimizer", "muon", tp=1)  # not given: nothing to warn about
        args = parser.parse_args(["--optimizer", "muon", "--muon-tp-mode", "blockwise"])
        args.tensor_model_parallel_size = 4  # Megatron-LM's namespace carries the TP size
        validate_args(args)


@pytest.mark.parametrize("tp", [1, 2])
def test_muon_tp_mode_with_an_optimizer_that_is_not_muon_says_so(parser, tp: int) -> None:
    with pytest.warns(UserWarning) as caught:
        parse(parser, "--optimizer", "adam", "--muon-tp-mode", "sharded", tp=tp)
    messages = [str(w.message) for w in caught if "--muon-tp-mode" in str(w.message)]
    assert messages == ["--muon-tp-mode sharded has no effect with --optimizer adam, which does not use Muon's "
                        "tensor-parallel modes (those that do: adaptive_muon, muon)."], messages


def test_round_trip_equals_building_the_config_directly(parser) -> None:
    argv = [
        "--optimizer", "muon", "--lr", "3e-4", "--min-lr", "3e-5", "--decoupled-lr", "1e-4",
        "--weight-decay", "0.1", "--apply-wd-to-qk-layernorm", "--clip-grad", "0.5",
        "--grad-norm-skip-threshold", "100", "--adam-beta2", "0.95", "--adam-eps", "1e-10",
        "--muon-momentum", "0.9", "--muon-nesterov", "--muon-no-split-qkv",
        "--muon-fp32-matmul-prec", "high", "--muon-coefficient-type", "polar_express",
        "--muon-num-ns-steps", "6", "--muon-tp-mode", "distributed", "--muon-match-adamw-rms",
        "--muon-scalar-optimizer", "lion", "--lion-beta1", "0.9", "--soap-no-kl-shampoo",
        "--use-distributed-optimizer", "--overlap-param-gather", "--bf16",
    ]
    config = optimizer_config_from_args(parse(parser, *argv, tp=2))
    expected = OptimizerConfig(
        optimizer="muon", lr=3e-4, min_lr=3e-5, decoupled_lr=1e-4, weight_decay=0.1,
        apply_wd_to_qk_layernorm=True, clip_grad=0.5, grad_norm_skip_threshold=100.0,
        adam_beta2=0.95, adam_eps=1e-10, muon_momentum=0.9, muon_nesterov=True,
        muon_split_qkv=False, muon_fp32_matmul_prec="high", muon_coefficient_type="polar_express",
        muon_num_ns_steps=6, muon_tp_mode="distributed", muon_match_adamw_rms=True,
        muon_scalar_optimizer="lion", lion_beta1=0.9, soap_use_kl_shampoo=False,
        use_layer_wise_distributed_optimizer=True, overlap_param_gather=True, bf16=True,
        optimizer_offload_fraction=1.0,  # Megatron-LM's parser default (read only with --optimizer-cpu-offload)
    )
    assert config == expected


def test_config_copies_only_fields_and_keeps_defaults_for_missing_ones() -> None:
    args = argparse.Namespace(optimizer="sgd", lr=0.1, seq_length=4096)  # a Megatron-LM-like subset
    config = optimizer_config_from_args(args)
    assert config == OptimizerConfig(optimizer="sgd", lr=0.1)


def test_fp32_matmul_prec_takes_the_backend_values_and_refuses_low(parser, capsys) -> None:
    for value in ("highest", "high", "medium"):
        assert optimizer_config_from_args(parse(parser, "--muon-fp32-matmul-prec", value)).muon_fp32_matmul_prec == value
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(["--muon-fp32-matmul-prec", "low"])
    assert raised.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert "--muon-fp32-matmul-prec" in errors[0] and "'low'" in errors[0]
    assert all(value in errors[0] for value in ("highest", "high", "medium")), errors[0]


def test_cpu_offload_takes_megatron_lms_flags_and_refuses_what_it_refuses(parser) -> None:
    args = parse(parser, "--bf16", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                 "--optimizer-offload-fraction", "0.5", "--no-pin-cpu-params")
    assert (args.optimizer_cpu_offload, args.optimizer_offload_fraction, args.pin_cpu_params) == (True, 0.5, False)
    assert parse(parser).optimizer_offload_fraction == 1.0  # Megatron-LM's parser default
    with pytest.raises(ValueError, match=r"--optimizer-cpu-offload needs --use-precision-aware-optimizer"):
        parse(parser, "--optimizer-cpu-offload")
    with pytest.raises(ValueError, match=r"--optimizer-offload-fraction must be in \[0, 1\] .*; got 1.5"):
        parse(parser, "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5")
