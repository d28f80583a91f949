"""Jobs that use only some of torch's WORLD: every collective runs over the job's own groups.

Several trainings may share one torch.distributed WORLD (e.g. colocated jobs); each passes its
own process groups, and nothing may wait for ranks outside them. On 4 gloo ranks:
- two 2-rank jobs, ranks {0,1} (TP2, Muon, ParallelGroups.from_groups) and {2,3} (DP2,
  layer-wise Muon, megatron-core's ProcessGroupCollection), train, save, reload into a fresh
  model and optimizer, and train on, at the same time, into different directories, with
  different numbers of steps;
- one 2-rank job while the two other ranks do nothing at all (before the fix this hung in a
  gather over WORLD; the harness's timeout turns a hang into a failure);
- TP2 x DP2 with explicit groups, where the tensor-parallel group is not WORLD.
Reference: the same optimizer in one process on the full (TP=1) matrices with the same global
gradients, stepped straight through. TP all-gathers the full matrix before Newton-Schulz, so
only the gradient norm is summed in another order: parameters agree to 1e-6 (fp32, values ~1).
"""

import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint

CONFIG = dict(optimizer="muon", lr=0.02, weight_decay=0.1, clip_grad=1.0, muon_momentum=0.9)
SHAPES = {"column.weight": (8, 4), "row.weight": (4, 8), "norm.weight": (4,)}
PARTITION_DIM = {"column.weight": 0, "row.weight": 1, "norm.weight": None}  # None: replicated
TOLERANCE = 1e-6
HANG_TIMEOUT_S = 120  # the fixed runs take seconds; a collective waiting for absent ranks never ends


@dataclass(frozen=True)
class JobRun:
    tp: int
    layer_wise: bool
    steps_before_save: int
    steps_after_load: int


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def shard(tensor: torch.Tensor, name: str, tp_rank: int, tp: int) -> torch.Tensor:
    dim = PARTITION_DIM[name]
    return tensor.clone() if dim is None else tensor.chunk(tp, dim=dim)[tp_rank].clone()


class Model(torch.nn.Module):
    """The TP shard `tp_rank` of a column-parallel, a row-parallel and a replicated parameter."""

    def __init__(self, seed: int, tp_rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        for name, tensor in full_tensors(seed).items():
            module_name, attribute = name.split(".")
            self.add_module(module_name, torch.nn.Module())
            param = torch.nn.Parameter(shard(tensor, name, tp_rank, tp))
            if PARTITION_DIM[name] is not None and tp > 1:
                param.tensor_model_parallel, param.partition_dim = True, PARTITION_DIM[name]
            getattr(self, module_name).register_parameter(attribute, param)


def set_grads(model: Model, step: int, tp_rank: int, tp: int) -> None:
    """The same global gradient in every layout (as after DDP's all-reduce); large enough to clip."""
    grads = full_tensors(seed=100 + step)
    for name, param in model.named_parameters():
        param.grad = shard(grads[name] * 3.0, name, tp_rank, tp)


def train(model: Model, optimizer, steps: range, tp_rank: int, tp: int) -> None:
    for step in steps:
        set_grads(model, step, tp_rank, tp)
        ok, _, _ = optimizer.step()
        assert ok, f"step {step} was skipped"


def run_job(run: JobRun, groups, tp_rank: int, directory: str) -> dict[str, float]:
    """Train, save, load into a fresh model and optimizer, train on; max error per parameter
    against the single-process TP=1 reference run straight through."""
    config = OptimizerConfig(**CONFIG, use_layer_wise_distributed_optimizer=run.layer_wise)
    first = Model(seed=0, tp_rank=tp_rank, tp=run.tp)
    optimizer = get_megatron_optimizer(config, first, pg_collection=groups)
    train(first, optimizer, range(run.steps_before_save), tp_rank, run.tp)
    save_checkpoint(directory, run.steps_before_save, [first], optimizer, pg_collection=groups)

    resumed = Model(seed=1, tp_rank=tp_rank, tp=run.tp)  # other values: the load must replace them
    optimizer = get_megatron_optimizer(config, resumed, pg_collection=groups)
    start = load_checkpoint(directory, [resumed], optimizer, pg_collection=groups).iteration
    train(resumed, optimizer, range(start, start + run.steps_after_load), tp_rank, run.tp)

    reference = Model(seed=0)
    reference_optimizer = get_megatron_optimizer(OptimizerConfig(**CONFIG), reference,
                                                 pg_collection=ParallelGroups.single_process())
    train(reference, reference_optimizer, range(run.steps_before_save + run.steps_after_load), 0, 1)
    expected = dict(reference.named_parameters())
    return {name: (param.detach() - shard(expected[name].detach(), name, tp_rank, run.tp)).abs().max().item()
            for name, param in resumed.named_parameters()}


def new_groups(rank_lists: list[list[int]]) -> list[Optional[dist.ProcessGroup]]:
    """Every rank creates every group, in one order (what torch's new_group requires)."""
    return [dist.new_group(ranks) for ranks in rank_lists]


def member_group(groups: list, rank_lists: list[list[int]], rank: int):
    return next(group for group, ranks in zip(groups, rank_lists) if rank in ranks)


# ------------------------------------------------------------------------------------------------
# Two jobs on one WORLD
# ------------------------------------------------------------------------------------------------

JOB_RANKS = [[0, 1], [2, 3]]
SINGLE_RANKS = [[0], [1], [2], [3]]
JOB_RUNS = [JobRun(tp=2, layer_wise=False, steps_before_save=3, steps_after_load=2),
            JobRun(tp=1, layer_wise=True, steps_before_save=2, steps_after_load=1)]


def job_groups(job_index: int, job: dist.ProcessGroup, single: dist.ProcessGroup):
    """Job 0: TP2 through ParallelGroups.from_groups; job 1: DP2 through a ProcessGroupCollection."""
    if job_index == 0:
        return ParallelGroups.from_groups(tp=job, mp=job, dp_cp=None, tp_dp_cp=job)
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=single, mp=single, dp_cp=job, tp_dp_cp=job)


