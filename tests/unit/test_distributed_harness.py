"""Tests of the multi-process gloo harness behind the ``run_distributed`` fixture."""

import os
import time

import pytest
import torch
import torch.distributed as dist

# Bodies run in the worker processes; they must be module-level so workers can import them.


def _all_reduce_sum(rank: int, world_size: int, scale: float) -> float:
    tensor = torch.tensor([float(rank) * scale])
    dist.all_reduce(tensor)
    return tensor.item()


def _rank_report(rank: int, world_size: int) -> tuple[int, int, int, int]:
    return rank, world_size, dist.get_rank(), dist.get_world_size()


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure from the test body")
    return rank


def _rank_zero_waits_alone(rank: int, world_size: int) -> int:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a deadlock
    return rank


def _init_tensor_parallel(rank: int, world_size: int) -> tuple[int, int]:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _model_parallel_state(rank: int, world_size: int) -> tuple[bool, int]:
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    live_groups = len(getattr(distributed_c10d, "_world").pg_map)
    return parallel_state.model_parallel_is_initialized(), live_groups


def _perturb_rng_and_dtype(rank: int, world_size: int) -> None:
    torch.rand(100)
    torch.set_default_dtype(torch.float64)


def _rng_and_dtype(rank: int, world_size: int) -> tuple[float, torch.dtype]:
    return torch.rand(1).item(), torch.get_default_dtype()


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _add(rank: int, world_size: int, offset: int, *, factor: int = 1) -> int:
    return (rank + offset) * factor


def _print_rank(rank: int, world_size: int) -> None:
    print(f"hello from rank {rank}")


_KEPT_GROUPS: list = []


def _keep_a_group(rank: int, world_size: int) -> None:
    """A deliberate leak: a group used, destroyed by the harness, but still referenced here."""
    group = dist.new_group(list(range(world_size)))
    dist.all_reduce(torch.ones(1), group=group)
    _KEPT_GROUPS.append(group)


_MANAGERS = []


def _start_a_manager(rank: int, world_size: int) -> int:
    """A multiprocessing Manager kept for the worker's life, as megatron-core's torch_dist writer keeps one."""
    import multiprocessing

    _MANAGERS.append(multiprocessing.get_context("fork").Manager())
    return _MANAGERS[-1]._process.pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _many_groups_at_once(rank: int, world_size: int, count: int) -> int:
    """`count` gloo groups alive together (3 threads each), each used, all destroyed before returning."""
    groups = [dist.new_group(list(range(world_size))) for _ in range(count)]
    for group in groups:
        dist.all_reduce(torch.ones(1), group=group)
    for group in groups:
        dist.destroy_process_group(group)
    return len(groups)


