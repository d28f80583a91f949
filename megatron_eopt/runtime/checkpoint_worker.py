"""megatron-core's torch_dist checkpoint writers in Megatron-LM's loop, patched at run time (never
by editing the installed package) where megatron-core 0.19 fails or waits forever, with any optimizer.

`install()` (scripts/pretrain_gpt_megatron_lm.py calls it) rebinds:
- `filesystem_async._process_memory`: the writer logs its process's memory with psutil, which
  megatron-core does not require: without it every save failed. It reads /proc instead.
- `PersistentAsyncCaller.async_loop` (`--async-save --use-persistent-ckpt-worker`): the worker is a
  process of its own, started with forkserver, which has none of the process's patches. It died in
  `torch.cuda.set_device(rank % torch.cuda.device_count())` on CPU (ZeroDivisionError) and without
  psutil in its writes. `persistent_checkpoint_worker` installs them in the worker first.
- `PersistentAsyncCaller.is_current_async_call_done`: megatron-core waits for the worker's number
  of each finished save on a queue and never asks whether the worker lives, so a dead worker
  (killed, out of memory, a crash) left the loop waiting forever in the finalization that waits
  for the save (before the next save, at the end of the run, on an exit signal). Here a dead
  worker's save counts as done but failed: its rank prints one line naming the worker, and
  megatron-core's finalization raises its CheckpointException on every rank, before `latest`
  names the save (the previous checkpoint stays the latest).
"""

import os
import queue
import sys
import time
from typing import Any, Callable, Optional

from megatron_eopt.runtime import megatron_lm_cpu
from megatron_eopt.runtime.cpu_stand_ins import replace_names

POLL_SECONDS = 0.1  # megatron-core's own polling interval in the same wait
_undo: list = []  # set once installed (for the process's life)
_megatron_core_worker_loop: Optional[Callable[..., None]] = None  # what persistent_checkpoint_worker runs


def install() -> None:
    """Rebind the names above; idempotent."""
    if _undo:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    global _megatron_core_worker_loop
    _megatron_core_worker_loop = PersistentAsyncCaller.async_loop
    replaced = [(PersistentAsyncCaller, "async_loop", persistent_checkpoint_worker),
                (PersistentAsyncCaller, "is_current_async_call_done",
                 _failing_when_the_worker_died(PersistentAsyncCaller.is_current_async_call_done))]
    if not filesystem_async.HAVE_PSUTIL:
        replaced.append((filesystem_async, "_process_memory", resident_bytes))
    _undo.extend(replace_names(replaced))


def resident_bytes() -> int:
    """What psutil.Process().memory_info().rss gives, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def persistent_checkpoint_worker(*args: Any, **kwargs: Any) -> None:
    """megatron-core's persistent checkpoint worker loop with the process's patches installed first:
    the CPU patch (runtime/megatron_lm_cpu.py; nothing with CUDA) and install()'s. The worker
    process finds this function by its name, so it runs in a process that has neither."""
    megatron_lm_cpu.install()
    install()
    _megatron_core_worker_loop(*args, **kwargs)


def _failing_when_the_worker_died(is_current_async_call_done: Callable[..., bool]) -> Callable[..., bool]:
    def failing_when_the_worker_died(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if self.process is not None and self.cur_item is None:
            self.cur_item = _completion_or_failure(self, blocking)
        return is_current_async_call_done(self, blocking, no_dist)

    return failing_when_the_worker_died


def _completion_or_failure(caller: Any, blocking: bool) -> Optional[Any]:
    """The number the worker put on its completion queue; "failed" when the worker died without
    putting it; None while it is still writing (at once unless `blocking`)."""
    while True:
        try:
            return caller._persistent_comp_q.get_nowait()
        except queue.Empty:
            pass
        worker = caller._persistent_process
        if not worker.is_alive():
            try:  # it may have put the number just before it ended
                return caller._persistent_comp_q.get_nowait()
            except queue.Empty:
                _forget_dead_worker(caller, worker)
                return "failed"
        if not blocking:
            return None
        time.sleep(POLL_SECONDS)


def _forget_dead_worker(caller: Any, worker: Any) -> None:
    """Say which worker died, fail its save, and drop it (close() would wait for it forever)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    message = (f"rank {rank}: megatron-core's persistent checkpoint worker (--use-persistent-ckpt-worker, "
               f"pid {worker.pid}) ended with exit code {worker.exitcode} before finishing its save; "
               "the save fails on every rank and `latest` keeps naming the previous checkpoint")
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    _put_failure_in_write_results(RuntimeError(message))
    caller.process = None
    owner = type(caller)
    owner._persistent_process = owner._persistent_queue = owner._persistent_preload_q = None
    owner._persistent_comp_q = None


def _put_failure_in_write_results(error: Exception) -> None:
    """The torch_dist writer's finalization reads this rank's write results from one queue and turns
    an exception there into the save's failure on every rank; a dead worker put none."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = filesystem_async._results_queue
    if results is not None and results.empty():
        results.put(error)
