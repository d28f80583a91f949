"""emerging_optimizers' torch.compile'd updates: said before the first step, timed after it, and
optionally run uncompiled (optimizers/compiled_step.py).

A toy optimizer whose module holds a `torch.compile(backend="eager")` function (dynamo traces it,
cheaply) shows the two lines of the first step and silence after it. Lion with
`emerging_optimizers_compile=False` compiles no graph at all and takes exactly the Lion step
written out here: p - lr * sign(beta1 * m + (1 - beta1) * g), with m starting at zero.

The rest of the suite runs these updates eagerly (tests/conftest.py sets TORCH_COMPILE_DISABLE=1);
here dynamo is on, and each optimizer whose module compiles an update steps compiled and eagerly
from the same values: the compiled kernels give the eager update to fp32 rounding.
"""

import argparse
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo.utils
import torch._inductor.config

from megatron_eopt import OptimizerConfig, get_megatron_optimizer, registry
from megatron_eopt.optimizers.compiled_step import compiled_functions, watch_first_step


@pytest.fixture(autouse=True)
def dynamo_on() -> Iterator[None]:
    """These tests are about compiling: dynamo on, whatever the suite's TORCH_COMPILE_DISABLE."""
    with torch._dynamo.config.patch(disable=False):
        yield


def _compiling_optimizers() -> list[str]:
    names = []
    for name in registry.list_optimizers():
        optimizer_cls = getattr(getattr(registry.lookup_optimizer(name), "entry", None), "optimizer_cls", None)
        if optimizer_cls is not None and compiled_functions(optimizer_cls):  # adam, sgd: torch's
            names.append(name)
    return names


@torch.compile(backend="eager")
def _toy_update(grad: torch.Tensor) -> torch.Tensor:
    return grad.sign()


class _Toy(torch.optim.Optimizer):
    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.5})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(_toy_update(p.grad), alpha=-group["lr"])


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_first_compiled_step_is_announced_and_timed_once(capsys) -> None:
    from megatron_eopt.optimizers import compiled_step

    compiled_step._ANNOUNCED.discard("toy")
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = watch_first_step("toy", _Toy([param]), OptimizerConfig())
    param.grad = torch.tensor([3.0, -4.0])
    optimizer.step()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("megatron_eopt: toy: the first step compiles emerging_optimizers' _toy_update with "
                               "torch.compile") and "--no-emerging-optimizers-compile" in lines[0], lines
    assert lines[1].startswith("megatron_eopt: toy: first step took ") and " s (torch.compile included)" in lines[1]
    optimizer.step()
    assert capsys.readouterr().err == ""
    assert param.tolist() == [0.0, -1.0]  # two steps of -0.5 * sign(grad)


def test_lion_runs_uncompiled_when_asked(capsys) -> None:
    from emerging_optimizers.scalar_optimizers.lion import Lion

    assert compiled_functions(Lion) == ["calculate_lion_update"]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    start = model.weight.detach().clone()
    config = OptimizerConfig(optimizer="lion", lr=0.1, weight_decay=0.0, clip_grad=0.0, lion_beta1=0.9,
                             emerging_optimizers_compile=False)
    optimizer = get_megatron_optimizer(config, [model])
    grad = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.25, -3.0]])
    model.weight.grad = grad.clone()
    graphs = _graphs()
    optimizer.step()
    assert _graphs() == graphs  # nothing compiled
    assert capsys.readouterr().err == ""
    torch.testing.assert_close(model.weight.detach(), start - 0.1 * torch.sign(0.1 * grad), rtol=0, atol=0)


def test_the_trainer_flag_sets_the_field() -> None:
    from arguments import add_optimizer_args, optimizer_config_from_args

    parser = add_optimizer_args(argparse.ArgumentParser())
    default = parser.parse_args(["--optimizer", "lion", "--lr", "1e-3"])
    off = parser.parse_args(["--optimizer", "lion", "--lr", "1e-3", "--no-emerging-optimizers-compile"])
    assert default.emerging_optimizers_compile is True and off.emerging_optimizers_compile is False
    assert optimizer_config_from_args(off).emerging_optimizers_compile is False


def _three_steps(name: str, compile: bool, steps: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 16, bias=False)
    config = OptimizerConfig(optimizer=name, lr=0.01, weight_decay=0.01, clip_grad=0.0,
                             emerging_optimizers_compile=compile)
    optimizer = get_megatron_optimizer(config, [model])
    for step in range(steps):
        model.weight.grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(step)  # PSGD-Pro draws its probe vectors
        optimizer.step()
    return model.weight.detach().clone()


def test_every_compiling_optimizer_is_found() -> None:
    assert _compiling_optimizers() == ["laprop", "lion", "psgd_pro", "rekls", "soap"]


# PSGD-Pro's compile takes 35-45 s on 2 cores with an empty cache: `make test-slow`.
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name == "psgd_pro" else [])
                                  for name in _compiling_optimizers()])
def test_the_compiled_update_equals_the_eager_one(name: str) -> None:
    """Three steps compiled (as users run them) and eagerly (as the rest of the suite does): the same
    update to fp32 rounding (inductor fuses and vectorizes the arithmetic, it changes no formula;
    its random draws are eager torch's: inductor's own generator would draw other probe vectors for
    PSGD-Pro's norm estimate, 3.5e-4 of the update apart)."""
    start = _three_steps(name, compile=False, steps=0)
    torch._dynamo.reset()  # SOAP and REKLS share a compiled function: each compiles it here
    graphs = _graphs()
    with torch._inductor.config.patch(fallback_random=True):
        compiled = _three_steps(name, compile=True) - start
    assert _graphs() > graphs, f"{name}: nothing was compiled"
    eager = _three_steps(name, compile=False) - start
    assert eager.norm() > 0, name
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)
