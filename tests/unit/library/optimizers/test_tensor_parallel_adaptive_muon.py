"""TensorParallelAdaptiveMuon against emerging_optimizers' AdaptiveMuon (CPU, gloo, fp32).

The reference is AdaptiveMuon itself on the unsharded weights, with its `orthogonalize` hook
splitting fused weights into their blocks (the extension OrthogonalizedOptimizer documents);
`split_blocks` is checked against explicit row indexing in test_tensor_parallel_muon.py.
Without TP the update must equal AdaptiveMuon's to 1e-6 (same operations, sums in another
order); with 'duplicated', 'distributed' and 'sharded' each rank's shard must equal the
reference's to 1e-5 (Gram matrices and statistics are summed in another order), moment2
buffers included.
"""

import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

from megatron_eopt.ops.splits import MatrixLayout, merge_blocks, split_blocks
from megatron_eopt.optimizers.muon.tensor_parallel_adaptive_muon import MOMENT2_METHODS, TensorParallelAdaptiveMuon
from tests.unit.library.optimizers.test_tensor_parallel_muon import MATRICES, gradient, initial, layout_for, local_shard

# normuon averages over columns when rows >= cols, else over rows. Of test_tensor_parallel_muon's
# matrices, none averages along its sharded dimension; these two do, so partial sums all-reduce.
EXTRA_MATRICES = {
    "wide_column": ((12, 16), "plain", 0),  # mean over rows, rows sharded
    "tall_row": ((16, 12), "plain", 1),  # mean over columns, columns sharded
}
# adamuon divides each entry of O by its own running RMS, so O's round-off (~5e-7 where
# 'distributed' iterates on the transpose) grows up to ~100x in entries with |O| ~ 1e-3; the
# weight error is lr * scale times that. lr = 0.01 keeps it (~4e-6 at TP=4) under 1e-5.
LR, MOMENTUM, WD, STEPS = 0.01, 0.9, 0.1, 3
OPTIONS = dict(lr=LR, momentum=MOMENTUM, weight_decay=WD, nesterov=True, fp32_matmul_prec="highest")


class SplitAdaptiveMuon(AdaptiveMuon):
    """AdaptiveMuon with each block of a fused weight orthogonalized on its own."""

    def __init__(self, params: list[torch.nn.Parameter], layouts: list[MatrixLayout], **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.layouts = {id(p): layout for p, layout in zip(params, layouts)}

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs) -> torch.Tensor:
        layout = self.layouts[id(p)]
        return merge_blocks([newton_schulz(block, steps=5) for block in split_blocks(grad, layout)], layout)


def run(optimizer_params: dict[str, torch.nn.Parameter], optimizer, grad_of) -> None:
    for step in range(STEPS):
        for name, param in optimizer_params.items():
            param.grad = grad_of(name, step)
        optimizer.step()


def reference_run(method: str, rank: int = 0, size: int = 1, per_head: bool = False) -> tuple[dict, dict]:
    """AdaptiveMuon on whole matrices (size 1) or, for blockwise, on this rank's shards."""
    params = {n: torch.nn.Parameter(local_shard(n, initial(n), rank, size)) for n in MATRICES}
    layouts = [layout_for(n, p, size, per_head=per_head) for n, p in params.items()]
    optimizer = SplitAdaptiveMuon(list(params.values()), layouts, moment2_method=method, **OPTIONS)
    run(params, optimizer, lambda n, step: local_shard(n, gradient(n, step), rank, size))
    return params, {n: optimizer.state[p]["moment2_buffer"] for n, p in params.items()}


