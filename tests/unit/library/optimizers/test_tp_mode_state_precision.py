"""bf16 momentum (the precision-aware optimizer) under muon_tp_mode='distributed'.

Every TP mode keeps the momentum of this TP rank's shard in the inner optimizer's state; the mode
only changes how the update is orthogonalized. So 'distributed' with bf16 momentum must match
'duplicated' with bf16 momentum, megatron-core's GPTModel at TP=2 and the same global gradients
(each rank its TP shard, checkpoint_runs.synthetic_step): the momentum bitwise (the same fp32
lerp of the same numbers, rounded the same way), and the fp32 main weights to 1e-5, the bound
test_gpt_muon.py holds the modes to at fp32 (Newton-Schulz round-off differs with the split).
"""

import torch

from tests.unit.library.checkpointing.checkpoint_runs import GPTRun, Layout

STEPS = 3


def _run(tp_mode: str) -> dict:
    run = GPTRun(Layout("muon", tp=2, bf16_state=True), muon_tp_mode=tp_mode)
    try:
        for step in range(STEPS):
            run.synthetic_step(step)
        momenta = {p.fqn: p.state["momentum_buffer"].clone() for child in run.optimizer.chained_optimizers
                   for p in child.checkpoint_params() if "momentum_buffer" in p.state}
        modes = {mode for child in run.optimizer.chained_optimizers for mode in child.tp_modes().values()}
        return {"modes": sorted(modes),
                "params": {name: value for name, (value, _, _) in run.master_params().items()}, "momenta": momenta}
    finally:
        run.close()


def _body(rank: int, world_size: int) -> dict:
    return {mode: _run(mode) for mode in ("duplicated", "distributed")}


def test_distributed_tp_mode_with_bf16_momentum_equals_duplicated(run_distributed) -> None:
    for rank, runs in enumerate(run_distributed(_body, world_size=2, timeout=600)):
        duplicated, distributed = runs["duplicated"], runs["distributed"]
        assert duplicated["modes"] == ["duplicated"] and distributed["modes"] == ["distributed"], runs
        assert duplicated["momenta"] and set(duplicated["momenta"]) == set(distributed["momenta"])
        for fqn, momentum in duplicated["momenta"].items():
            assert momentum.dtype == distributed["momenta"][fqn].dtype == torch.bfloat16, (rank, fqn)
            assert torch.equal(momentum, distributed["momenta"][fqn]), (rank, fqn)
        errors = {name: (value - distributed["params"][name]).abs().max().item()
                  for name, value in duplicated["params"].items()}
        assert max(errors.values()) <= 1e-5, (rank, sorted(errors.items(), key=lambda e: -e[1])[:3])
