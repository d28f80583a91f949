"""Megatron-LM's asynchronous and non-persistent saves (megatron-core 0.19), patched at run time
where they fail, wait forever or lose the last checkpoint, with any optimizer (docs/reliability.md).

`install()` (scripts/pretrain_gpt_megatron_lm.py calls it) rebinds:
- `filesystem_async._process_memory`: /proc instead of psutil, which megatron-core does not require;
- `PersistentAsyncCaller.async_loop` (`--use-persistent-ckpt-worker`): the worker, a forkserver
  process without the process's patches, installs them first (on CPU it died in set_device);
- `PersistentAsyncCaller`'s waits for the worker (a save's completion, the hand-over of its
  tensors), which never asked whether the worker lives: a dead worker's rank says so in one line,
  and each save it did not finish fails on every rank through megatron-core's own
  CheckpointException, before `latest` names it;
- `checkpointing.cleanup_old_non_persistent_checkpoint`: it deleted the checkpoint `latest` names
  while an async save was in flight; now it removes only checkpoints older than that one;
- `filesystem_async.get_write_results_queue` in a synchronous torch_dist save: an in-process queue,
  not a spawned multiprocessing Manager server (write_results_queue).
"""

import os
import pathlib
import queue
import re
import shutil
import sys
import threading
import time
from typing import Any, Callable, Optional

from megatron_eopt.runtime import megatron_lm_cpu
from megatron_eopt.runtime.cpu_stand_ins import replace_names

POLL_SECONDS = 0.1  # megatron-core's own polling interval in the same wait
_undo: list = []  # set while installed (a loop keeps it for the process's life; uninstall() empties it)
_megatron_core_worker_loop: Optional[Callable[..., None]] = None  # what persistent_checkpoint_worker runs
_megatron_core_results_queue: Optional[Callable[..., Any]] = None  # what write_results_queue calls when asynchronous
_synchronous_save = threading.local()  # .active: a synchronous torch_dist save runs on this thread


def install() -> None:
    """Rebind the names above; idempotent."""
    if _undo:
        return
    import megatron.training.checkpointing as checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller as Caller
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy as TorchDist

    global _megatron_core_worker_loop, _megatron_core_results_queue
    _megatron_core_worker_loop = Caller.async_loop
    _megatron_core_results_queue = filesystem_async.get_write_results_queue
    replaced = [(Caller, "async_loop", persistent_checkpoint_worker),
                (Caller, "_get_process", classmethod(_waiting_while_alive(Caller._get_process.__func__))),
                (Caller, "schedule_async_call", _not_to_a_dead_worker(Caller.schedule_async_call)),
                (Caller, "is_current_async_call_done", _failing_when_the_worker_died(Caller.is_current_async_call_done)),
                (checkpointing, "cleanup_old_non_persistent_checkpoint", remove_checkpoints_before_the_latest),
                (filesystem_async, "get_write_results_queue", write_results_queue),
                (TorchDist, "save", _synchronously(TorchDist.save))]
    if not filesystem_async.HAVE_PSUTIL:
        replaced.append((filesystem_async, "_process_memory", resident_bytes))
    _undo.extend(replace_names(replaced))


def uninstall() -> None:
    """Undo install() (tests; a loop keeps it for the process's life)."""
    while _undo:
        _undo.pop()()


def write_results_queue(mp_mode: str = "spawn") -> Any:
    """Where a torch_dist save's writer threads put their results: an in-process queue when the
    save is synchronous (`TorchDistSaveShardedStrategy.save`: its threads write in this process),
    else megatron-core's, a Manager's queue shared with the writer process. For a synchronous save
    megatron-core started that Manager too: a server process with 'spawn', which imports torch and
    the main script (4-11 CPU seconds, ~0.5 GB), kept for the process's life."""
    if getattr(_synchronous_save, "active", False):
        return queue.Queue()
    return _megatron_core_results_queue(mp_mode)


def _synchronously(save: Callable[..., Any]) -> Callable[..., Any]:
    def synchronous_save(self, *args: Any, **kwargs: Any) -> Any:
        _synchronous_save.active = True
        try:
            return save(self, *args, **kwargs)
        finally:
            _synchronous_save.active = False

    return synchronous_save


