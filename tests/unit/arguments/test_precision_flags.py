"""Megatron-LM's precision-aware optimizer flags: parsed, mapped onto OptimizerConfig, and seen
in the optimizer they build (the dtypes and bytes of the tensors it holds), plus argparse's
one-line errors for values Megatron-LM's parser also refuses or fp8 (not implemented here).

Expectations are counted from the parameters: Adam keeps two moments per element, the main weight
is 4 bytes (fp32), 2 (a 16-bit remainder beside the bf16 parameter) or 0 (the bf16 parameter itself).
"""

import argparse

import pytest
import torch

from arguments import add_optimizer_args, optimizer_config_from_args, validate_args
from arguments.optimizer_args import resolve_optimizer_flags
from megatron_eopt import get_megatron_optimizer

BF16_ADAM = ["--optimizer", "adam", "--lr", "0.01", "--bf16", "--use-precision-aware-optimizer"]


def parse(argv: list[str], deferred: bool = False) -> argparse.Namespace:
    parser = add_optimizer_args(argparse.ArgumentParser(), deferred=deferred)
    args = parser.parse_args(argv)
    return validate_args(resolve_optimizer_flags(args) if deferred else args, tensor_model_parallel_size=1)


def build(argv: list[str], deferred: bool = False):
    """The model (bf16, biases off) and the optimizer after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16, bias=False), torch.nn.Linear(16, 8, bias=False)).bfloat16()
    config = optimizer_config_from_args(parse(argv + ["--muon-fp32-matmul-prec", "highest",
                                                      "--no-emerging-optimizers-compile"], deferred))
    optimizer = get_megatron_optimizer(config, model)
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.5)
    optimizer.step()
    return model, config, optimizer


def states(optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
            for child in optimizer.chained_optimizers for state in child.state.values()]


def main_param_bytes(optimizer) -> int:
    return sum(child.main_param_bytes() for child in optimizer.chained_optimizers)


@pytest.mark.parametrize("deferred", [False, True], ids=["parser", "deferred-parser"])
def test_bf16_moments_and_remainders(deferred: bool) -> None:
    model, config, optimizer = build(BF16_ADAM + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"], deferred)
    assert (config.use_precision_aware_optimizer, config.store_param_remainders) == (True, True)
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.bfloat16, torch.float16)
    assert config.main_params_dtype == config.main_grads_dtype == torch.float32
    numel = sum(p.numel() for p in model.parameters())
    held = states(optimizer)
    assert len(held) == 2 and all(s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.float16
                                  for s in held)
    assert main_param_bytes(optimizer) == 2 * numel  # one int16 remainder per element


def test_defaults_keep_fp32_state_and_main_weights() -> None:
    model, config, optimizer = build(["--optimizer", "adam", "--lr", "0.01", "--bf16"])
    assert not config.use_precision_aware_optimizer
    numel = sum(p.numel() for p in model.parameters())
    assert all(t.dtype == torch.float32 for s in states(optimizer) for t in s.values())
    assert main_param_bytes(optimizer) == 4 * numel


@pytest.mark.parametrize("extra,bytes_per_element", [(["--no-store-param-remainders"], 4),
                                                      (["--no-store-param-remainders", "--main-params-dtype", "bf16"], 0)],
                         ids=["fp32-main", "bf16-main"])
def test_main_weight_flags(extra: list[str], bytes_per_element: int) -> None:
    model, config, optimizer = build(BF16_ADAM + extra)
    assert config.store_param_remainders is False
    assert main_param_bytes(optimizer) == bytes_per_element * sum(p.numel() for p in model.parameters())


def test_muon_momentum_follows_exp_avg_dtype() -> None:
    _, config, optimizer = build(["--optimizer", "muon", "--lr", "0.01", "--bf16", "--use-precision-aware-optimizer",
                                  "--exp-avg-dtype", "bf16"])
    held = states(optimizer)
    assert held and all(t.dtype == torch.bfloat16 for s in held for t in s.values()), held


def test_main_grads_dtype_maps_to_the_config() -> None:
    args = parse(BF16_ADAM + ["--main-grads-dtype", "bf16"])
    assert optimizer_config_from_args(args).main_grads_dtype == torch.bfloat16


@pytest.mark.parametrize("argv,message", [
    (["--exp-avg-dtype", "fp8"], "argument --exp-avg-dtype: invalid choice: 'fp8'"),
    (["--exp-avg-sq-dtype", "float16"], "argument --exp-avg-sq-dtype: invalid choice: 'float16'"),
    (["--main-grads-dtype", "fp16"], "argument --main-grads-dtype: invalid choice: 'fp16'"),
    (["--main-params-dtype", "fp64"], "argument --main-params-dtype: invalid choice: 'fp64'"),
])
def test_bad_values_exit_with_one_line(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        add_optimizer_args(argparse.ArgumentParser(prog="p")).parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"p: error: {message}"), error


REMAINDERS_NEEDED = ("--main-params-dtype bf16 with --bf16 needs --no-store-param-remainders: by default the main "
                     "weights are exact fp32, each the bf16 parameter plus a 16-bit remainder. Allowed: "
                     "--main-params-dtype fp32, or bf16 with --no-store-param-remainders.")


@pytest.mark.parametrize("argv,message", [
    (["--exp-avg-dtype", "bf16"],
     "--exp-avg-dtype can only be fp32 without --use-precision-aware-optimizer (as in megatron-core); got bf16."),
    # The model's dtype first: fp16 is no main-weight dtype of a bf16 model, whatever the remainders.
    (["--bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"],
     "--main-params-dtype must be fp32 or the model's own 16-bit dtype, bf16 with --bf16; got fp16."),
    (["--use-precision-aware-optimizer", "--main-params-dtype", "bf16"],
     "--main-params-dtype must be fp32 for an fp32 model (16-bit main weights need --bf16 or --fp16); got bf16."),
    # The default keeps remainders: the flag to add is named.
    (["--bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "bf16"], REMAINDERS_NEEDED),
], ids=["without-precision-aware", "fp16-main-bf16-model", "fp32-model", "remainders"])
def test_precision_errors_name_flags_and_their_values(argv: list[str], message: str) -> None:
    """The messages of Megatron-LM's parser path (validate_args) and of the deferred one (the trainer's)."""
    for deferred in (False, True):
        with pytest.raises(ValueError) as caught:
            parse(["--optimizer", "adam", "--lr", "0.01", *argv], deferred)
        assert str(caught.value) == message