def _two_jobs_body(rank: int, world_size: int, directory: str, active_jobs: tuple[int, ...]) -> Optional[dict]:
    jobs = new_groups(JOB_RANKS)
    singles = new_groups(SINGLE_RANKS)
    # Test set-up, not the code under test: no rank may return (and so destroy its groups) while
    # another is still connecting the groups they share.
    dist.barrier()
    job_index = rank // 2
    if job_index not in active_jobs:
        return None  # these ranks take no part: nothing of the other job may wait for them
    groups = job_groups(job_index, jobs[job_index], singles[rank])
    run = JOB_RUNS[job_index]
    tp_rank = rank % 2 if run.tp == 2 else 0
    return run_job(run, groups, tp_rank, os.path.join(directory, f"job{job_index}"))


def _check_errors(results: list, active_ranks: list[int]) -> None:
    for rank, errors in enumerate(results):
        if rank not in active_ranks:
            assert errors is None
            continue
        assert set(errors) == set(SHAPES), (rank, errors)
        for name, error in errors.items():
            assert error < TOLERANCE, (rank, name, error)


def test_two_jobs_on_one_world_train_and_checkpoint_independently(run_distributed, tmp_path) -> None:
    results = run_distributed(_two_jobs_body, world_size=4, args=(str(tmp_path), (0, 1)), timeout=HANG_TIMEOUT_S)
    _check_errors(results, [0, 1, 2, 3])
    for job_index, run in enumerate(JOB_RUNS):  # each job committed its own checkpoint, in its own place
        latest = (tmp_path / f"job{job_index}" / "latest").read_text().strip()
        assert latest == f"iter_{run.steps_before_save:07d}"


def test_a_job_on_two_of_four_ranks_needs_nothing_from_the_other_two(run_distributed, tmp_path) -> None:
    results = run_distributed(_two_jobs_body, world_size=4, args=(str(tmp_path), (0,)), timeout=HANG_TIMEOUT_S)
    _check_errors(results, [0, 1])


def _one_rank_job_body(rank: int, world_size: int, directory: str) -> Optional[dict]:
    if rank != 0:
        return None
    alone = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=None, tp_dp_cp=None)  # every size 1
    return run_job(JobRun(tp=1, layer_wise=False, steps_before_save=2, steps_after_load=1), alone, 0, directory)


def test_a_one_rank_job_in_a_two_rank_world_runs_alone(run_distributed, tmp_path) -> None:
    """No collective at all (torch.distributed.checkpoint included) when the job is one rank."""
    results = run_distributed(_one_rank_job_body, world_size=2, args=(str(tmp_path),), timeout=HANG_TIMEOUT_S)
    _check_errors(results, [0])


