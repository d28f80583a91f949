"""Separate gradient-norm groups (megatron-core 0.19.2's `grad_norm_group='mtp'`, set by
`mtp_detach_heads` on the multi-token-prediction heads).

The expected values are worked out here in float64 from megatron-core's rule: the main norm and
the skip threshold leave the group's gradients out, and each part is clipped by its own norm
(coefficient clip / (norm + 1e-6) when below 1). The MTP gradients are 100x the others, so
counting them anywhere shows. megatron-core's own optimizers need CUDA, so they are not run;
its parameter filter is (`test_filter_grads_for_norm_is_megatron_cores`).
"""

import math

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

CLIP = 1.0


class MtpNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = torch.nn.Linear(6, 5)
        self.mtp = torch.nn.Linear(5, 4)
        for param in self.mtp.parameters():
            param.grad_norm_group = "mtp"


def _model_and_grads(seed: int = 0) -> tuple[MtpNet, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = MtpNet()
    generator = torch.Generator().manual_seed(seed + 1)
    grads = {name: torch.randn(p.shape, generator=generator) * (100.0 if name.startswith("mtp.") else 1.0)
             for name, p in model.named_parameters()}
    return model, grads


def _norm64(grads: dict[str, torch.Tensor], mtp: bool) -> float:
    return math.sqrt(sum(g.double().square().sum().item() for n, g in grads.items() if n.startswith("mtp.") == mtp))


def _clipped64(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    coeff = {mtp: min(1.0, CLIP / (_norm64(grads, mtp) + 1e-6)) for mtp in (False, True)}
    return {n: g.double() * coeff[n.startswith("mtp.")] for n, g in grads.items()}


@pytest.mark.parametrize("layer_wise", [False, True], ids=["chain", "layer_wise"])
def test_mtp_group_is_left_out_of_the_norm_and_clipped_by_its_own(layer_wise: bool) -> None:
    model, grads = _model_and_grads()
    initial = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    main_norm, mtp_norm = _norm64(grads, False), _norm64(grads, True)
    assert CLIP < main_norm < 10.0 < mtp_norm  # both clipped; a threshold of 10 passes the main norm
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=CLIP,
                             grad_norm_skip_threshold=10.0, use_layer_wise_distributed_optimizer=layer_wise)
    optimizer = get_megatron_optimizer(config, model, config_overrides={})
    for name, param in model.named_parameters():
        param.grad = grads[name].clone()
    successful, grad_norm, _ = optimizer.step()
    assert successful
    assert grad_norm == pytest.approx(main_norm, rel=1e-6)
    assert dict(optimizer.grad_norms_by_group) == pytest.approx({"mtp": mtp_norm}, rel=1e-6)
    clipped = _clipped64(grads)
    for name, param in model.named_parameters():  # SGD, lr 1: the update is the clipped gradient
        torch.testing.assert_close(param.detach().double(), initial[name] - clipped[name], rtol=0, atol=1e-6)


def test_skip_threshold_reads_the_main_norm_only() -> None:
    model, grads = _model_and_grads()
    main_norm = _norm64(grads, False)
    config = OptimizerConfig(optimizer="adam", lr=0.1, clip_grad=0.0, grad_norm_skip_threshold=main_norm * 0.99)
    optimizer = get_megatron_optimizer(config, model)
    for name, param in model.named_parameters():
        param.grad = grads[name].clone()
    assert optimizer.step()[0] is False  # just above: skipped
    optimizer.config.grad_norm_skip_threshold = main_norm * 1.01  # far below the MTP norm
    assert optimizer.step()[0] is True


def test_get_grads_for_grad_norm_splits_by_group() -> None:
    model, grads = _model_and_grads()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1), model)
    for name, param in model.named_parameters():
        param.grad = grads[name].clone()
    main = optimizer.get_grads_for_grad_norm()
    mtp = optimizer.get_grads_for_grad_norm("mtp")
    assert sorted(g.numel() for g in main) == sorted(p.numel() for p in model.decoder.parameters())
    assert sorted(g.numel() for g in mtp) == sorted(p.numel() for p in model.mtp.parameters())
    with pytest.raises(ValueError, match="Unknown grad_norm_group 'aux'; the registered ones are 'mtp'"):
        optimizer.get_grads_for_grad_norm("aux")


