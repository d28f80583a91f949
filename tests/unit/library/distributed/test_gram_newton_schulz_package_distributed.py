"""The gram-newton-schulz package's torch path over tensor-parallel shards (CPU, gloo, 2 ranks, 'medium').

The matrices of test_gram_newton_schulz_distributed.py (a column-, a row-sharded and a replicated
one, all on the Gram path), 3 steps:
- 'duplicated': every rank runs the package on the gathered matrices, so the result equals the
  TP=1 package run to 1e-6 (measured 0: the same float16 products on the same matrices).
- 'distributed': the sharded blocks iterate on Gram matrices all-reduced over the ranks, which
  the package cannot do: they report 'gram' and never reach it (its calls are recorded on this
  optimizer's settings); the replicated block goes through it.
- The layer-wise owner (DP=2) on exact gradients at 'medium', bf16 products as a native bf16 CPU
  runs them (tests/bf16_numerics.py): its total update within the package's float16 round-off
  (PACKAGE_TOLERANCE) of the single-process package run, and closer to it than our bf16 path.
- FSDP2 (2 ranks) on the GPT of test_fsdp2.py at 'medium': within 2e-3 of the single-process
  package run (max abs, measured 5.4e-4). Not 0: the reduced gradients differ by round-off, which
  half precision amplifies.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_eopt.ops.gram_newton_schulz_package import PACKAGE_PATH, GramPackage
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
from tests.bf16_numerics import bf16_numerics, runs_bf16_at_medium
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


# Hand-built model for the layer-wise case: two wide matrices (the Gram path, so the package) and
# a square one (the standard path, ours in bf16); every shape twice, so an owner's batches differ
# from the single process's.
PACKAGE_SHAPES = {"layers.0.in_proj.weight": (16, 96), "layers.0.out_proj.weight": (96, 16),
                  "layers.0.square.weight": (32, 32), "layers.1.in_proj.weight": (16, 96),
                  "layers.1.square.weight": (32, 32), "layers.0.norm.weight": (16,)}
LAYER_WISE_STEPS = 3
# The package's float16 products: its result carries round-off of about its depth (3 products in
# each of 5 steps) times float16's unit round-off 2**-11, relative. With the same gradients (exact
# here) momentum and Newton-Schulz inputs are bitwise those of one process, so that bound holds
# for each update and for their sum; bf16 (ours) is 8 times coarser.
PACKAGE_TOLERANCE = 15 * 2.0**-11


def _layer_wise_body(rank: int, world_size: int) -> dict:
    from tests.unit.library.distributed import test_layer_wise as layer_wise

    fields = {**PACKAGE_FIELDS, "lr": 0.01, "clip_grad": 0.0}
    owner_calls: set[tuple[int, ...]] = set()
    original = GramPackage.__call__

    def recording(self, x: torch.Tensor) -> torch.Tensor:
        owner_calls.add(tuple(x.shape))
        return original(self, x)

    with bf16_numerics():
        assert runs_bf16_at_medium()
        start, model = layer_wise.build_model(PACKAGE_SHAPES), layer_wise.build_model(PACKAGE_SHAPES)
        references = {"package": layer_wise.build_model(PACKAGE_SHAPES), "ours": layer_wise.build_model(PACKAGE_SHAPES)}
        optimizers = {name: layer_wise.reference_optimizer(
            reference, **{**fields, "muon_gram_newton_schulz_package": name == "package"})
            for name, reference in references.items()}
        layer_wise_optimizer = layer_wise.layer_wise_optimizer(model, dist.group.WORLD, True, **fields)
        ranks = dist.get_process_group_ranks(dist.group.WORLD)
        for step in range(LAYER_WISE_STEPS):
            layer_wise.set_grads(model, layer_wise.rank_grads(PACKAGE_SHAPES, step, rank))
            GramPackage.__call__ = recording
            try:
                assert layer_wise_optimizer.step()[0]
            finally:
                GramPackage.__call__ = original
            for name, optimizer in optimizers.items():
                layer_wise.set_grads(references[name], layer_wise.averaged_grads(PACKAGE_SHAPES, step, ranks))
                assert optimizer.step()[0]

    def relative(reference: torch.nn.Module) -> dict[str, float]:
        """Relative Frobenius error of this rank's total update against `reference`'s."""
        before = dict(start.named_parameters())
        expected = dict(reference.named_parameters())
        return {n: ((p - expected[n]).norm() / (expected[n] - before[n]).norm()).item()
                for n, p in model.named_parameters() if p.dim() == 2}

    return {"package": relative(references["package"]), "ours": relative(references["ours"]),
            "owner_calls": sorted(owner_calls), "owned": sorted(layer_wise.owned_names(layer_wise_optimizer, model))}


def test_layer_wise_owner_runs_the_package(run_distributed) -> None:
    results = run_distributed(_layer_wise_body, world_size=2, timeout=600)
    for errors in results:
        assert max(errors["package"].values()) <= PACKAGE_TOLERANCE, errors["package"]
        assert max(errors["package"].values()) < max(errors["ours"].values()), errors  # not our bf16 path
        # A rank calls the package exactly when it owns a wide matrix, with those matrices only.
        wide = {PACKAGE_SHAPES[n] for n in errors["owned"] if "proj" in n}
        assert {shape[1:] for shape in errors["owner_calls"]} == wide, errors
    assert any(errors["owner_calls"] for errors in results)


def test_fsdp2_owner_runs_the_package(run_distributed) -> None:
    for errors in run_distributed(fsdp2_errors, world_size=2, args=(PACKAGE_FIELDS,), timeout=600):
        assert max(errors.values()) <= 2e-3, errors
