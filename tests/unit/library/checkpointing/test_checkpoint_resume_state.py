"""What a resume restores besides the model and optimizer: the lr schedule and the RNG states.

One plain process (no torch.distributed), megatron-core's OptimizerParamScheduler and RNG tracker.
- A changed lr schedule is refused before anything changes (parameters, optimizer state,
  scheduler and param-group lr/wd bitwise as before), naming each value and both flags.
- `override_opt_param_scheduler`: this run's schedule at the checkpoint's step count; the
  reference is a fresh scheduler of this run's config stepped by as many samples.
- `use_checkpoint_opt_param_scheduler`: the checkpoint's schedule; the reference is the saved
  run's own scheduler continuing.
- RNG: the CPU generator and megatron-core's tracker states round trip; a draw from a tracker
  state after the load equals the draw after the save (on CPU the tracker cannot fork(), which
  needs CUDA, so the draw uses a CPU generator set to the state; the GPU tier forks for real).
"""

import copy

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.integrations.megatron_bridge import SchedulerConfig, get_scheduler
from megatron_eopt.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

BATCH = 4


def _run(seed: int, lr: float = 1e-2, train_iters: int = 20, decoupled_lr: float = 5e-3, **schedule_flags):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[0].weight.is_embedding_or_output_parameter = True
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=1e-3, weight_decay=0.1, decoupled_lr=decoupled_lr,
                             decoupled_min_lr=1e-4)
    optimizer = get_megatron_optimizer(config, [model])
    scheduler = get_scheduler(config, SchedulerConfig(lr_warmup_iters=2, train_iters=train_iters,
                                                      global_batch_size=BATCH, lr_decay_style="cosine",
                                                      **schedule_flags), optimizer)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        optimizer.zero_grad()
        tokens = torch.randint(0, 10, (BATCH,), generator=generator)
        model(tokens).square().mean().backward()
        assert optimizer.step()[0]
        scheduler.step(BATCH)


def _snapshot(model, optimizer, scheduler) -> dict:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "groups": [(g["lr"], g["weight_decay"], g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups],
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


@pytest.fixture
def saved(tmp_path):
    """A run of 8 of its 20 iterations, saved; the run continues in memory as the reference."""
    run = _run(0)
    _train(*run, range(8))
    save_checkpoint(str(tmp_path), 8, [run[0]], run[1], run[2])
    return str(tmp_path), run


@pytest.mark.parametrize("change, fragments", [
    (dict(lr=2e-2), ["learning rate (max_lr): checkpoint 0.01, now 0.02"]),
    (dict(train_iters=40), ["decay steps (lr_decay_steps): checkpoint 80, now 160",
                            "weight decay increment steps (wd_incr_steps): checkpoint 80, now 160"]),
    (dict(decoupled_lr=2e-3), ["max_lr of param group", "checkpoint 0.005, now 0.002"]),
])
def test_a_changed_schedule_is_refused_with_nothing_changed(saved, change, fragments) -> None:
    directory, _ = saved
    run = _run(1, **change)
    before = _snapshot(*run)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(directory, [run[0]], run[1], run[2])
    message = str(refused.value)
    for fragment in fragments + ["Nothing was loaded", "--override-opt_param-scheduler",
                                 "--use-checkpoint-opt_param-scheduler"]:
        assert fragment in message, message
    assert _same(before, _snapshot(*run))


def test_override_keeps_this_runs_schedule_at_the_checkpoints_step(saved) -> None:
    directory, (_, reference_optimizer, _) = saved
    model, optimizer, scheduler = _run(1, lr=2e-2, train_iters=40, override_opt_param_scheduler=True)
    load_checkpoint(directory, [model], optimizer, scheduler)
    expected = _run(2, lr=2e-2, train_iters=40)[2]  # this run's schedule, stepped independently
    expected.step(8 * BATCH)
    assert scheduler.state_dict() == expected.state_dict()
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in expected.optimizer.param_groups]
    assert optimizer.param_groups[0]["lr"] != reference_optimizer.param_groups[0]["lr"]  # not the saved schedule


def test_use_checkpoint_keeps_the_checkpoints_schedule(saved) -> None:
    directory, (reference_model, reference_optimizer, reference_scheduler) = saved
    model, optimizer, scheduler = _run(1, lr=2e-2, train_iters=40, decoupled_lr=2e-3,
                                       use_checkpoint_opt_param_scheduler=True)
    load_checkpoint(directory, [model], optimizer, scheduler)
    assert scheduler.state_dict() == reference_scheduler.state_dict()
    _train(model, optimizer, scheduler, range(8, 12))
    _train(reference_model, reference_optimizer, reference_scheduler, range(8, 12))
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in reference_optimizer.param_groups]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference_model.parameters()))


def test_an_unchanged_schedule_loads_into_a_scheduler_that_already_stepped(saved) -> None:
    directory, (_, _, reference_scheduler) = saved
    model, optimizer, scheduler = _run(1)
    scheduler.step(3 * BATCH)  # megatron-core's load_state_dict adds to the current count
    load_checkpoint(directory, [model], optimizer, scheduler)
    assert scheduler.state_dict() == reference_scheduler.state_dict()


def test_cpu_and_rng_tracker_states_round_trip(tmp_path) -> None:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    kept = tracker.get_states()
    try:
        # CPU: megatron-core's tracker holds states without CUDA (set_states), but add() and fork() need CUDA.
        tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(11).get_state()})
        model, optimizer, scheduler = _run(0)
        torch.manual_seed(3)
        save_checkpoint(str(tmp_path), 1, [model], optimizer, scheduler)
        saved_states = {k: v.clone() for k, v in tracker.get_states().items()}
        draws = _draws(tracker)
        tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(12).get_state()})
        torch.manual_seed(4)
        load_checkpoint(str(tmp_path), [model], optimizer, scheduler)
        assert _same(saved_states, tracker.get_states())
        assert _same(draws, _draws(tracker))
        torch.manual_seed(4)
        load_checkpoint(str(tmp_path), [model], optimizer, scheduler, load_rng=False)
        assert not torch.equal(draws["cpu"], torch.rand(4))
    finally:
        tracker.set_states(kept)


def _draws(tracker) -> dict:
    generator = torch.Generator()
    generator.set_state(tracker.get_states()["model-parallel-rng"])
    return {"tracker": torch.rand(4, generator=generator), "cpu": torch.rand(4)}


def test_pretrain_gpt_scheduler_flags_reach_the_scheduler_config(capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.arguments.training import scheduler_config

    base = ["--lr", "1e-2", "--load", "ckpt"]
    for flag, field in (("--override-opt_param-scheduler", "override_opt_param_scheduler"),
                        ("--use-checkpoint-opt_param-scheduler", "use_checkpoint_opt_param_scheduler")):
        args, _, _ = parse_args(base + [flag])
        config = scheduler_config(args)
        assert getattr(config, field) and not any(
            getattr(config, other) for other in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")
            if other != field)
    with pytest.raises(SystemExit) as exited:
        parse_args(base + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert exited.value.code == 2
    assert "exclude each other" in capsys.readouterr().err