def test_unregistered_group_raises() -> None:
    model = MtpNet()
    model.mtp.weight.grad_norm_group = "aux"
    with pytest.raises(ValueError, match="parameter 'mtp.weight': Unknown grad_norm_group 'aux'"):
        get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1), model)


def test_filter_grads_for_norm_is_megatron_cores() -> None:
    """megatron-core's `_filter_grads_for_norm(params, param_filter)` on a class that borrows it
    (as Megatron-LM's tests do) against ours: the same gradients, tied copies left out."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer as McoreOptimizer
    from megatron.core.optimizer.optimizer import OptimizerConfig as McoreConfig

    from megatron_eopt.wrappers.base import MegatronOptimizer

    params = [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(4)]
    for index, param in enumerate(params):
        param.grad = torch.randn(3, 3)
        param.tensor_model_parallel = True  # megatron-core asks parallel_state otherwise
    params[1].shared = True
    params[2].grad_norm_group = "mtp"

    class Mcore:
        _filter_grads_for_norm = McoreOptimizer._filter_grads_for_norm
        config = McoreConfig(optimizer="adam", lr=0.1)

    class Ours:
        _filter_grads_for_norm = MegatronOptimizer._filter_grads_for_norm

    is_main = lambda p: getattr(p, "grad_norm_group", None) is None  # noqa: E731
    for param_filter in (None, is_main):
        expected = Mcore()._filter_grads_for_norm(params, param_filter=param_filter)
        got = Ours()._filter_grads_for_norm(params, param_filter=param_filter)
        assert [id(g) for g in got] == [id(g) for g in expected]


def _bare(library: str, params: list[torch.nn.Parameter]):
    """An object with only `config`, `params` and `get_parameters()`, borrowing the library's
    `_filter_grads_for_norm` and `get_grads_for_grad_norm`, as Megatron-LM's own tests
    (`test_mtp_grad_separation*`, `test_unregistered_grad_norm_group_raises`) build it."""
    import types

    from megatron.core.optimizer.optimizer import MegatronOptimizer as McoreOptimizer
    from megatron.core.optimizer.optimizer import OptimizerConfig as McoreConfig

    from megatron_eopt.wrappers.base import MegatronOptimizer

    cls = McoreOptimizer if library == "core" else MegatronOptimizer
    bare = types.SimpleNamespace(config=McoreConfig(optimizer="adam", lr=0.1), params=params)
    bare.get_parameters = lambda: bare.params
    bare._filter_grads_for_norm = types.MethodType(cls._filter_grads_for_norm, bare)
    bare.get_grads_for_grad_norm = types.MethodType(cls.get_grads_for_grad_norm, bare)
    return bare


def _tagged_params(groups: list) -> list[torch.nn.Parameter]:
    params = []
    for group in groups:
        param = torch.nn.Parameter(torch.randn(2, 3))
        param.grad = torch.randn(2, 3)
        param.tensor_model_parallel = True  # megatron-core asks parallel_state otherwise
        if group is not None:
            param.grad_norm_group = group
        params.append(param)
    return params


@pytest.mark.parametrize("groups", [[None, "mtp", None, "mtp"], [None, None]], ids=["mtp", "no_mtp_params"])
def test_grad_norm_helpers_on_a_bare_object_equal_megatron_cores(groups: list) -> None:
    """Each gradient in the main norm or the 'mtp' group exactly as megatron-core's methods pick them."""
    params = _tagged_params(groups)
    for group in (None, "mtp"):
        expected = _bare("core", params).get_grads_for_grad_norm(group)
        got = _bare("ours", params).get_grads_for_grad_norm(group)
        assert [id(g) for g in got] == [id(g) for g in expected], group
        assert [id(g) for g in got] == [id(p.grad) for p, tag in zip(params, groups) if tag == group], group


def test_unregistered_group_on_a_bare_object_raises_as_megatron_core() -> None:
    params = _tagged_params([None, "aux"])
    for library in ("core", "ours"):
        with pytest.raises(ValueError, match="Unknown grad_norm_group 'aux'"):
            _bare(library, params).get_grads_for_grad_norm()
