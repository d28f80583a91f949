"""Checkpoints across pipeline and expert-parallel layouts (CPU, gloo, 2 ranks; no schedule runs).

Runs come from pp_ep_runs.py: every layout sees the same global model and synthetic global
gradient, so layouts can be compared by global parameter name.
- Resharding: save at layout A after SAVED_STEPS steps; load into a fresh layout B and take one
  more step; continuing in A takes the same step. Every global parameter equal to 1e-6 (fp32;
  the gradient norm is summed over other ranks in another order, so clipping, active in
  every step, differs in the last bit). Pairs: PP=2 -> PP=1, PP=1 -> PP=2, EP=2 -> EP=1,
  EP=1 -> EP=2 (the PP=1 / EP=1 runs are DP=2 on the same 2 ranks), PP=2 x 2 virtual chunks ->
  PP=1; on 4 ranks TP=2 x PP=2 -> DP=4 and EP=2 -> EP=1; for adam and layer-wise muon.
- Exact resume at PP=2 and EP=2: SAVED_STEPS steps, save, fresh run, load, SAVED_STEPS more
  equals 2 * SAVED_STEPS straight: every parameter and optimizer state tensor bitwise, key by key.
Resume for adam, muon and layer-wise muon. Measured: resharding <= 1.5e-8.
Also: megatron-core's sharded_state_dict gives the same optimizer shards at PP=2 / EP=2 as at
PP=1 / EP=1, and a pipeline checkpoint without a `job` group is refused, naming it.
"""

import os

import pytest
import torch

from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint
from tests.unit.library.checkpointing.pp_ep_runs import MOE, Layout, Run, assemble_global
from tests.unit.library.checkpointing.test_checkpoint import _differences

SAVED_STEPS = 2
TOLERANCE = 1e-6
OPTIMIZER_VARIANTS = (("adam", False), ("muon", False), ("muon", True))
# Resharding with adam and layer-wise muon: plain muon's checkpoint is the layer-wise one's
# (the common format; test_checkpoint.py reshards between them), and the training script's
# tests resume PP=2 layer-wise muon at PP=1 plain muon and EP=2 at EP=1.
RESHARD_VARIANTS = (("adam", False), ("muon", True))
RESHARD_PAIRS = {
    2: (
        (dict(pp=2), dict()),
        (dict(), dict(pp=2)),
        (dict(ep=2, settings=MOE), dict(settings=MOE)),
        (dict(settings=MOE), dict(ep=2, settings=MOE)),
        (dict(pp=2, vpp=2), dict()),
    ),
    4: (
        (dict(tp=2, pp=2), dict()),
        (dict(ep=2, settings=MOE), dict(settings=MOE)),
    ),
}
RESUME_LAYOUTS = (dict(pp=2), dict(ep=2, settings=MOE))


def _steps(run: Run, start: int, stop: int) -> Run:
    for step in range(start, stop):
        if not run.step(step)[0]:
            raise RuntimeError(f"step {step} was skipped")
    return run


def _continue_after_load(layout: Layout, directory: str, stop: int) -> Run:
    run = Run(layout)
    start = load_checkpoint(directory, run.chunks, run.optimizer).iteration
    return _steps(run, start, stop)


def _reshard_body(rank: int, world_size: int, directory: str) -> dict:
    results = {}
    for optimizer, layer_wise in RESHARD_VARIANTS:
        for saved_changes, loaded_changes in RESHARD_PAIRS[world_size]:
            saved, loaded = Layout(optimizer, layer_wise, **saved_changes), Layout(optimizer, layer_wise, **loaded_changes)
            name = f"{saved.describe(world_size)} -> {loaded.describe(world_size)}"
            case_dir = os.path.join(directory, name.replace(" ", "_").replace(">", ""))
            run = _steps(Run(saved), 0, SAVED_STEPS)
            save_checkpoint(case_dir, SAVED_STEPS, run.chunks, run.optimizer)
            continued = _steps(run, SAVED_STEPS, SAVED_STEPS + 1).global_params()
            run.close()
            run = _continue_after_load(loaded, case_dir, SAVED_STEPS + 1)
            results[name] = (continued, run.global_params())
            run.close()
    return results


# The 4-rank save (PP=2 x EP=2): `make test-slow`; `make test` reshards from 2 ranks and resumes exactly.
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_reshard_pipeline_and_experts(run_distributed, tmp_path, world_size):
    per_rank = run_distributed(_reshard_body, world_size, args=(str(tmp_path),), timeout=900)
    errors = {}
    for name in per_rank[0]:
        expected = assemble_global([results[name][0] for results in per_rank])
        actual = assemble_global([results[name][1] for results in per_rank])
        assert set(expected) == set(actual), f"{name}: {sorted(set(expected) ^ set(actual))}"
        errors[name] = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    assert len(errors) == len(RESHARD_PAIRS[world_size]) * len(RESHARD_VARIANTS)
    worst = {name: error for name, error in errors.items() if not error <= TOLERANCE}
    assert not worst, f"max |loaded - continued| above {TOLERANCE}: {worst}; all: {errors}"