# ------------------------------------------------------------------------------------------------
# TP2 x DP2 with explicit groups
# ------------------------------------------------------------------------------------------------

TP_RANKS = [[0, 1], [2, 3]]
DP_RANKS = [[0, 2], [1, 3]]


def _tp2_dp2_body(rank: int, world_size: int, directory: str) -> dict:
    tp_groups, dp_groups = new_groups(TP_RANKS), new_groups(DP_RANKS)
    (everyone,) = new_groups([[0, 1, 2, 3]])  # the job's group, given explicitly (not torch's WORLD object)
    tp = member_group(tp_groups, TP_RANKS, rank)
    groups = ParallelGroups.from_groups(tp=tp, mp=tp, dp_cp=member_group(dp_groups, DP_RANKS, rank),
                                        tp_dp_cp=everyone)
    errors = {}
    for layer_wise in (False, True):
        run = JobRun(tp=2, layer_wise=layer_wise, steps_before_save=2, steps_after_load=2)
        errors[layer_wise] = run_job(run, groups, dist.get_rank(tp), os.path.join(directory, f"layer_wise_{layer_wise}"))
    return errors


def test_tp2_dp2_with_explicit_groups_equals_tp1(run_distributed, tmp_path) -> None:
    for rank, result in enumerate(run_distributed(_tp2_dp2_body, world_size=4, args=(str(tmp_path),))):
        for layer_wise, errors in result.items():
            assert set(errors) == set(SHAPES)
            for name, error in errors.items():
                assert error < TOLERANCE, (rank, layer_wise, name, error)


def _grid_alignment_body(rank: int, world_size: int) -> list[str]:
    tp_groups, dp_groups = new_groups(TP_RANKS), new_groups(DP_RANKS)
    tp = member_group(tp_groups, TP_RANKS, rank)
    groups = ParallelGroups.from_groups(tp=tp, mp=tp, dp_cp=member_group(dp_groups, DP_RANKS, rank))
    model = torch.nn.Module()
    model.linear = torch.nn.Linear(4, 4, bias=(rank == 3))  # only rank 3 has a (no-weight-decay) bias
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1), model, pg_collection=groups)
    return [group["group_key"] for group in optimizer.param_groups]


def test_param_group_keys_agree_over_the_grid_without_a_job_wide_group(run_distributed) -> None:
    """Rank 0 shares no group with rank 3: gathering over mp, then over dp_cp, still reaches it."""
    keys = run_distributed(_grid_alignment_body, world_size=4)
    assert all(k == keys[0] for k in keys), keys
    assert len(keys[0]) == 2  # the default group and rank 3's bias group (empty elsewhere)


# ------------------------------------------------------------------------------------------------
# A checkpoint without the job's group is an error, not a collective over WORLD
# ------------------------------------------------------------------------------------------------


def _missing_job_group_body(rank: int, world_size: int, directory: str) -> dict:
    world = dist.group.WORLD
    (single,) = [g for g, ranks in zip(new_groups(SINGLE_RANKS[:2]), SINGLE_RANKS[:2]) if rank in ranks]
    model = Model(seed=0, tp_rank=rank, tp=2)
    messages = {}
    for case, groups in {
        "missing": ParallelGroups.from_groups(tp=world, mp=world, dp_cp=None),
        "too small": ParallelGroups.from_groups(tp=world, mp=world, dp_cp=None, tp_dp_cp=single),
    }.items():
        optimizer = get_megatron_optimizer(OptimizerConfig(**CONFIG), model, pg_collection=groups)
        for action in (save_checkpoint, load_checkpoint):
            try:
                if action is save_checkpoint:
                    save_checkpoint(directory, 1, [model], optimizer, pg_collection=groups)
                else:
                    load_checkpoint(directory, [model], optimizer, pg_collection=groups)
                messages[case, action.__name__] = None
            except ValueError as error:
                messages[case, action.__name__] = str(error)
    return messages


def test_checkpoint_without_the_job_group_says_which_group_is_missing(run_distributed, tmp_path) -> None:
    for messages in run_distributed(_missing_job_group_body, world_size=2, args=(str(tmp_path),)):
        for action in ("save_checkpoint", "load_checkpoint"):
            assert "needs the 'tp_dp_cp' process group, which was not provided" in messages["missing", action]
            assert "the 'tp_dp_cp' process group has 1 ranks, but tensor parallel x data parallel" in \
                messages["too small", action]
    assert not os.listdir(tmp_path)  # nothing was written
