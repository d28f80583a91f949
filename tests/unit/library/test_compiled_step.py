"""emerging_optimizers' torch.compile'd updates: said before the first step, timed after it, and
optionally run uncompiled (optimizers/compiled_step.py).

A toy optimizer whose module holds a `torch.compile(backend="eager")` function (dynamo traces it,
cheaply) shows the two lines of the first step and silence after it. Lion with
`emerging_optimizers_compile=False` compiles no graph at all and takes exactly the Lion step
written out here: p - lr * sign(beta1 * m + (1 - beta1) * g), with m starting at zero.
"""

import argparse

import torch
import torch._dynamo.utils

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.optimizers.compiled_step import compiled_functions, watch_first_step


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
