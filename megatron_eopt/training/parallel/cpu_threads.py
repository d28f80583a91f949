"""CPU threads per process: torch's default oversubscribes busy CPUs.

torch starts one OpenMP thread per CPU. Muon's Newton-Schulz runs hundreds of small matrix
products per step, each a parallel region whose threads wait for one another; when other work
keeps the CPUs busy, a thread that is not scheduled stalls every region (measured on 2 busy
CPUs: a 64x256 bf16 product took 24 ms with 2 threads, 0.3 ms with 1; a Muon run 300-1,400
against 15-19 ms/it). torchrun sets OMP_NUM_THREADS=1 for several processes per node; a direct
run gets the CPUs this process may use, divided by the local processes, less those the load
average says other work keeps busy, at least 1; the start-up line says what was chosen and why.
A given OMP_NUM_THREADS is kept, with a line when it oversubscribes the CPUs that says what fits:
fewer threads, or fewer processes where even one thread each is too many.
"""

import os
from typing import Optional


def choose_cpu_threads(omp_num_threads: Optional[str], cpus: int, total_cpus: int, local_processes: int,
                       load_average: float) -> tuple[Optional[int], str]:
    """(threads to set, None to keep; the line to print). `cpus`: this process's (affinity),
    `total_cpus`: the machine's (the load average counts all of them)."""
    local_processes = max(1, local_processes)
    busy = load_average * cpus / max(total_cpus, cpus)  # other work's share of this process's CPUs
    if omp_num_threads:
        wanted = int(omp_num_threads) * local_processes
        if wanted > cpus:
            return None, (f"OMP_NUM_THREADS={omp_num_threads} x {local_processes} process(es) = {wanted} threads "
                          f"on {cpus} CPUs: oversubscribed, small CPU operations (Muon's Newton-Schulz) "
                          f"slow down many times; {_what_fits(cpus, local_processes)}")
        return None, ""
    free = cpus - busy
    threads = max(1, min(cpus // local_processes, round(free / local_processes)))
    return threads, (f"CPU threads per process: {threads} ({cpus} CPUs, {local_processes} process(es), load average "
                     f"{load_average:.1f}"
                     f"{f' of {total_cpus} CPUs' if total_cpus != cpus else ''}: more threads than free CPUs "
                     f"stall each other); OMP_NUM_THREADS=N chooses")


def _what_fits(cpus: int, local_processes: int) -> str:
    """The advice for an oversubscribed OMP_NUM_THREADS: fewer threads, or where even one thread per
    process is too many, fewer processes."""
    if cpus >= local_processes:
        return f"OMP_NUM_THREADS={cpus // local_processes} fits"
    return f"no OMP_NUM_THREADS fits {local_processes} processes: at most {cpus} per node do"


def set_cpu_threads(on_cuda: bool, say) -> None:
    """Apply `choose_cpu_threads` to this process (CPU runs only) and `say` its line."""
    if on_cuda:
        return
    import torch

    threads, line = choose_cpu_threads(
        os.environ.get("OMP_NUM_THREADS"), len(os.sched_getaffinity(0)), os.cpu_count() or 1,
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")), os.getloadavg()[0])
    if threads is not None:
        torch.set_num_threads(threads)
    if line:
        say(line)
