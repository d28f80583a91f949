"""Gram Newton-Schulz over tensor-parallel shards, the layer-wise optimizer and FSDP2 (CPU, gloo, fp32).

- TP=2: 'duplicated', 'sharded' and 'distributed' (Gram matrices all-reduced over the shards)
  equal the TP=1 Gram run to 1e-5 after 3 steps (the products are summed in another order);
  'blockwise' takes the Gram path per shard and equals TP=1 Gram on each shard alone.
- Layer-wise (DP=2) and FSDP2 (2 ranks) on the GPT of test_gram_newton_schulz_gpt.py: every
  parameter equals the non-distributed Gram run to 1e-5 after the tests' steps.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

# name -> (global shape, partition_dim): all wide or tall enough for the Gram path at TP=1 and 2.
MATRICES = {"column": ((96, 16), 0), "row": ((16, 96), 1), "replicated": ((8, 40), -1)}


def shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.clone() if dim < 0 else full.chunk(size, dim=dim)[rank].clone()


def run_muon(rank: int, size: int, tp_mode: str, tp_group, **options) -> dict[str, torch.Tensor]:
    """3 steps of Muon (Gram Newton-Schulz unless `options` say otherwise) on this rank's shards."""
    params = {n: torch.nn.Parameter(shard(torch.randn(s, generator=torch.Generator().manual_seed(len(n))), d, rank, size))
              for n, (s, d) in MATRICES.items()}
    layouts = {n: MatrixLayout(n, tuple(p.shape), MATRICES[n][1], size) for n, p in params.items()}
    options = {"gram_newton_schulz": True, **options}
    optimizer = TensorParallelMuon([{"params": list(params.values()), "param_fqns": list(params)}], lr=0.05,
                                   momentum=0.9, fp32_matmul_prec="highest", tp_mode=tp_mode, tp_group=tp_group,
                                   layouts=layouts, **options)
    for step in range(3):
        for n, p in params.items():
            p.grad = shard(torch.randn(MATRICES[n][0], generator=torch.Generator().manual_seed(step)), MATRICES[n][1],
                           rank, size)
        optimizer.step()
    return {"params": {n: p.detach() for n, p in params.items()}, "paths": optimizer.newton_schulz_paths}


def _tp_body(rank: int, size: int, tp_mode: str) -> dict:
    got = run_muon(rank, size, tp_mode, dist.group.WORLD)
    reference = run_muon(0, 1, tp_mode, None)
    errors = {n: (p - shard(reference["params"][n], MATRICES[n][1], rank, size)).abs().max().item()
              for n, p in got["params"].items()}
    return {"errors": errors, "paths": got["paths"]}


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed", "sharded"])
def test_tp_modes_equal_tp1(run_distributed, tp_mode: str) -> None:
    for result in run_distributed(_tp_body, world_size=2, args=(tp_mode,)):
        assert max(result["errors"].values()) <= 1e-5, result["errors"]
        if tp_mode == "distributed":  # local 48 x 16 column shard: Gram on 16 x 16 over 48 columns
            assert result["paths"] == {"column": ("gram",), "row": ("gram",), "replicated": ("gram",)}
        else:
            assert set(result["paths"].values()) == {("gram",)}


def _blockwise_body(rank: int, size: int) -> dict:
    got = run_muon(rank, size, "blockwise", dist.group.WORLD)
    return {"paths": got["paths"]}


def test_blockwise_chooses_per_shard(run_distributed) -> None:
    for result in run_distributed(_blockwise_body, world_size=2):
        # The 48 x 16 shard (3:1) still pays; the decision is on the shard's own shape.
        assert result["paths"]["column"] == ("gram",)


def layer_wise_errors(world_size: int, fields: dict) -> dict:
    """The layer-wise optimizer (DP=`world_size`) against one process on the GPT of
    test_layer_wise_gpt.py, Muon with `fields` set."""
    from tests.unit.library.distributed import test_layer_wise_gpt as layer_wise

    muon = layer_wise.MUON  # the workers outlive this test: put the module's config back
    layer_wise.MUON = {**muon, **fields}
    try:
        reference = layer_wise.train_reference(world_size)
        got = layer_wise.train_layer_wise(1, None, reduce_grads=True)
    finally:
        layer_wise.MUON = muon
    return {n: (v[0] - got["params"][n][0]).abs().max().item() for n, v in reference["params"].items()}


def _layer_wise_body(rank: int, world_size: int) -> dict:
    return layer_wise_errors(world_size, {"muon_gram_newton_schulz": True})


def test_layer_wise_equals_non_distributed(run_distributed) -> None:
    for errors in run_distributed(_layer_wise_body, world_size=2, timeout=600):
        assert max(errors.values()) <= 1e-5, errors


def fsdp2_errors(rank: int, world_size: int, fields: dict) -> dict:
    """FSDP2 (2 ranks) against one process on the GPT of test_fsdp2.py, Muon with `fields` set."""
    from torch.distributed.fsdp import fully_shard

    from tests.unit.library.distributed import test_fsdp2

    model, sharded = test_fsdp2.build_gpt(), test_fsdp2.build_gpt()
    mesh = test_fsdp2._mesh(world_size)
    for layer in sharded.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    config = test_fsdp2.config_for("muon")
    for name, value in fields.items():
        setattr(config, name, value)
    return test_fsdp2.step_both(model, sharded, config)["errors"]


def test_fsdp2_equals_unsharded(run_distributed) -> None:
    for errors in run_distributed(fsdp2_errors, world_size=2, args=({"muon_gram_newton_schulz": True},), timeout=600):
        assert max(errors.values()) <= 1e-5, errors