def expected_moment2(name: str, reference: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    dim = MATRICES[name][2]
    if reference.dim() < 2 or dim < 0 or reference.shape[dim] == 1:
        return reference  # namo's scalar, a replicated matrix, or averaged along the sharded dim
    return local_shard(name, reference, rank, size)


def _tp_errors(rank: int, size: int, method: str, tp_mode: str,
               per_head: bool = False) -> dict[str, tuple[float, float]]:
    """Max |param error| and max |moment2 error| / max |moment2| (namo's holds ||g||^2 ~ 30,
    where one fp32 ulp is 4e-6) of this rank's shards after STEPS steps."""
    params = {n: torch.nn.Parameter(local_shard(n, initial(n), rank, size)) for n in MATRICES}
    layouts = {n: layout_for(n, p, size, per_head=per_head) for n, p in params.items()}
    optimizer = TensorParallelAdaptiveMuon(
        [{"params": list(params.values()), "param_fqns": list(params)}], moment2_method=method,
        tp_mode=tp_mode, tp_group=dist.group.WORLD, layouts=layouts, **OPTIONS,
    )
    run(params, optimizer, lambda n, step: local_shard(n, gradient(n, step), rank, size))
    if tp_mode == "blockwise":
        reference, moment2 = reference_run(method, rank, size, per_head)
        expected = {n: (reference[n], moment2[n]) for n in MATRICES}
    else:
        reference, moment2 = reference_run(method, per_head=per_head)
        expected = {n: (local_shard(n, reference[n], rank, size), expected_moment2(n, moment2[n], rank, size))
                    for n in MATRICES}
    return {
        n: ((p.detach() - expected[n][0]).abs().max().item(),
            ((optimizer.state[p]["moment2_buffer"] - expected[n][1]).abs().max() / expected[n][1].abs().max()).item())
        for n, p in params.items()
    }


COLLECTIVES = ("all_reduce", "all_gather", "all_to_all_single", "broadcast", "reduce_scatter")
# all_reduce calls per step of the statistics: normuon's partial sums and its norms; namo's norms.
STAT_ALL_REDUCES = {"adamuon": 0, "normuon": 2, "namo": 1}


def _tp_body(rank: int, size: int) -> dict[tuple[str, str], tuple[dict, dict[str, int]]]:
    """(errors, collective call counts) of every moment2 method in every TP mode."""
    results = {}
    with mock.patch.dict(MATRICES, EXTRA_MATRICES):
        for method in MOMENT2_METHODS:
            for tp_mode in ("duplicated", "distributed", "sharded", "blockwise"):
                calls = {c: mock.Mock(wraps=getattr(dist, c)) for c in COLLECTIVES}
                with mock.patch.multiple(dist, **calls):
                    errors = _tp_errors(rank, size, method, tp_mode)
                results[(method, tp_mode)] = (errors, {c: m.call_count for c, m in calls.items()})
    return results


def _per_head_body(rank: int, size: int) -> dict[str, dict[str, tuple[float, float]]]:
    return {tp_mode: _tp_errors(rank, size, "normuon", tp_mode, per_head=True)
            for tp_mode in ("duplicated", "distributed", "sharded")}


def test_per_head_tp_modes_equal_single_process_adaptive_muon(run_distributed) -> None:
    """Per head (each q, k and v head of qkv its own matrix; normuon's statistics and the scale
    stay those of the whole parameter), TP=2 in every exact mode equals TP=1 AdaptiveMuon."""
    for rank_results in run_distributed(_per_head_body, world_size=2):
        bad = {mode: {n: e for n, e in errors.items() if max(e) > 1e-5} for mode, errors in rank_results.items()}
        assert not any(bad.values()), bad


@pytest.mark.parametrize("size", [2, 4])
def test_tp_modes_equal_single_process_adaptive_muon(run_distributed, size: int) -> None:
    """duplicated/distributed/sharded equal TP=1 AdaptiveMuon; blockwise equals it per shard."""
    assert set(MOMENT2_METHODS) >= {"adamuon", "normuon"}
    for rank_results in run_distributed(_tp_body, world_size=size):
        bad = {key: {n: e for n, e in errors.items() if max(e) > 1e-5} for key, (errors, _) in rank_results.items()}
        assert not any(bad.values()), (size, {k: v for k, v in bad.items() if v})
        for (method, tp_mode), (_, calls) in rank_results.items():
            if tp_mode == "blockwise":
                assert not any(calls.values()), (method, calls)
            if tp_mode in ("duplicated", "sharded"):
                assert calls["all_reduce"] == STAT_ALL_REDUCES[method] * STEPS, (method, tp_mode, calls)
            if tp_mode == "sharded":  # all parameters in one exchange: two all-to-alls per step
                assert calls["all_to_all_single"] == 2 * STEPS and not calls["all_gather"], (method, calls)


@pytest.mark.parametrize("method", MOMENT2_METHODS)
def test_without_tp_equals_adaptive_muon(method: str) -> None:
    """A tall and a wide matrix (normuon averages over columns, then rows), 3 steps."""
    shapes = {"tall": (20, 12), "wide": (12, 20)}
    seeds = {"tall": 1, "wide": 2}
    ours = {n: torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(seeds[n])))
            for n, s in shapes.items()}
    theirs = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    options = dict(OPTIONS, moment2_method=method, beta2=0.9)
    optimizers = [TensorParallelAdaptiveMuon(list(ours.values()), **options),
                  AdaptiveMuon(list(theirs.values()), **options)]
    for step in range(STEPS):
        for name in shapes:
            grad = torch.randn(shapes[name], generator=torch.Generator().manual_seed(10 * step + seeds[name]))
            ours[name].grad, theirs[name].grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    for name in shapes:
        torch.testing.assert_close(ours[name].detach(), theirs[name].detach(), rtol=0, atol=1e-6)
        state = [optimizer.state[p]["moment2_buffer"] for optimizer, p in zip(optimizers, (ours[name], theirs[name]))]
        torch.testing.assert_close(state[0], state[1], rtol=1e-6, atol=1e-6)  # namo's ||g||^2 ~ 70


