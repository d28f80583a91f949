"""The trainer owns its --save directory from start-up until it exits (checkpointing/directory_lock.py).

Rank 0 takes the directory's lock before any model is built and holds it for the whole run, so
a second run pointed at the same --save is refused at its start-up, in one line naming the
holder, on every rank (exit status 2); a run killed at any moment releases it. A save that
replaces a checkpoint an earlier run left there is said in one line.
"""

import argparse
import contextlib
from typing import Iterator, Optional

import torch.distributed as dist

from megatron_eopt.checkpointing.directory_lock import DirectoryOwner
from megatron_eopt.checkpointing.storage import CheckpointError
from megatron_eopt.training.errors import exit_with_error


@contextlib.contextmanager
def own_save_directory(args: argparse.Namespace, rank: int) -> Iterator[None]:
    """Hold --save for the `with` block (nothing without --save); collective over the job."""
    if not args.save:
        yield
        return
    owner: Optional[DirectoryOwner] = None
    refusal = None
    if rank == 0:
        try:
            owner = DirectoryOwner(args.save, on_replace=lambda message: print(f"> {message}", flush=True)).acquire()
        except (CheckpointError, OSError) as error:
            refusal = f"--save {args.save}: {error}"
    refusal = _from_rank_zero(refusal)
    if refusal is not None:
        exit_with_error(refusal)
    try:
        yield
    finally:
        if owner is not None:
            owner.release()


def _from_rank_zero(value: Optional[str]) -> Optional[str]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
