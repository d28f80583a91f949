"""The gram-newton-schulz package's torch path over tensor-parallel shards (CPU, gloo, 2 ranks, 'medium').

The matrices of test_gram_newton_schulz_distributed.py (a column-, a row-sharded and a replicated
one, all on the Gram path), 3 steps:
- 'duplicated': every rank runs the package on the gathered matrices, so the result equals the
  TP=1 package run to 1e-6 (measured 0: the same float16 products on the same matrices).
- 'distributed': the sharded blocks iterate on Gram matrices all-reduced over the ranks, which
  the package cannot do: they report 'gram' and never reach it (its calls are recorded on this
  optimizer's settings); the replicated block goes through it.
- The layer-wise owner (DP=2) and FSDP2 (2 ranks) on the GPT of test_layer_wise_gpt.py /
  test_fsdp2.py at 'medium': within 2e-3 of the single-process package run (layer-wise: relative
  Frobenius, measured 3.2e-4, against 6.7e-2 from our bf16 Gram run; FSDP2: max abs, measured
  5.4e-4). Not 0: the reduced gradients differ by round-off, which half precision amplifies.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_eopt.ops.gram_newton_schulz_package import PACKAGE_PATH, GramPackage
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.tensor_parallel_muon import TensorParallelMuon
from tests.unit.library.distributed.test_gram_newton_schulz_distributed import MATRICES, fsdp2_errors, shard


class RecordingPackage(GramPackage):
    """The package, recording the shape of every call (held by one optimizer's settings)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return super().__call__(x)


def run_muon(rank: int, size: int, tp_mode: str, tp_group) -> dict:
    params = {n: torch.nn.Parameter(shard(torch.randn(s, generator=torch.Generator().manual_seed(len(n))), d, rank, size))
              for n, (s, d) in MATRICES.items()}
    layouts = {n: MatrixLayout(n, tuple(p.shape), MATRICES[n][1], size) for n, p in params.items()}
    optimizer = TensorParallelMuon([{"params": list(params.values()), "param_fqns": list(params)}], lr=0.05,
                                   momentum=0.9, fp32_matmul_prec="medium", gram_newton_schulz=True,
                                   gram_newton_schulz_package=True, tp_mode=tp_mode, tp_group=tp_group, layouts=layouts)
    package = RecordingPackage("quintic", 5)
    optimizer.settings = dataclasses.replace(optimizer.settings, package=package)
    for step in range(3):
        for n, p in params.items():
            p.grad = shard(torch.randn(MATRICES[n][0], generator=torch.Generator().manual_seed(step)), MATRICES[n][1],
                           rank, size)
        optimizer.step()
    return {"params": {n: p.detach() for n, p in params.items()}, "paths": optimizer.newton_schulz_paths,
            "calls": sorted(set(package.calls))}


def _body(rank: int, size: int, tp_mode: str) -> dict:
    got = run_muon(rank, size, tp_mode, dist.group.WORLD)
    reference = run_muon(0, 1, tp_mode, None)
    errors = {n: (p - shard(reference["params"][n], MATRICES[n][1], rank, size)).abs().max().item()
              for n, p in got["params"].items()}
    return {"errors": errors, "paths": got["paths"], "calls": got["calls"]}


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed"])
def test_tp2_with_package(run_distributed, tp_mode: str) -> None:
    for result in run_distributed(_body, world_size=2, args=(tp_mode,)):
        if tp_mode == "duplicated":
            assert set(result["paths"].values()) == {(PACKAGE_PATH,)}
            assert result["calls"] == [(1, 8, 40), (1, 16, 96), (1, 96, 16)]  # each matrix whole
            assert max(result["errors"].values()) <= 1e-6, result["errors"]
        else:
            assert result["paths"] == {"column": ("gram",), "row": ("gram",), "replicated": (PACKAGE_PATH,)}
            assert result["calls"] == [(1, 8, 40)]


PACKAGE_FIELDS = dict(muon_fp32_matmul_prec="medium", muon_gram_newton_schulz=True, muon_gram_newton_schulz_package=True)


def _layer_wise_body(rank: int, world_size: int) -> dict:
    from tests.unit.library.distributed import test_layer_wise_gpt as layer_wise

    muon = layer_wise.MUON  # the workers outlive this test: put the module's config back
    try:
        layer_wise.MUON = {**muon, **PACKAGE_FIELDS, "muon_gram_newton_schulz_package": False}
        ours = layer_wise.train_reference(world_size)
        layer_wise.MUON = {**muon, **PACKAGE_FIELDS}
        reference = layer_wise.train_reference(world_size)
        got = layer_wise.train_layer_wise(1, None, reduce_grads=True)
    finally:
        layer_wise.MUON = muon

    def relative(run: dict) -> dict:
        return {n: ((run["params"][n][0] - p[0]).norm() / run["params"][n][0].norm()).item()
                for n, p in got["params"].items()}
    return {"package": relative(reference), "ours": relative(ours)}


def test_layer_wise_owner_runs_the_package(run_distributed) -> None:
    for errors in run_distributed(_layer_wise_body, world_size=2, timeout=600):
        assert max(errors["package"].values()) <= 2e-3, errors["package"]
        assert max(errors["package"].values()) < max(errors["ours"].values()), errors  # not our bf16 path


def test_fsdp2_owner_runs_the_package(run_distributed) -> None:
    for errors in run_distributed(fsdp2_errors, world_size=2, args=(PACKAGE_FIELDS,), timeout=600):
        assert max(errors.values()) <= 2e-3, errors