def _resume_body(rank: int, world_size: int, directory: str) -> dict:
    differences = {}
    for optimizer, layer_wise in OPTIMIZER_VARIANTS:
        for changes in RESUME_LAYOUTS:
            layout = Layout(optimizer, layer_wise, **changes)
            case_dir = os.path.join(directory, layout.describe(world_size).replace(" ", "_"))
            straight = _steps(Run(layout), 0, 2 * SAVED_STEPS)
            expected = {"params": _params(straight), "optimizer": straight.optimizer.state_dict()}
            straight.close()
            first = _steps(Run(layout), 0, SAVED_STEPS)
            save_checkpoint(case_dir, SAVED_STEPS, first.chunks, first.optimizer)
            first.close()
            resumed = _continue_after_load(layout, case_dir, 2 * SAVED_STEPS)
            actual = {"params": _params(resumed), "optimizer": resumed.optimizer.state_dict()}
            resumed.close()
            differences[layout.describe(world_size)] = _differences(expected, actual)
    return differences


def _params(run: Run) -> dict[str, torch.Tensor]:
    return {fqn: p.detach().clone() for fqn, p in run.params.items()}


def test_exact_resume_pipeline_and_experts(run_distributed, tmp_path):
    for rank, differences in enumerate(run_distributed(_resume_body, 2, args=(str(tmp_path),), timeout=900)):
        assert len(differences) == len(RESUME_LAYOUTS) * len(OPTIMIZER_VARIANTS)
        assert not any(differences.values()), f"rank {rank}: {differences}"


def _megatron_sharded_body(rank: int, world_size: int) -> dict:
    """{layout: {(key, global_offset): this rank's optimizer-state shard}} of megatron-core's format."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    result = {}
    for changes in MEGATRON_SHARDED_LAYOUTS:
        layout = Layout("adam", **changes)
        run = _steps(Run(layout), 0, 1)
        try:
            model = run.chunks[0].sharded_state_dict()
            # As Megatron-LM saves: without chained_optim_avoid_prefix megatron-core's rule prefixes a
            # chain of several children (EP=2: dense and expert) but not a chain of one (EP=1).
            sharded = run.optimizer.sharded_state_dict(model, metadata={"chained_optim_avoid_prefix": True})
            apply_factories(sharded)
            result[layout.describe(world_size)] = {
                (t.key, tuple(t.global_offset)): t.data.clone()
                for t in nested_values(sharded) if isinstance(t, ShardedTensor)
            }
        finally:
            run.close()
    return result


MEGATRON_SHARDED_LAYOUTS = (dict(), dict(pp=2), dict(settings=MOE), dict(ep=2, settings=MOE))


def test_megatron_sharded_state_dict_has_global_offsets(run_distributed):
    # The optimizer's ShardedTensors follow the model's, which megatron-core places at global
    # layer and expert offsets: the PP=2 (EP=2) shards are the PP=1 (EP=1) shards, same values.
    per_rank = run_distributed(_megatron_sharded_body, 2)
    layouts = list(per_rank[0])
    for single, split in zip(layouts[0::2], layouts[1::2]):
        shards = [{}, {}]
        for index, name in enumerate((single, split)):
            for results in per_rank:
                for key, value in results[name].items():
                    held = shards[index].setdefault(key, value)
                    assert torch.equal(held, value), f"{name}: replicas of {key} differ"
        assert set(shards[0]) == set(shards[1]), f"{single} vs {split}: {sorted(set(shards[0]) ^ set(shards[1]))[:6]}"
        assert any(key[0].startswith("optimizer.") for key in shards[0]), sorted(shards[0])[:5]
        differences = [key for key in shards[0] if not torch.allclose(shards[0][key], shards[1][key], rtol=0, atol=1e-6)]
        assert not differences, f"{single} vs {split}: {differences[:6]}"


def _missing_job_group_body(rank: int, world_size: int, directory: str) -> str:
    from dataclasses import replace

    from megatron_eopt import ParallelGroups

    run = Run(Layout("adam", pp=2))
    try:
        groups = ParallelGroups.from_parallel_state()
        without_job = replace(groups, job=None, provided=groups.provided - {"job"})
        try:
            save_checkpoint(directory, 1, run.chunks, run.optimizer, pg_collection=without_job)
        except ValueError as error:
            return str(error)
        return "saved"
    finally:
        run.close()


def test_pipeline_checkpoint_needs_the_job_group(run_distributed, tmp_path):
    # tp_dp_cp holds one stage only: with PP=2 the checkpoint needs a group of every stage.
    for message in run_distributed(_missing_job_group_body, 2, args=(str(tmp_path),)):
        assert "'job' process group" in message and "pipeline parallelism (size 2)" in message, message
    assert not os.path.exists(os.path.join(tmp_path, "latest"))