def _groups_released_by_the_reset(rank: int, world_size: int) -> None:
    """What the suite's calls do and the harness undoes: megatron-core's parallel state twice (its
    teardown forgets only some groups), and a DTensor op on a mesh of new groups (DTensor's caches
    key on the mesh)."""
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    for _ in range(2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        parallel_state.destroy_model_parallel()
    mesh = init_device_mesh("cpu", (world_size,))
    (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).full_tensor()


def _threads(rank: int, world_size: int) -> int:
    return sum(1 for _ in os.scandir("/proc/self/task"))


def _start_a_thread_that_ends_late(rank: int, world_size: int, seconds: float) -> None:
    """On rank 0, a thread that runs (never asleep: one call that releases the GIL, as a native thread
    runs) for about `seconds` of CPU after the call returns, then ends, as a destroyed group's joined
    threads end late on a loaded machine."""
    import hashlib
    import threading

    if rank:
        return
    deadline = time.monotonic() + seconds  # by the clock, not a calibrated amount of work: it ends no sooner

    def run_until_the_deadline() -> None:
        while time.monotonic() < deadline:
            hashlib.pbkdf2_hmac("sha256", b"key", b"salt", 2_000)  # releases the GIL: running, not asleep

    threading.Thread(target=run_until_the_deadline, daemon=True).start()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sum_reaches_every_rank(run_distributed, world_size):
    results = run_distributed(_all_reduce_sum, world_size=world_size, args=(3.0,))
    assert results == [3.0 * sum(range(world_size))] * world_size


def test_results_come_back_in_rank_order(run_distributed):
    assert run_distributed(_rank_report, world_size=4) == [(r, 4, r, 4) for r in range(4)]


def test_args_and_kwargs_reach_the_function(run_distributed):
    assert run_distributed(_add, world_size=2, args=(10,), kwargs={"factor": 2}) == [20, 22]


def test_exception_on_one_rank_names_the_rank_and_world_recovers(run_distributed):
    with pytest.raises(RuntimeError, match=r"failed on rank 1\b") as excinfo:
        run_distributed(_raise_on_rank_one, world_size=2)
    message = str(excinfo.value)
    assert "ValueError: deliberate failure from the test body" in message
    assert "_raise_on_rank_one" in message  # the rank's traceback, not just the message
    assert "rank 0 traceback" not in message
    assert run_distributed(_all_reduce_sum, world_size=2, args=(1.0,)) == [1.0, 1.0]


@pytest.mark.timeout(180)  # if the harness itself hangs, fail well before the global 900 s
def test_deadlock_times_out_instead_of_hanging_and_world_recovers(run_distributed):
    run_distributed(_pid, world_size=2)  # keep the one-off worker start-up out of the timing
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 3 s: rank 0 did not finish") as exc:
        run_distributed(_rank_zero_waits_alone, world_size=2, timeout=3)
    assert time.monotonic() - started < 30
    assert "_rank_zero_waits_alone" in str(exc.value)  # the stuck rank's stack
    assert run_distributed(_all_reduce_sum, world_size=2, args=(1.0,)) == [1.0, 1.0]


def test_megatron_parallel_state_does_not_leak_into_the_next_call(run_distributed):
    assert run_distributed(_init_tensor_parallel, world_size=2) == [(2, 0), (2, 1)]
    # Only the default WORLD group survives between calls.
    assert run_distributed(_model_parallel_state, world_size=2) == [(False, 1)] * 2


def test_groups_die_with_the_call_and_the_world_stays(run_distributed):
    """After megatron-core's and DTensor's groups, a worker holds a fresh worker's threads."""
    first = run_distributed(_pid, world_size=2)
    fresh = run_distributed(_threads, world_size=2)
    run_distributed(_groups_released_by_the_reset, world_size=2)
    assert run_distributed(_threads, world_size=2) == fresh
    assert run_distributed(_pid, world_size=2) == first


def test_a_thread_on_its_way_out_is_waited_for_not_timed_out(run_distributed, monkeypatch):
    """The leak check waits for a running thread to end, however long past its grace for sleeping ones,
    instead of calling it a leak when a fixed wait ran out (a flake under load). The grace is shortened
    here (LEAK_GRACE_ENV) so that the thread need not run for seconds."""
    from tests.distributed_harness import LEAK_GRACE_ENV, STRICT_LEAKS_ENV

    monkeypatch.delenv(STRICT_LEAKS_ENV, raising=False)  # strict: a leak would raise ThreadLeakError
    monkeypatch.setenv(LEAK_GRACE_ENV, "0.1")
    first = run_distributed(_pid, world_size=2)
    started = time.monotonic()
    run_distributed(_start_a_thread_that_ends_late, world_size=2, args=(0.6,))
    assert time.monotonic() - started > 0.6  # the thread outlived the grace, and no ThreadLeakError
    assert run_distributed(_pid, world_size=2) == first  # nor was the world replaced


def test_a_thread_that_names_itself_after_the_baseline_is_no_new_thread(monkeypatch):
    """A native thread names itself once it runs (gloo's pt_gloo_runloop): one that had not run when a fresh
    worker's threads were counted was counted under the process's name, and later looked like a leak."""
    from collections import Counter

    from tests import distributed_harness as harness

    main = harness._MAIN_THREAD_NAME
    baseline = Counter({main: 3, "gloo_tcp_loop": 1, "pt_gloo_runloop": 1})
    monkeypatch.setattr(harness, "_thread_census", lambda: Counter({main: 2, "gloo_tcp_loop": 1, "pt_gloo_runloop": 2}))
    assert harness._extra_threads(baseline) == Counter()
    held = Counter({main: 2, "gloo_tcp_loop": 2, "pt_gloo_runloop": 4})  # renamed, and a group held
    monkeypatch.setattr(harness, "_thread_census", lambda: held)
    extra = harness._extra_threads(baseline)
    assert extra["gloo_tcp_loop"] >= 1 and sum(extra.values()) == 3, extra
    monkeypatch.setattr(harness, "_thread_census", lambda: Counter({main: 4, "gloo_tcp_loop": 1, "pt_gloo_runloop": 1}))
    assert harness._extra_threads(baseline) == Counter({main: 1})  # a thread that never names itself


def test_a_call_that_keeps_a_group_alive_fails_naming_the_test(run_distributed, monkeypatch, capsys):
    from tests.distributed_harness import STRICT_LEAKS_ENV, ThreadLeakError

    monkeypatch.delenv(STRICT_LEAKS_ENV, raising=False)  # strict unless "0"
    first = run_distributed(_pid, world_size=2)
    with pytest.raises(ThreadLeakError) as exc:
        run_distributed(_keep_a_group, world_size=2)
    message = str(exc.value)
    assert "test_a_call_that_keeps_a_group_alive_fails_naming_the_test leaked" in message, message
    assert "_keep_a_group" in message and "1 gloo group(s) still alive" in message, message
    assert "module test_distributed_harness -> dict -> list -> ProcessGroup" in message, message  # the holder
    assert sorted(exc.value.failures) == [0, 1]
    # The leaking world is replaced; the next call runs in fresh workers.
    second = run_distributed(_pid, world_size=2)
    assert set(second).isdisjoint(first)
    # Relaxed: the same leak replaces the world and names the holder in the test's output.
    monkeypatch.setenv(STRICT_LEAKS_ENV, "0")
    capsys.readouterr()
    run_distributed(_keep_a_group, world_size=2)
    printed = capsys.readouterr().out
    assert "replaced the world after" in printed and "module test_distributed_harness -> dict" in printed, printed
    assert set(run_distributed(_pid, world_size=2)).isdisjoint(second)


def test_processes_a_worker_started_end_with_it(run_distributed):
    """A replaced world's workers are killed, and the processes they started end too: the zygote
    adopts them (child subreaper) and kills them (else init inherits them: megatron-core's
    Manager, ~0.5 GB each, piled up over a suite, 48 of them here). A call that says it leaves
    groups held (`leaves_groups`) has its world replaced without a leak check."""
    managers = run_distributed(_start_a_manager, world_size=2)
    assert all(_alive(pid) for pid in managers)
    first = run_distributed(_pid, world_size=2)
    run_distributed(_keep_a_group, world_size=2, leaves_groups=True)  # no ThreadLeakError: the world is replaced
    assert set(run_distributed(_pid, world_size=2)).isdisjoint(first)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in managers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in managers), managers