def test_update_rms_has_muon_scale_once() -> None:
    """adamuon, first step, no momentum: update = scale * O / (sqrt((1 - beta2) O^2) + eps)."""
    m, n, beta2, eps, extra = 48, 16, 0.95, 1e-8, 0.2
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    param = torch.nn.Parameter(torch.zeros(m, n))
    optimizer = TensorParallelAdaptiveMuon([param], lr=1.0, momentum=0.0, weight_decay=0.0, beta2=beta2, eps=eps,
                                           extra_scale_factor=extra, fp32_matmul_prec="highest")
    param.grad = grad
    optimizer.step()
    orthogonal = newton_schulz(grad, steps=5)
    normalized = orthogonal / ((1 - beta2) * orthogonal.square()).sqrt().add(eps)
    expected_rms = extra * math.sqrt(max(m, n)) * normalized.square().mean().sqrt().item()
    assert param.detach().square().mean().sqrt().item() == pytest.approx(expected_rms, rel=1e-5)


def test_blockwise_scales_by_local_shape() -> None:
    """A (48, 16) column-parallel shard of a (96, 16) matrix at TP=2, seen as blockwise."""
    grad = torch.randn(48, 16, generator=torch.Generator().manual_seed(5))
    param = torch.nn.Parameter(torch.zeros(48, 16))
    layout = MatrixLayout("w", (48, 16), 0, 2)
    optimizer = TensorParallelAdaptiveMuon([{"params": [param], "param_fqns": ["w"]}], lr=1.0, momentum=0.0,
                                           weight_decay=0.0, fp32_matmul_prec="highest", tp_mode="blockwise",
                                           layouts={"w": layout})
    param.grad = grad
    optimizer.step()
    orthogonal = newton_schulz(grad, steps=5)
    expected = math.sqrt(48) * orthogonal / ((1 - 0.95) * orthogonal.square()).sqrt().add(1e-8)
    torch.testing.assert_close(-param.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp_mode="dist"), "tp_mode must be one of 'blockwise', 'duplicated', 'distributed', 'sharded', 'auto'; got 'dist'"),
    (dict(moment2_method="adam"), "moment2_method must be one of 'adamuon', 'normuon'.*; got 'adam'"),
    (dict(beta2=1.0), r"beta2 must be in \[0, 1\); got 1.0"),
    (dict(eps=0.0), "eps must be > 0"),
    (dict(weight_decay_method="adamw"), "weight_decay_method must be one of 'decoupled'.*; got 'adamw'"),
    (dict(coefficient_type="fast"), r"coefficient_type must be one of .*'quintic'.*got 'fast'"),
    (dict(num_ns_steps=0), "num_ns_steps must be >= 1"),
    (dict(layouts={"w": MatrixLayout("w", (4, 4), 0, 2)}),
     "'w': its layout is sharded over tp_size=2 but tp_group has 1 rank"),
    (dict(layouts={"w": MatrixLayout("w", (4, 2))}),
     r"'w': layout shape \(4, 2\) differs from the parameter's \(4, 4\)"),
])
def test_bad_arguments(kwargs: dict, message: str) -> None:
    params = [{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "param_fqns": ["w"]}]
    with pytest.raises(ValueError, match=message):
        TensorParallelAdaptiveMuon(params, **kwargs)


def test_one_dimensional_parameter_raises() -> None:
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' has shape \(4,\); Muon updates 2-D"):
        TensorParallelAdaptiveMuon([{"params": [torch.nn.Parameter(torch.zeros(4))], "param_fqns": ["norm.weight"]}])
