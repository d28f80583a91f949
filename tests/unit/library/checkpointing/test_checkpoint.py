"""Checkpoints on megatron-core's GPTModel (CPU, gloo): exact resume, resharding, atomic
commits, refusals.

- Exact resume: 20 straight iterations equal 10, save, fresh model/optimizer/scheduler (RNG
  reseeded), load, 10 more: every parameter and every optimizer state tensor BITWISE equal.
- Resharding: a checkpoint saved in one layout and loaded in another gives, after one more
  step with the same global gradient, the same parameters as continuing in the saved layout,
  to 1e-6 (fp32; the gradient norm is summed in another order over other ranks).
- A rank killed with SIGKILL just before the commit leaves the previous checkpoint as
  `latest`, loadable, and the run resumes from it exactly.
"""

import os
import shutil
import signal
from typing import Optional

import pytest
import torch

from megatron_eopt.checkpointing import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from tests.distributed_harness import DistributedRunError
from tests.unit.library.checkpointing.checkpoint_runs import GPTRun, Layout, assemble

RESUME_STEPS = 10
RESHARD_STEPS = 3


def _params(run: GPTRun) -> dict:
    return {name: p.detach().clone() for name, p in run.model.named_parameters()}


def _differences(expected, actual, path: str = "") -> list[str]:
    """Where two nested state dicts differ (tensors bitwise)."""
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{path}: keys {sorted(set(expected) ^ set(actual))}"]
        return [d for k in expected for d in _differences(expected[k], actual[k], f"{path}/{k}")]
    if torch.is_tensor(expected):
        same = expected.dtype == actual.dtype and torch.equal(expected, actual)
        return [] if same else [f"{path}: max diff {(expected.float() - actual.float()).abs().max().item()}"]
    return [] if expected == actual else [f"{path}: {expected!r} != {actual!r}"]


def _train(layout: Layout, start: int, stop: int, directory: str = "", load: bool = False) -> GPTRun:
    run = GPTRun(layout)
    if load:
        start = load_checkpoint(directory, [run.model], run.optimizer, run.scheduler).iteration
    for step in range(start, stop):
        run.train_step(step)
    return run


def local_optimizer_state(optimizer) -> dict:
    """This rank's optimizer state as plain tensors, in every layout (`state_dict()` gives DTensors
    for FSDP2, which torch.equal does not compare, and is refused for TP x FSDP2)."""
    return {"optimizers": {child.name: child.local_state_dict() for child in optimizer.chained_optimizers}}


def resume_differences(layouts, snapshot, directory: str, world_size: int, steps: int = RESUME_STEPS) -> dict:
    """Per layout: (where 2N straight steps differ from N + save + load + N, N = `steps`; the
    number of non-scalar optimizer state tensors compared); `snapshot(run)` gives the parameters."""
    differences = {}
    for layout in layouts:
        case_dir = os.path.join(directory, layout.describe(world_size).replace(" ", "_"))
        straight = _train(layout, 0, 2 * steps)
        expected = {"params": snapshot(straight), "optimizer": local_optimizer_state(straight.optimizer)}
        straight.close()
        first = _train(layout, 0, steps)
        save_checkpoint(case_dir, steps, [first.model], first.optimizer, first.scheduler)
        first.close()
        torch.manual_seed(12345)  # the resumed run must not depend on the RNG state it starts with
        resumed = _train(layout, 0, 2 * steps, case_dir, load=True)
        actual = {"params": snapshot(resumed), "optimizer": local_optimizer_state(resumed.optimizer)}
        resumed.close()
        state_tensors = sum(torch.is_tensor(v) and v.dim() > 0 for child in expected["optimizer"]["optimizers"].values()
                            for entry in child["state"].values() for v in entry.values())
        differences[layout.describe(world_size)] = (_differences(expected, actual), state_tensors)
    return differences


def _resume_body(rank: int, world_size: int, directory: str) -> dict:
    layouts = (Layout("adam"), Layout("muon"), Layout("muon", layer_wise=True), Layout("muon", tp=2))
    return resume_differences(layouts, _params, directory, world_size)


