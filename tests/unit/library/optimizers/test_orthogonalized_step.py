"""Muon's step (optimizers/muon/step.py) against the installed emerging_optimizers, and its depth.

1. The parts copied from emerging_optimizers' OrthogonalizedOptimizer.step (`momentum_updates`,
   `apply_weight_updates`) step bitwise as the installed version does: an emerging_optimizers
   optimizer with `OrthogonalizeTogether` mixed in, given the optimizer's own per-parameter
   `orthogonalize` as its orthogonalize-all function, against the same optimizer unchanged.
   MuonHyperball overrides both weight-update hooks; Muon's weight decay methods and Nesterov
   are varied; one parameter has no gradient.
2. At most 6 calls lead from TensorParallelMuon's `step()` to emerging_optimizers' Newton-Schulz,
   at TP=1 and in every TP mode at TP=2.
"""

import sys

import pytest
import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers import muon_utils
from emerging_optimizers.orthogonalized_optimizers.muon import Muon
from emerging_optimizers.orthogonalized_optimizers.muon_hyperball import MuonHyperball

from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.step import OrthogonalizeTogether
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

MAX_CALLS_TO_NEWTON_SCHULZ = 6


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((8, 6), (5, 9), (4, 4))]


def _run(optimizer_cls: type, steps: int, **kwargs) -> list[torch.Tensor]:
    params = _params(0)
    optimizer = optimizer_cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.02, "momentum": 0.8}],
                              lr=0.05, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", **kwargs)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for index, p in enumerate(params):
            # The last parameter has no gradient in the first step: the step skips it.
            p.grad = None if (index == 2 and step == 0) else torch.randn(p.shape, generator=generator)
        optimizer.step()
    return [p.detach().clone() for p in params]


def _together(optimizer_cls: type) -> type:
    """`optimizer_cls` with our step, orthogonalizing with its own per-parameter `orthogonalize`."""

    class Together(OrthogonalizeTogether, optimizer_cls):
        def orthogonalize_all_fn(self, params, updates):
            return [optimizer_cls.orthogonalize(self, p, u) for p, u in zip(params, updates)]

    return Together


@pytest.mark.parametrize("optimizer_cls, kwargs", [
    (Muon, {"nesterov": True, "weight_decay_method": "decoupled"}),
    (Muon, {"nesterov": False, "weight_decay_method": "independent"}),
    (Muon, {"nesterov": True, "weight_decay_method": "l2"}),
    (MuonHyperball, {"nesterov": True}),
], ids=["muon-nesterov-decoupled", "muon-independent", "muon-l2", "hyperball"])
def test_copied_step_matches_installed_emerging_optimizers(optimizer_cls, kwargs) -> None:
    theirs = _run(optimizer_cls, steps=3, **kwargs)
    ours = _run(_together(optimizer_cls), steps=3, **kwargs)
    initial = _params(0)
    for mine, reference, start in zip(ours, theirs, initial):
        assert not torch.equal(reference, start)  # the step moved every parameter
        assert torch.equal(mine, reference)


def _calls_from_step(frame) -> int:
    """Calls from OrthogonalizeTogether.step down to `frame` (a Newton-Schulz call)."""
    step_code = OrthogonalizeTogether.step.__wrapped__.__code__
    calls = 0
    while frame is not None and frame.f_code is not step_code:
        frame, calls = frame.f_back, calls + 1
    if frame is None:
        raise RuntimeError("Newton-Schulz was called outside OrthogonalizeTogether.step")
    return calls


def _depths_of_one_step(optimizer: TensorParallelMuon, params: list[torch.nn.Parameter]) -> list[int]:
    depths = []
    original = muon_utils.newton_schulz

    def recording(*args, **kwargs):
        depths.append(_calls_from_step(sys._getframe()))
        return original(*args, **kwargs)

    for p in params:
        p.grad = torch.ones_like(p)
    muon_utils.newton_schulz = recording
    try:
        optimizer.step()
    finally:
        muon_utils.newton_schulz = original
    return depths


def test_step_reaches_newton_schulz_within_six_calls_at_tp1() -> None:
    params = _params(0)
    depths = _depths_of_one_step(TensorParallelMuon(params, lr=0.1), params)
    assert len(depths) == 3 and max(depths) <= MAX_CALLS_TO_NEWTON_SCHULZ, depths


TP_MODES = ("blockwise", "duplicated", "distributed", "sharded")


def _tp_depths_body(rank: int, size: int) -> dict[str, list[int]]:
    """One column-parallel (8, 6) shard per TP mode, each matrix in its own mode; one step per
    mode with only that matrix's gradient, so each depth is known by mode."""
    params = [torch.nn.Parameter(torch.randn(8 // size, 6)) for _ in TP_MODES]
    layouts = {mode: MatrixLayout(name=mode, local_shape=(8 // size, 6), partition_dim=0, tp_size=size)
               for mode in TP_MODES}
    optimizer = TensorParallelMuon([{"params": params, "param_fqns": list(TP_MODES)}], lr=0.1,
                                   tp_group=dist.group.WORLD, layouts=layouts)
    optimizer.tp_modes = {mode: mode for mode in TP_MODES}
    depths = {}
    for mode, param in zip(TP_MODES, params):
        depths[mode] = _depths_of_one_step(optimizer, [param])
        param.grad = None
    return depths


def test_step_reaches_newton_schulz_within_six_calls_in_every_tp_mode(run_distributed) -> None:
    results = run_distributed(_tp_depths_body, world_size=2)
    for depths in results:
        assert set(depths) == set(TP_MODES)
        for mode in ("blockwise", "duplicated", "distributed"):  # Newton-Schulz on every rank
            assert depths[mode] and max(depths[mode]) <= MAX_CALLS_TO_NEWTON_SCHULZ, (mode, depths[mode])
    sharded = [depth for depths in results for depth in depths["sharded"]]  # on the matrix's owner only
    assert len(sharded) == 1 and sharded[0] <= MAX_CALLS_TO_NEWTON_SCHULZ, sharded
