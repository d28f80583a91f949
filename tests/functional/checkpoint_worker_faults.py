"""Faults in megatron-core's persistent checkpoint worker (`--async-save --use-persistent-ckpt-worker`),
for tests/functional/megatron_lm_fault_entry.py. The worker is forked from a forkserver process,
which imports this module first (`multiprocessing.set_forkserver_preload`), so every worker has it.

Phase "worker write" (tests/functional/faults.py): the worker of that rank SIGKILLs itself after
writing its first file of the save of iteration N, before it reports the save as written.
"""

import re

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from tests.functional.faults import fire, wrap


def _iteration_of(file_name) -> int:
    """The iteration of the checkpoint a file belongs to, from its directory (iter_000000N)."""
    return int(re.findall(r"iter_(\d+)", str(file_name))[-1])


wrap(FileSystemWriterAsync, "write_preloaded_data",
     after=lambda *args, **kwargs: fire("worker write", _iteration_of(kwargs["write_bucket"][0])))