def assert_resumed_exactly(results: list[dict], cases: Optional[int] = None) -> None:
    """Every rank's `resume_differences`: `cases` cases (if given), no difference, and state to compare in each."""
    for rank, result in enumerate(results):
        if cases is not None:
            assert len(result) == cases
        for case, (differences, state_tensors) in result.items():
            assert not differences, (rank, case, differences[:10])
            assert state_tensors > 0, (rank, case)  # there was state to compare


def test_resume_is_exact_for_adam_muon_layer_wise_and_tp2(run_distributed, tmp_path) -> None:
    assert_resumed_exactly(run_distributed(_resume_body, world_size=2, args=(str(tmp_path),), timeout=600))


# ------------------------------------------------------------------------------------------------
# Resharding
# ------------------------------------------------------------------------------------------------


def _save_then_continue(rank: int, world_size: int, layout: Layout, directory: str) -> dict:
    run = _train(layout, 0, RESHARD_STEPS)
    save_checkpoint(directory, RESHARD_STEPS, [run.model], run.optimizer, run.scheduler)
    run.synthetic_step(RESHARD_STEPS)
    try:
        return {"params": run.master_params(), "tp_rank": run.tp_rank}
    finally:
        run.close()


def _load_then_step(rank: int, world_size: int, layout: Layout, directory: str) -> dict:
    run = GPTRun(layout)
    try:
        iteration = load_checkpoint(directory, [run.model], run.optimizer, run.scheduler).iteration
        run.synthetic_step(iteration)
        return {"params": run.master_params(), "tp_rank": run.tp_rank}
    finally:
        run.close()


def _global_params(results: list[dict], tp: int) -> dict:
    shards = [r["params"] for r in results[:tp]]  # parallel_state: ranks 0..tp-1 are one TP group
    assert [r["tp_rank"] for r in results[:tp]] == list(range(tp))
    return assemble(shards)


SOURCES = {  # name: (layout, world size)
    "TP2": (Layout(tp=2), 2),
    "TP1": (Layout(), 1),
    "DP2": (Layout(), 2),
    "DP2 layer-wise": (Layout(layer_wise=True), 2),
    "bf16": (Layout(bf16=True), 1),
    "adam TP2 layer-wise DP2": (Layout("adam", tp=2, layer_wise=True), 4),
    # The precision-aware optimizer: bf16 moments, and with bf16 parameters remainders.
    "TP2 bf16 bf16-state": (Layout(tp=2, bf16=True, bf16_state=True), 2),
    "adam DP2 layer-wise bf16-state": (Layout("adam", layer_wise=True, bf16_state=True), 2),
}
RESHARDINGS = [  # (source, target layout, target world size)
    ("TP2", Layout(), 1),
    ("TP1", Layout(tp=2), 2),
    ("DP2", Layout(), 1),
    ("TP1", Layout(), 4),
    ("DP2 layer-wise", Layout(), 2),
    ("DP2", Layout(layer_wise=True), 2),
    ("bf16", Layout(), 1),
    ("TP1", Layout(bf16=True), 1),
    ("adam TP2 layer-wise DP2", Layout("adam"), 1),
    ("TP2 bf16 bf16-state", Layout(bf16=True, bf16_state=True), 1),
    ("adam DP2 layer-wise bf16-state", Layout("adam", tp=2, bf16_state=True), 2),
]


def test_checkpoints_reshard_across_tp_dp_layer_wise_and_precision(run_distributed, tmp_path) -> None:
    continued = {}
    for name, (layout, world_size) in SOURCES.items():
        directory = str(tmp_path / name.replace(" ", "_"))
        results = run_distributed(_save_then_continue, world_size=world_size, args=(layout, directory))
        continued[name] = (_global_params(results, layout.tp), directory)
    for source, layout, world_size in RESHARDINGS:
        expected, directory = continued[source]
        results = run_distributed(_load_then_step, world_size=world_size, args=(layout, directory))
        actual = _global_params(results, layout.tp)
        errors = {name: (actual[name] - value).abs().max().item() for name, value in expected.items()}
        assert set(actual) == set(expected)
        worst = max(errors.values())
        assert worst < 1e-6, (source, layout.describe(world_size), sorted(errors.items(), key=lambda e: -e[1])[:3])


