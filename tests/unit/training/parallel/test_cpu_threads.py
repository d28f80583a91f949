"""CPU threads per process (training/parallel/cpu_threads.py): as torchrun does for several
processes, and fewer than the CPUs when other work keeps them busy; a given OMP_NUM_THREADS is
kept, with a line when it oversubscribes the CPUs that says what fits: fewer threads, or fewer
processes where even one thread each is too many."""

import pytest

from megatron_eopt.training.parallel import cpu_threads
from megatron_eopt.training.parallel.cpu_threads import choose_cpu_threads


@pytest.mark.parametrize("cpus,total,processes,load,expected", [
    (2, 2, 1, 0.2, 2),  # an idle 2-CPU machine: both
    (2, 2, 1, 9.0, 1),  # busy with other work: one (2 threads took 24 ms per small product, 1 thread 0.3)
    (2, 2, 1, 0.8, 1),  # one CPU's worth busy
    (16, 16, 4, 0.0, 4),  # 4 local processes share 16 idle CPUs
    (16, 16, 4, 8.0, 2),  # half of them busy
    (2, 2, 4, 0.0, 1),  # never below 1
    (4, 64, 1, 32.0, 2),  # a 4-CPU slice of a 64-CPU host at half load: its share is 2 busy CPUs
])
def test_threads_follow_free_cpus(cpus, total, processes, load, expected) -> None:
    threads, line = choose_cpu_threads(None, cpus, total, processes, load)
    assert threads == expected
    assert line.startswith(f"CPU threads per process: {expected} ({cpus} CPUs, {processes} process(es), "
                           f"load average {load:.1f}") and line.endswith("OMP_NUM_THREADS=N chooses")


def test_a_given_omp_num_threads_is_kept_and_oversubscription_said() -> None:
    assert choose_cpu_threads("1", 2, 2, 2, 9.0) == (None, "")
    threads, line = choose_cpu_threads("2", 2, 2, 2, 0.0)
    assert threads is None
    assert line.startswith("OMP_NUM_THREADS=2 x 2 process(es) = 4 threads on 2 CPUs: oversubscribed")
    assert line.endswith("OMP_NUM_THREADS=1 fits")


def test_more_processes_than_cpus_are_advised_fewer_processes_not_the_threads_already_set() -> None:
    """3 ranks at OMP_NUM_THREADS=1 on 2 CPUs: no thread count fits, so the advice is fewer ranks."""
    for given in ("1", "2"):
        threads, line = choose_cpu_threads(given, 2, 2, 3, 0.0)
        assert threads is None and line.startswith(f"OMP_NUM_THREADS={given} x 3 process(es) = ")
        assert "OMP_NUM_THREADS=1 fits" not in line and line.endswith(
            "no OMP_NUM_THREADS fits 3 processes: at most 2 per node do"), line


def test_set_cpu_threads_applies_the_choice_on_cpu_only(monkeypatch) -> None:
    import torch

    said, set_to = [], []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    cpu_threads.set_cpu_threads(True, said.append)
    assert said == [] and set_to == []
    cpu_threads.set_cpu_threads(False, said.append)
    assert set_to == [1] and len(said) == 1 and said[0].startswith("CPU threads per process: 1 (2 CPUs")