def test_a_call_over_the_thread_budget_fails_naming_the_test(run_distributed):
    """Groups alive at once within a call count too, even if the call destroys them all."""
    from tests.distributed_harness import THREAD_BUDGET, ThreadLeakError

    with pytest.raises(ThreadLeakError) as exc:
        run_distributed(_many_groups_at_once, world_size=2, args=(THREAD_BUDGET // 3 + 1,))
    message = str(exc.value)
    assert "test_a_call_over_the_thread_budget_fails_naming_the_test went over the suite's thread budget" in message
    assert "_many_groups_at_once" in message and f"more than {THREAD_BUDGET} threads" in message, message
    assert run_distributed(_many_groups_at_once, world_size=2, args=(5,)) == [5, 5]  # a few are fine


def test_rng_and_default_dtype_are_reset_between_calls(run_distributed):
    expected = torch.rand(1, generator=torch.Generator().manual_seed(1234)).item()
    run_distributed(_perturb_rng_and_dtype, world_size=2)
    assert run_distributed(_rng_and_dtype, world_size=2) == [(expected, torch.float32)] * 2


def test_workers_are_reused_between_calls(run_distributed):
    first = run_distributed(_pid, world_size=2)
    assert run_distributed(_pid, world_size=2) == first
    assert len(set(first)) == 2 and os.getpid() not in first


def test_worker_output_is_replayed_in_the_calling_test(run_distributed, capsys):
    run_distributed(_print_rank, world_size=2)
    out = capsys.readouterr().out
    assert "---- rank 1 output ----\nhello from rank 1\n" in out
    assert out.index("hello from rank 0") < out.index("hello from rank 1")


def test_lambda_and_nested_functions_are_rejected(run_distributed):
    def nested(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda rank, world_size: rank, world_size=2)
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(nested, world_size=2)


def test_world_size_below_one_is_rejected(run_distributed):
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_distributed(_pid, world_size=0)