def _normuon_body(rank: int, world_size: int, directory: str, save: bool) -> dict:
    """NorMuon's second moment ((rows, 1) or (1, cols)) is not parameter-shaped: kept per TP rank."""
    if save:
        run = _train(Layout("normuon", tp=2), 0, 2)
        save_checkpoint(directory, 2, [run.model], run.optimizer, run.scheduler)
        expected = run.optimizer.state_dict()
        run.close()
        resumed = GPTRun(Layout("normuon", tp=2))
        load_checkpoint(directory, [resumed.model], resumed.optimizer, resumed.scheduler)
        differences = _differences(expected, resumed.optimizer.state_dict())
        resumed.close()
        return {"differences": differences}
    run = GPTRun(Layout("normuon", tp=1))
    try:
        load_checkpoint(directory, [run.model], run.optimizer, run.scheduler)
        return {"error": None}
    except CheckpointError as error:
        return {"error": str(error)}
    finally:
        run.close()


def test_state_of_tp_shards_that_is_not_parameter_shaped_reloads_only_at_its_tp(run_distributed, tmp_path) -> None:
    for result in run_distributed(_normuon_body, world_size=2, args=(str(tmp_path), True)):
        assert not result["differences"], result["differences"][:5]
    [result] = run_distributed(_normuon_body, world_size=1, args=(str(tmp_path), False))
    assert result["error"] and "cannot be resharded" in result["error"] and "--no-load-optim" in result["error"]


# ------------------------------------------------------------------------------------------------
# A save killed midway
# ------------------------------------------------------------------------------------------------


def _die_before_commit(rank: int, world_size: int, directory: str) -> None:
    run = _train(Layout(), 0, 3)
    save_checkpoint(directory, 3, [run.model], run.optimizer, run.scheduler)
    for step in range(3, 6):
        run.train_step(step)

    def kill_rank_1(path: str) -> None:
        if rank == 1:  # every file is written, the directory not yet renamed into place
            os.kill(os.getpid(), signal.SIGKILL)

    save_checkpoint(directory, 6, [run.model], run.optimizer, run.scheduler, before_commit=kill_rank_1)


def _resume_after_kill(rank: int, world_size: int, directory: str) -> dict:
    found = {"latest": os.path.basename(latest_checkpoint(directory)),
             "leftover": sorted(n for n in os.listdir(directory) if n.startswith("."))}
    straight = _train(Layout(), 0, 6)
    expected = _params(straight)
    straight.close()
    resumed = _train(Layout(), 0, 6, directory, load=True)
    found["differences"] = _differences(expected, _params(resumed))
    save_checkpoint(directory, 6, [resumed.model], resumed.optimizer, resumed.scheduler)  # over the leftovers
    resumed.close()
    found["after_resave"] = (os.path.basename(latest_checkpoint(directory)), sorted(os.listdir(directory)))
    return found


def test_rank_killed_during_save_leaves_previous_checkpoint(run_distributed, tmp_path) -> None:
    with pytest.raises(DistributedRunError):
        run_distributed(_die_before_commit, world_size=2, args=(str(tmp_path),), timeout=120)
    for found in run_distributed(_resume_after_kill, world_size=2, args=(str(tmp_path),)):
        assert found["latest"] == "iter_0000003"
        assert found["leftover"] == [".iter_0000006.incomplete", ".save_lock"]  # the lock file stays, unlocked
        assert not found["differences"], found["differences"][:5]
        assert found["after_resave"] == ("iter_0000006", [".save_lock", "iter_0000003", "iter_0000006", "latest"])


# ------------------------------------------------------------------------------------------------
# Refusals: each names what is wrong; nothing is loaded
# ------------------------------------------------------------------------------------------------


