"""Stub optimizers and chains of children with megatron-core's optimizer interface.

megatron-core returns a stub (`is_stub_optimizer=True`) for a rank without trainable
parameters; its step changes nothing and, as megatron-core's stub FP32Optimizer works it out
(no gradients: norm 0.0, and success), returns (True, 0.0, None). Its ChainedOptimizer takes any
child with its optimizer interface; the chain's step is megatron-core's, worked out by hand
below for a stand-in child.
"""

import math

import pytest
import torch

from megatron_eopt import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer


class Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.fc.requires_grad_(False)


def test_empty_chain_is_a_stub() -> None:
    stub = ChainedOptimizer([])
    assert stub.is_stub_optimizer and stub.chained_optimizers == [] and stub.param_groups == []
    assert stub.step() == (True, 0.0, None)
    stub.zero_grad()
    assert stub.get_loss_scale().item() == 1.0
    stub.load_state_dict(stub.state_dict())
    stub.load_state_dict([])  # megatron-core's ChainedOptimizer([]).state_dict()


@pytest.mark.parametrize("layer_wise", [False, True], ids=["chain", "layer_wise"])
def test_frozen_model_gives_a_stub_whose_step_changes_nothing(layer_wise: bool) -> None:
    model = Frozen()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = OptimizerConfig(optimizer="adam", lr=0.1, log_num_zeros_in_grad=True,
                             use_layer_wise_distributed_optimizer=layer_wise)
    optimizer = get_megatron_optimizer(config, model)
    assert optimizer.is_stub_optimizer and optimizer.config is config
    assert optimizer.step() == (True, 0.0, 0)
    optimizer.zero_grad()
    optimizer.load_state_dict(optimizer.state_dict())
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])


class StandIn:
    """A child with megatron-core's optimizer interface (as in Megatron-LM's own tests)."""

    def __init__(self, params: list[torch.nn.Parameter], config: OptimizerConfig, norm: float) -> None:
        self.config, self.params, self.norm = config, params, norm
        self.param_groups = [{"params": params}]
        self.is_stub_optimizer = False
        self.stepped = False

    def prepare_grads(self) -> bool:
        return False

    def get_grad_norm(self) -> float:
        return self.norm

    def get_parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def get_grads_for_grad_norm(self, grad_norm_group=None) -> list[torch.Tensor]:
        return [p.grad for p in self.params if getattr(p, "grad_norm_group", None) == grad_norm_group]

    def step_with_ready_grads(self) -> bool:
        self.stepped = True
        return True


def test_chain_of_megatron_core_children_reports_a_skipped_step() -> None:
    config = OptimizerConfig(clip_grad=0.0, grad_norm_skip_threshold=1.0)
    param = torch.nn.Parameter(torch.ones(2, 2))
    param.grad = torch.ones(2, 2)
    child = StandIn([param], config, norm=2.0)
    assert ChainedOptimizer([child]).step() == (False, 2.0, None)
    assert not child.stepped and torch.equal(param.grad, torch.ones(2, 2))


def test_chain_of_megatron_core_children_clips_the_mtp_group_apart() -> None:
    """Main norm 0.5 (the child's), MTP norm 20 (four gradients of 10): the MTP gradients are
    scaled by 1 / (20 + 1e-6), the main ones are not, and the step is not skipped."""
    config = OptimizerConfig(clip_grad=1.0, grad_norm_skip_threshold=1.0)
    main, mtp = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2, 2))
    mtp.grad_norm_group = "mtp"
    main.grad, mtp.grad = torch.full((2, 2), 0.25), torch.full((2, 2), 10.0)
    chain = ChainedOptimizer([StandIn([main, mtp], config, norm=0.5)])
    assert chain.step() == (True, 0.5, None)
    assert chain.grad_norms_by_group == pytest.approx({"mtp": 20.0})
    torch.testing.assert_close(mtp.grad, torch.full((2, 2), 10.0 / (20.0 + 1e-6)))
    assert torch.equal(main.grad, torch.full((2, 2), 0.25))


def test_chain_takes_torch_optimizers() -> None:
    """As megatron-core's ChainedOptimizer: param_groups and state are the children's own."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    adam, sgd = torch.optim.Adam(params[:2], lr=0.01), torch.optim.SGD(params[2:], lr=0.1, momentum=0.9)
    chain = ChainedOptimizer([adam, sgd])
    chain.param_groups[0]["lr"] = 0.02
    assert adam.param_groups[0]["lr"] == 0.02 and not chain.is_stub_optimizer
    assert chain.get_parameters() == params


def test_chain_refuses_mixed_and_interface_less_children() -> None:
    ours = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1), torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="either all megatron_eopt's .* or all others"):
        ChainedOptimizer([ours.chained_optimizers[0], torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)])
    with pytest.raises(TypeError, match="children need param_groups .*got object"):
        ChainedOptimizer([object()])


def test_worked_example_norm_of_two_children() -> None:
    """Two children: the norm is the root of their squares (3, 4 -> 5), as megatron-core's."""
    config = OptimizerConfig(clip_grad=0.0)
    params = [torch.nn.Parameter(torch.ones(1)) for _ in range(2)]
    children = [StandIn([params[0]], config, 3.0), StandIn([params[1]], config, 4.0)]
    assert ChainedOptimizer(children).step() == (True, math.hypot(3.0, 4.0), None)
    assert all(child.stepped for child in children)
