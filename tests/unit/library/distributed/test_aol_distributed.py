"""Turbo-Muon (the AOL preconditioner) over TP shards, the layer-wise optimizer and FSDP2 (CPU, gloo, fp32).

- TP=2, one launch: 'duplicated', 'sharded' and 'distributed' (where the all-reduced Gram matrix
  gives every rank the same row scales), each with the standard and the Gram iteration, equal
  TP=1 to 1e-5 after 3 steps; and the preconditioner changes the update (by > 1e-3).
- One launch: the layer-wise optimizer (DP=2), FSDP2 and Megatron-FSDP (2 ranks, uneven row shards) on
  the GPT (q/k/v and gated fc1 blocks) equal one process to 1e-5, with the preconditioner on.
"""

import dataclasses

import torch.distributed as dist

from tests.unit.library.distributed.test_gram_newton_schulz_distributed import (
    MATRICES,
    fsdp2_errors,
    layer_wise_errors,
    run_muon,
    shard,
)

TURBO = {"aol_preconditioner": True, "coefficient_type": "quintic", "num_ns_steps": 4}


def _tp_modes_body(rank: int, size: int) -> dict:
    def distance(got: dict, reference: dict) -> float:
        return max((p - shard(reference["params"][n], MATRICES[n][1], rank, size)).abs().max().item()
                   for n, p in got["params"].items())

    errors = {}
    for gram in (False, True):
        reference = run_muon(0, 1, "duplicated", None, gram_newton_schulz=gram, **TURBO)
        for mode in ("duplicated", "distributed", "sharded"):
            got = run_muon(rank, size, mode, dist.group.WORLD, gram_newton_schulz=gram, **TURBO)
            errors[f"{mode}{' gram' if gram else ''}"] = distance(got, reference)
    plain = run_muon(0, 1, "duplicated", None, gram_newton_schulz=False, coefficient_type="quintic", num_ns_steps=4)
    turbo = run_muon(0, 1, "duplicated", None, gram_newton_schulz=False, **TURBO)
    effect = max((turbo["params"][n] - plain["params"][n]).abs().max().item() for n in MATRICES)
    return {"errors": errors, "preconditioner's effect": effect}


def test_tp_modes_equal_tp1(run_distributed) -> None:
    for result in run_distributed(_tp_modes_body, world_size=2):
        assert max(result["errors"].values()) <= 1e-5, result["errors"]
        assert result["preconditioner's effect"] > 1e-3


def _layer_wise_and_fsdp_body(rank: int, world_size: int) -> dict:
    turbo = {"muon_aol_preconditioner": True}
    return {"layer-wise": layer_wise_errors(world_size, turbo),
            "fsdp2": fsdp2_errors(rank, world_size, turbo),
            "megatron-fsdp": _megatron_fsdp_errors(rank, world_size)}


def _megatron_fsdp_errors(rank: int, world_size: int) -> dict:
    """Megatron-FSDP (uneven row shards, each matrix orthogonalized by its owner) against one process."""
    from tests.unit.library.distributed import test_megatron_fsdp as megatron_fsdp

    config_for = megatron_fsdp.config_for  # the workers outlive this test: put the module's function back
    megatron_fsdp.config_for = lambda name: dataclasses.replace(config_for(name), muon_aol_preconditioner=True)
    try:
        return megatron_fsdp.train_both("muon", rank, world_size)["errors"]
    finally:
        megatron_fsdp.config_for = config_for


def test_layer_wise_fsdp2_and_megatron_fsdp_equal_one_process(run_distributed) -> None:
    for result in run_distributed(_layer_wise_and_fsdp_body, world_size=2, timeout=600):
        for engine, errors in result.items():
            assert max(errors.values()) <= 1e-5, (engine, errors)