def _damage(path: str, how: str) -> None:
    if how == "manifest":
        os.remove(os.path.join(path, "megatron_eopt.json"))
        return
    data_file = os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0])
    with open(data_file, "r+b") as f:
        if how == "truncate":
            f.truncate(os.path.getsize(data_file) // 2)
        else:  # flip one byte in the middle
            f.seek(os.path.getsize(data_file) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


def _refusals_body(rank: int, world_size: int, directory: str) -> dict:
    adam = _train(Layout("adam"), 0, 2)
    adam_dir = os.path.join(directory, "adam")
    saved = _params(adam)
    save_checkpoint(adam_dir, 2, [adam.model], adam.optimizer, adam.scheduler)
    adam.close()
    messages = {}

    def attempt(case: str, run: GPTRun, path: str, **kwargs) -> None:
        before = {"params": _params(run), "optimizer": run.optimizer.state_dict()}
        try:
            load_checkpoint(path, [run.model], run.optimizer, run.scheduler, **kwargs)
            messages[case] = None
        except CheckpointError as error:
            messages[case] = str(error)
        after = {"params": _params(run), "optimizer": run.optimizer.state_dict()}
        messages[case + " changed"] = _differences(before, after)

    muon = _train(Layout("muon"), 0, 1)
    attempt("adam into muon", muon, adam_dir)
    load_checkpoint(adam_dir, [muon.model], muon.optimizer, load_optimizer=False)
    messages["model only"] = _differences(saved, _params(muon))
    muon.close()

    other_groups = GPTRun(Layout("adam"), decoupled_lr=1e-3)  # embedding/output get their own group
    attempt("other groups", other_groups, adam_dir)
    other_groups.close()

    for how in ("flip", "truncate", "manifest"):
        damaged = os.path.join(directory, how)
        shutil.copytree(adam_dir, damaged)
        _damage(os.path.join(damaged, "iter_0000002"), how)
        run = GPTRun(Layout("adam"))
        attempt(how, run, damaged)
        run.close()
    run = GPTRun(Layout("adam"))
    attempt("no checkpoint", run, os.path.join(directory, "nothing"))
    run.close()
    return messages


def test_refusals_name_the_problem_and_load_nothing(run_distributed, tmp_path) -> None:
    [messages] = run_distributed(_refusals_body, world_size=1, args=(str(tmp_path),))
    expected = {
        "adam into muon": ["changed since the checkpoint was saved", "allow_optimizer_change_on_load", "--no-load-optim"],
        "other groups": ["param groups of 'dense' differ", "--no-load-optim"],
        "flip": ["fails its checksum"],
        "truncate": ["truncated"],
        "manifest": ["not a complete megatron_eopt checkpoint"],
        "no checkpoint": ["no checkpoint in", "latest"],
    }
    for case, fragments in expected.items():
        assert messages[case] is not None, case
        for fragment in fragments:
            assert fragment in messages[case], (case, messages[case])
        assert not messages[case + " changed"], (case, messages[case + " changed"][:3])
    assert not messages["model only"], messages["model only"][:3]


def _agree_body(rank: int, world_size: int) -> str:
    from megatron_eopt.checkpointing import storage

    def plan() -> int:
        if rank == 1:
            raise ValueError("shape mismatch on this rank only")
        return 7

    try:
        storage.agree(plan, torch.distributed.group.WORLD)  # the job here is the whole world
        return "no error"
    except ValueError as error:
        return f"{type(error).__name__}: {error}"


def test_an_error_on_one_rank_stops_every_rank(run_distributed) -> None:
    """Otherwise the other ranks would enter the collective read alone and hang."""
    rank0, rank1 = run_distributed(_agree_body, world_size=2)
    assert rank0 == "CheckpointError: loading stopped on every rank: rank 1: shape mismatch on this rank only"
    assert rank1 == "ValueError: shape mismatch on this rank only"


# ------------------------------------------------------------------------------------------------
# RNG states per rank: restored at the saved layout, left alone (and said) at another
# ------------------------------------------------------------------------------------------------


def _rng_body(rank: int, world_size: int, directory: str, save: bool) -> dict:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    kept = tracker.get_states()
    run = GPTRun(Layout("adam"))
    try:
        seed = 100 + rank if save else 999  # each rank its own stream, as megatron-core seeds them
        tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(seed).get_state()})
        torch.manual_seed(seed)
        messages = ()
        if save:
            save_checkpoint(directory, 1, [run.model], run.optimizer, run.scheduler)
        else:
            messages = load_checkpoint(directory, [run.model], run.optimizer, run.scheduler).messages
        tracker_generator = torch.Generator()
        tracker_generator.set_state(tracker.get_states()["model-parallel-rng"])
        return {"tracker": torch.rand(3, generator=tracker_generator), "cpu": torch.rand(3), "messages": messages}
    finally:
        run.close()
        tracker.set_states(kept)