def resident_bytes() -> int:
    """What psutil.Process().memory_info().rss gives, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def remove_checkpoints_before_the_latest(save_dir: Any, leave_ckpt_num: int = 1, do_async: bool = False) -> None:
    """Megatron-LM's cleanup of non-persistent checkpoints (on rank 0; in a thread `do_async`): of
    the `iter_*` directories but the newest `leave_ckpt_num`, those older than the checkpoint
    `latest_checkpointed_iteration.txt` names; none while it names none."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    directory = pathlib.Path(save_dir)
    try:
        latest = int((directory / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return
    by_iteration = sorted((int(match[1]), path) for path in directory.glob("iter_*")
                          if (match := re.fullmatch(r"iter_(\d+)", path.name)))
    old = [path for iteration, path in by_iteration[:-leave_ckpt_num] if iteration < latest]

    def remove() -> None:
        for path in old:
            shutil.rmtree(path, ignore_errors=True)

    if do_async:
        threading.Thread(target=remove).start()
    else:
        remove()


def persistent_checkpoint_worker(*args: Any, **kwargs: Any) -> None:
    """megatron-core's persistent checkpoint worker loop with the process's patches installed first:
    the CPU patch (runtime/megatron_lm_cpu.py; nothing with CUDA) and install()'s. The worker
    process finds this function by its name, so it runs in a process that has neither."""
    megatron_lm_cpu.install()
    install()
    _megatron_core_worker_loop(*args, **kwargs)


# ---------------------------------------------------------------- a dead persistent worker


_dead_worker: Optional[str] = None  # once this process's worker died: the line that said so


def _waiting_while_alive(get_process: Callable[..., Any]) -> Callable[..., Any]:
    """`_get_process`, whose queue of tensor copies the caller waits on ends its wait when the worker
    dies (the worker got the queue itself when it started)."""
    def get_process_waiting_while_alive(cls, *args: Any, **kwargs: Any) -> Any:
        worker = get_process(cls, *args, **kwargs)
        if not isinstance(cls._persistent_preload_q, _JoinWhileAlive):
            cls._persistent_preload_q = _JoinWhileAlive(cls._persistent_preload_q, cls)
        return worker

    return get_process_waiting_while_alive


class _JoinWhileAlive:
    """A JoinableQueue whose join() also ends when the worker is gone."""

    def __init__(self, joinable_queue: Any, caller_class: type) -> None:
        self.queue, self.caller_class = joinable_queue, caller_class

    def put(self, item: Any) -> None:
        self.queue.put(item)

    def join(self) -> None:
        # JoinableQueue.join() waits on its condition for its count of unfinished items to reach
        # 0 (multiprocessing/queues.py), with no timeout: the same wait, a timeout per round.
        with self.queue._cond:
            while not self.queue._unfinished_tasks._semlock._is_zero() and not _worker_died(self.caller_class):
                self.queue._cond.wait(POLL_SECONDS)


def _worker_died(caller_class: type) -> bool:
    """Whether this process's persistent worker died (said once, in one line, when first seen)."""
    global _dead_worker
    worker = caller_class._persistent_process
    if _dead_worker is None and worker is not None and not worker.is_alive():
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        _dead_worker = (f"rank {rank}: megatron-core's persistent checkpoint worker (--use-persistent-ckpt-worker, "
                        f"pid {worker.pid}) ended with exit code {worker.exitcode} before finishing its save; "
                        "the save fails on every rank and `latest` keeps naming the previous checkpoint")
        sys.stderr.write(_dead_worker + "\n")
        sys.stderr.flush()
        for handed_over in (caller_class._persistent_queue, caller_class._persistent_preload_q.queue):
            handed_over.cancel_join_thread()  # what it holds for the worker is never read: exit without it
    return _dead_worker is not None


def _not_to_a_dead_worker(schedule_async_call: Callable[..., None]) -> Callable[..., None]:
    def schedule_async_call_to_a_live_worker(self, async_req: Any) -> None:
        if async_req.async_fn is None or not _worker_died(type(self)):
            schedule_async_call(self, async_req)
        if _worker_died(type(self)):
            self.process = None  # close() would wait for it forever; its saves fail when finalized

    return schedule_async_call_to_a_live_worker


def _failing_when_the_worker_died(is_current_async_call_done: Callable[..., bool]) -> Callable[..., bool]:
    def failing_when_the_worker_died(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if self.cur_item is None and (self.process is not None or _dead_worker is not None):
            self.cur_item = _completion_or_failure(self, blocking)
        if _dead_worker is not None:
            self.process = None
        return is_current_async_call_done(self, blocking, no_dist)

    return failing_when_the_worker_died


def _completion_or_failure(caller: Any, blocking: bool) -> Optional[Any]:
    """The number the worker put on its completion queue for the oldest save not finalized; "failed"
    when the worker died without putting it; None while it is still writing (at once unless
    `blocking`)."""
    while True:
        try:
            return caller._persistent_comp_q.get_nowait()
        except (queue.Empty, AttributeError):  # AttributeError: the queue is gone with a dead worker
            pass
        if _worker_died(type(caller)):
            try:  # it may have put the number just before it ended
                return caller._persistent_comp_q.get_nowait()
            except (queue.Empty, AttributeError):
                _put_failure_in_write_results(RuntimeError(_dead_worker))
                return "failed"
        if not blocking:
            return None
        time.sleep(POLL_SECONDS)


def _put_failure_in_write_results(error: Exception) -> None:
    """The torch_dist writer's finalization reads each save's write results on this rank from one
    queue, and turns an exception there into the save's failure on every rank. A dead worker put
    none for the save it did not finish (were they there, its files were all written)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = filesystem_async._results_queue
    if results is not None and results.empty():
        results.put(error)
