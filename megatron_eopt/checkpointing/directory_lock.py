"""A checkpoint directory owned by one run from start-up until it exits, not one save at a time.

`DirectoryOwner(checkpoint_dir)` takes the exclusive `fcntl.flock` on `.save_lock` that each save
takes (storage.py) and keeps it until `release()` (or the end of its `with` block). Another
process's save, or a second owner, is refused naming the holder (pid, host, start time,
command); this process's saves go through. The kernel drops the lock when the holder dies, even
by SIGKILL, so a crashed run never blocks the next one. The owner remembers which checkpoints the
directory held when it took it and says when a save replaces one of them (a fresh run pointed at
an old directory, a resume from an earlier iteration). Without an owner each save locks the
directory for its own duration only; call it on the one rank that saves (rank 0).
"""

import os
import warnings
from typing import Callable, Optional

from megatron_eopt.checkpointing.storage import OWNED, CheckpointError, SaveLock, checkpoint_iterations, checkpoint_name


class DirectoryOwner(SaveLock):
    """This process's claim on `checkpoint_dir` for a whole run (see the module docstring).

    `on_replace(message)` is told, once per iteration, when a save is about to replace a
    checkpoint the directory held before this owner took it (default: a warning).
    """

    ACTIVITY = "owning it for its run"

    def __init__(self, checkpoint_dir: str, on_replace: Optional[Callable[[str], None]] = None) -> None:
        super().__init__(checkpoint_dir)
        self.on_replace = on_replace or (lambda message: warnings.warn(message, stacklevel=2))
        self.earlier: set[int] = set()

    def acquire(self) -> "DirectoryOwner":
        key = os.path.realpath(self.checkpoint_dir)
        if key in OWNED:
            raise CheckpointError(f"{self.checkpoint_dir} is owned by this process already (another "
                                  f"DirectoryOwner); release that one first.")
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        self._lock()
        OWNED[key] = self
        self.earlier = set(checkpoint_iterations(self.checkpoint_dir))
        return self

    def refusal(self, holder: str) -> str:
        return (f"another run owns the checkpoint directory {self.checkpoint_dir} ({holder}); two runs "
                f"must not share one: give this one its own --save / checkpoint_dir, or wait for that "
                f"one to exit.")

    def release(self) -> None:
        key = os.path.realpath(self.checkpoint_dir)
        if OWNED.get(key) is self:
            del OWNED[key]
        super().release()

    def before_save(self, iteration: int) -> None:
        """storage.begin_save calls this, holding the lock, before it touches anything."""
        if iteration in self.earlier:
            self.earlier.discard(iteration)
            self.on_replace(f"saving iteration {iteration} replaces "
                            f"{os.path.join(self.checkpoint_dir, checkpoint_name(iteration))}, which an "
                            f"earlier run wrote")

    def __enter__(self) -> "DirectoryOwner":
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