def test_rng_states_are_per_rank_and_restored_only_at_the_saved_layout(run_distributed, tmp_path) -> None:
    directory = str(tmp_path)
    saved = run_distributed(_rng_body, world_size=2, args=(directory, True))
    assert not torch.equal(saved[0]["tracker"], saved[1]["tracker"])
    for rank, loaded in enumerate(run_distributed(_rng_body, world_size=2, args=(directory, False))):
        assert torch.equal(loaded["tracker"], saved[rank]["tracker"]) and torch.equal(loaded["cpu"], saved[rank]["cpu"])
        assert loaded["messages"] == ()
    [resharded] = run_distributed(_rng_body, world_size=1, args=(directory, False))
    untouched = torch.Generator().manual_seed(999)
    assert torch.equal(resharded["tracker"], torch.rand(3, generator=untouched))  # this run's own seeding
    assert resharded["messages"] == ("RNG states not restored: saved at world size 2 with TP 1, this run has "
                                     "world size 1 with TP 1; the RNGs keep this run's seeding",)


# ------------------------------------------------------------------------------------------------
# Asynchronous saves at 2 ranks: the writing thread's own group
# ------------------------------------------------------------------------------------------------


def _async_groups_body(rank: int, world_size: int, directory: str) -> dict:
    """Two saves, each with a save group made for it and destroyed after, as two runs in one
    process would. Rank 1 makes the second group late: a group made again under the first one's
    name would read the first one's rendezvous addresses and hang (torch names a group made with
    use_local_synchronization after its ranks and the number of live groups)."""
    import time

    from megatron_eopt.checkpointing import new_save_group, start_save_checkpoint
    from megatron_eopt.checkpointing.state import checkpoint_group
    from megatron_eopt.runtime.process_groups import resolve_parallel_groups

    run = GPTRun(Layout("adam"))
    try:
        run.train_step(0)
        refusals = []
        for wrong in (None, checkpoint_group(resolve_parallel_groups(None))):
            try:
                start_save_checkpoint(directory, 1, [run.model], run.optimizer, background_group=wrong)
            except ValueError as error:
                refusals.append(str(error))
        paths = []
        for iteration in (1, 2):
            if rank == 1 and iteration == 2:
                time.sleep(2.0)
            group = new_save_group([run.model])
            paths.append(start_save_checkpoint(directory, iteration, [run.model], run.optimizer,
                                               background_group=group).wait())
            torch.distributed.destroy_process_group(group)
        return {"refusals": refusals, "paths": paths, "latest": latest_checkpoint(directory)}
    finally:
        run.close()


def test_async_saves_need_a_group_of_their_own_made_once_per_run(run_distributed, tmp_path) -> None:
    for found in run_distributed(_async_groups_body, world_size=2, args=(str(tmp_path),), timeout=120):
        assert found["paths"] == [str(tmp_path / "iter_0000001"), str(tmp_path / "iter_0000002")]
        assert found["latest"] == str(tmp_path / "iter_0000002")
        assert len(found["refusals"]) == 2
        assert "written by 2 ranks, so it needs background_group=" in found["refusals"][0]
        assert "background_group is the checkpoint group itself" in found["refusals"][1]
