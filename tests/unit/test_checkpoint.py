"""Checkpoints: exact resume, resharding between layouts, atomic commits, refusals (CPU, gloo)."""

import torch

from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint
from tests.unit.checkpoint_runs import GPTRun, Layout


def _resume_body(rank: int, world_size: int, layout: Layout, directory: str, steps: int) -> dict:
    straight = GPTRun(layout)
    try:
        for step in range(2 * steps):
            straight.train_step(step)
        expected = (dict(straight.model.named_parameters()), straight.optimizer.state_dict())
        expected = {"params": {k: v.detach().clone() for k, v in expected[0].items()}, "state": expected[1]}
    finally:
        straight.close()
    first = GPTRun(layout)
    try:
        for step in range(steps):
            first.train_step(step)
        save_checkpoint(directory, steps, [first.model], first.optimizer, first.scheduler)
    finally:
        first.close()
    torch.manual_seed(999)  # the resumed run must not depend on the RNG it happens to find
    resumed = GPTRun(layout)
    try:
        loaded = load_checkpoint(directory, [resumed.model], resumed.optimizer, resumed.scheduler)
        for step in range(loaded.iteration, 2 * steps):
            resumed.train_step(step)
        actual = {"params": {k: v.detach().clone() for k, v in resumed.model.named_parameters()},
                  "state": resumed.optimizer.state_dict()}
    finally:
        resumed.close()
    return {"expected": expected, "actual": actual, "iteration": loaded.iteration}


def test_smoke(run_distributed, tmp_path) -> None:
    results = run_distributed(_resume_body, world_size=2, args=(Layout("muon"), str(tmp_path), 3))
    for r in results:
        for k, v in r["expected"]["params"].items():
            assert torch.equal(v, r["actual"]["params"][k]), k
