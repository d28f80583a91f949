"""Checkpoint directories that are either complete or absent.

    iter_0000010/                  a complete checkpoint: torch.distributed.checkpoint files
        megatron_eopt.json         manifest: what is inside, and every file's size and CRC-32
    latest                         the name of the last complete checkpoint
    .iter_0000020.incomplete/      a save in progress, or one killed midway
    .save_lock                     rank 0 holds an advisory flock on it while saving

A save writes into the `.incomplete` directory. Rank 0 renames it into place when every rank is
done, verifies it, and only then rewrites `latest` by a rename. Saving an iteration again moves
the old copy to `iter_N.replaced` for the swap. A load verifies every file against the manifest
first. Every collective runs over `group`, the ranks that save or load together (None: one
rank). Rank 0 holds an exclusive flock on `.save_lock` for a save, or for a whole run with
directory_lock.py's `DirectoryOwner`. docs/checkpoints.md describes the behaviour.
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import warnings
import zlib
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_eopt.runtime.process_groups import ProcessGroup, group_rank, group_size

MANIFEST = "megatron_eopt.json"
LATEST = "latest"
# Megatron-LM's pointer, its tracker file: the iteration to resume from, which Megatron-LM's tools and its
# functional-test runner (run_ci_test.sh's ckpt-resume) write. Read when written after `latest` (`_pointer`).
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
REPLACED = ".replaced"  # a checkpoint being replaced by a new save of the same iteration
SAVE_LOCK = ".save_lock"
CHECKPOINT_NAME = re.compile(r"iter_(\d{7,})")
FORMAT_VERSION = 1
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message says why and what to do."""


class CheckpointSaveError(CheckpointError):
    """A save that failed on some rank with an OS error (a full disk, an unwritable or read-only
    directory): raised on every rank of the save alike, after the directory was put back as it
    was before the save (the partial directory removed, `latest` and the older checkpoints as
    they were)."""


class SaveFailed(Exception):
    """A step of a save failed on some rank (raised on every rank); `save_checkpoint` turns it
    into a CheckpointSaveError once the directory is put back."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def incomplete_path(checkpoint_dir: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir, f".{checkpoint_name(iteration)}.incomplete")


def _pointer(checkpoint_dir: str) -> Optional[tuple[str, str]]:
    """(the pointer file, the checkpoint name it gives), None without one: `latest`, or Megatron-LM's
    tracker where it was written after `latest` (a save rewrites `latest`; Megatron-LM's runner and
    tools rewrite the tracker, to an iteration number)."""
    paths = [os.path.join(checkpoint_dir, name) for name in (LATEST, MEGATRON_LM_TRACKER)]
    written = [(os.stat(path).st_mtime_ns, order, path) for order, path in enumerate(paths) if os.path.isfile(path)]
    if not written:
        return None
    marker = max(written)[2]
    with open(marker) as f:
        text = f.read().strip()
    if marker.endswith(LATEST):
        return marker, text
    if not text.isdigit():
        raise CheckpointError(f"{marker} holds {text!r}, not an iteration number; write the iteration to "
                              f"resume from, or pass it explicitly (--ckpt-step, iteration=...).")
    return marker, checkpoint_name(int(text))


def latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """Path of the checkpoint the pointer (`_pointer`) names, None if there is none."""
    pointer = _pointer(checkpoint_dir)
    if pointer is None:
        return None
    marker, name = pointer
    path = _complete_copy(os.path.join(checkpoint_dir, name))
    if not name or not os.path.isdir(path):
        raise CheckpointError(
            f"{marker} names {name!r}, which is not a checkpoint directory in {checkpoint_dir}; "
            f"pass the checkpoint to load explicitly (iteration=...)."
        )
    return path


def resolve_checkpoint(checkpoint_dir: str, iteration: Optional[int]) -> str:
    """The directory to load: the given iteration's, else the latest one."""
    if iteration is not None:
        path = _complete_copy(os.path.join(checkpoint_dir, checkpoint_name(iteration)))
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint for iteration {iteration}: {path} does not exist.")
        return path
    path = latest_checkpoint(checkpoint_dir)
    if path is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir}: it has no '{LATEST}' marker.")
    return path


def open_checkpoint(
    checkpoint_dir: str, iteration: Optional[int], group: Optional[ProcessGroup]
) -> tuple[str, dict[str, Any], Optional[str]]:
    """(path, manifest, note) of the checkpoint to load, its files verified (collective).

    Without `latest` (a save cut short between its rename and the marker update) it is the newest
    `iter_N` that verifies, and `note` says so; an explicit iteration is never replaced by another.
    """
    if iteration is not None or _pointer(checkpoint_dir) is not None:
        path = resolve_checkpoint(checkpoint_dir, iteration)
        manifest = read_manifest(path)
        verify_files(path, manifest, group)
        return path, manifest, None
    skipped = []
    for found in reversed(checkpoint_iterations(checkpoint_dir)):
        path = _complete_copy(os.path.join(checkpoint_dir, checkpoint_name(found)))
        try:
            manifest = read_manifest(path)
            verify_files(path, manifest, group)  # every rank tries the same candidates: collectives match
        except CheckpointError as error:
            skipped.append(f"{os.path.basename(path)} ({error})")
            continue
        note = (f"{checkpoint_dir} has no '{LATEST}' marker (a save cut short before updating it?): "
                f"loading the newest complete checkpoint, {os.path.basename(path)}")
        return path, manifest, note + (f"; skipped {'; '.join(skipped)}" if skipped else "")
    reason = f"none of its iter_* directories verifies: {'; '.join(skipped)}" if skipped else "and no iter_* directory"
    raise CheckpointError(f"no checkpoint in {checkpoint_dir}: it has no '{LATEST}' marker {reason}.")


def checkpoint_iterations(checkpoint_dir: str) -> list[int]:
    """Iterations with an `iter_N` directory (or the copy a cut-short re-save left), ascending."""
    if not os.path.isdir(checkpoint_dir):
        return []
    found = set()
    for name in os.listdir(checkpoint_dir):
        match = CHECKPOINT_NAME.fullmatch(name.removesuffix(REPLACED))
        if match and os.path.isdir(os.path.join(checkpoint_dir, name)):
            found.add(int(match.group(1)))
    return sorted(found)


def has_checkpoints(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` holds any checkpoint (a `latest` marker or an `iter_N` directory).

    A directory that does not exist or holds none is how `--save X --load X` scripts start.
    """
    return _pointer(checkpoint_dir) is not None or bool(checkpoint_iterations(checkpoint_dir))


def _complete_copy(path: str) -> str:
    """`path`, or the copy `commit` moved aside if it was killed while saving that iteration again."""
    if not os.path.isdir(path) and os.path.isdir(path + REPLACED):
        return path + REPLACED
    return path


class SaveLock:
    """Rank 0's exclusive advisory lock (`fcntl.flock`) on a checkpoint directory during a save.

    The lock file names its holder (pid, host, start time, command), so a second run saving into
    the same directory is refused with who the first one is. The kernel drops the lock when the
    holder exits, even when killed, so a stale file never blocks anyone. In a directory this
    process owns for its whole run (directory_lock.py) the owner's lock covers the save.
    """

    ACTIVITY = "saving"

    def __init__(self, checkpoint_dir: str) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.path = os.path.join(checkpoint_dir, SAVE_LOCK)
        self._file = None

    def acquire(self) -> None:
        if os.path.realpath(self.checkpoint_dir) not in OWNED:
            self._lock()

    def _lock(self) -> None:
        file = open(self.path, "a+")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "holder not yet written"
            file.close()
            if not _dead_holder(holder):
                raise CheckpointError(self.refusal(holder)) from None
            file = self._take_over(holder)
        file.truncate(0)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        file.write(f"pid {os.getpid()} on host {socket.gethostname()}, {self.ACTIVITY} since {started}, "
                   f"command: {' '.join(sys.argv)[:300]}")
        file.flush()
        self._file = file

    def _take_over(self, holder: str):
        """The lock of a holder that died while a process it forked keeps the file open: a new
        lock file takes its place (under `.save_lock.takeover`, so two runs cannot both take it)."""
        with open(self.path + ".takeover", "a+") as guard:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
            file = open(self.path, "a+")
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # freed meanwhile, or taken over
                return file
            except BlockingIOError:
                file.seek(0)
                current = file.read().strip()
                file.close()
                if current != holder:  # another run took it over first
                    raise CheckpointError(self.refusal(current or "holder not yet written")) from None
            staged = open(self.path + ".new", "w+")
            fcntl.flock(staged.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(staged.name, self.path)
        warnings.warn(f"took over the lock on {self.checkpoint_dir}: its holder is dead ({holder}); a process "
                      f"it started still had the lock file open", stacklevel=4)
        return staged

    def refusal(self, holder: str) -> str:
        return (f"another run is saving into {self.checkpoint_dir} ({holder}); two runs must not "
                f"share a checkpoint directory: give this one its own --save / checkpoint_dir.")

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _dead_holder(holder: str) -> bool:
    """Whether the lock file names a process on this host that no longer exists."""
    match = re.match(r"pid (\d+) on host (\S+),", holder)
    if match is None or match.group(2) != socket.gethostname():
        return False  # unknown, or another host's: it may be alive
    pid = int(match.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie: dead, not yet reaped
    except (OSError, IndexError):
        return False


# Directories this process owns for a whole run (realpath -> ownership.DirectoryOwner).
OWNED: dict[str, Any] = {}


def begin_save(
    checkpoint_dir: str, iteration: int, group: Optional[ProcessGroup]
) -> tuple[str, Optional[SaveLock]]:
    """Lock the directory and create the empty `.incomplete` one on rank 0 (removing a killed save's
    leftovers); returns its path and the lock, which `end_save` releases."""
    path = incomplete_path(checkpoint_dir, iteration)
    lock = SaveLock(checkpoint_dir) if group_rank(group) == 0 else None

    def prepare() -> None:
        if lock is None:
            return
        os.makedirs(checkpoint_dir, exist_ok=True)
        lock.acquire()  # before touching the staging folder: it may be another run's
        if os.path.realpath(checkpoint_dir) in OWNED:
            OWNED[os.path.realpath(checkpoint_dir)].before_save(iteration)
        try:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        except BaseException:
            lock.release()
            raise

    try:
        agree(prepare, group, "saving", saving=True)
    except SaveFailed as failure:
        raise CheckpointSaveError(f"saving {checkpoint_name(iteration)} in {checkpoint_dir} failed before "
                                  f"writing anything: {failure}") from None
    return path, lock


def abandon_save(checkpoint_dir: str, iteration: int, failure: SaveFailed,
                 group: Optional[ProcessGroup]) -> CheckpointSaveError:
    """After a failed step: rank 0 removes the `.incomplete` directory (a failed commit has put
    the directory back already); every rank gets the same error, saying what is left."""
    staged = incomplete_path(checkpoint_dir, iteration)
    if group_rank(group) == 0:
        shutil.rmtree(staged, ignore_errors=True)
    left = all_gather_objects(os.path.isdir(staged) if group_rank(group) == 0 else None, group)[0]
    latest = latest_checkpoint(checkpoint_dir)
    latest = os.path.basename(latest) if latest else None
    return CheckpointSaveError(
        f"saving {checkpoint_name(iteration)} in {checkpoint_dir} failed: {failure}. "
        + (f"The partial directory {staged} could not be removed" if left else "The partial directory is removed")
        + (f"; '{LATEST}' still names {latest}, which loads as before." if latest
           else f"; there is no '{LATEST}' (no earlier checkpoint)."))


def end_save(lock: Optional[SaveLock]) -> None:
    if lock is not None:
        lock.release()


def write_manifest(path: str, manifest: dict[str, Any], group: Optional[ProcessGroup]) -> None:
    """Every rank checksums the files it wrote; rank 0 writes the manifest with all of them."""
    own_prefix = f"__{group_rank(group)}_"
    own = {name: _file_record(os.path.join(path, name)) for name in os.listdir(path) if name.startswith(own_prefix)}
    gathered = all_gather_objects(own, group)
    files = {name: record for part in gathered for name, record in part.items()}
    if group_rank(group) == 0:
        files[".metadata"] = _file_record(os.path.join(path, ".metadata"))

    def write() -> None:
        if group_rank(group) == 0:
            _write_atomically(os.path.join(path, MANIFEST), json.dumps({**manifest, "files": files}, indent=1))

    agree(write, group, "saving", saving=True)


def commit(checkpoint_dir: str, iteration: int, group: Optional[ProcessGroup]) -> str:
    """Rename the finished `.incomplete` directory into place, verify it against its manifest, and
    only then point `latest` at it. A rename or `latest` that fails (SaveFailed on every rank)
    puts the directory back as it was before the save."""
    _barrier(group)  # every rank has finished writing
    final = os.path.join(checkpoint_dir, checkpoint_name(iteration))
    agree(lambda: _rename_into_place(checkpoint_dir, iteration) if group_rank(group) == 0 else None,
          group, "saving", saving=True)
    try:
        verify_files(final, read_manifest(final), group)
    except CheckpointError as error:
        raise CheckpointError(
            f"saving {final} failed: it does not match its manifest after writing ({error}); "
            f"'{LATEST}' was not moved to it. Did another process write into {checkpoint_dir}?"
        ) from None
    marker_before = _marker_identity(checkpoint_dir)
    try:
        agree(lambda: _point_latest(checkpoint_dir, iteration) if group_rank(group) == 0 else None,
              group, "saving", saving=True)
    except SaveFailed:
        if group_rank(group) == 0 and _marker_identity(checkpoint_dir) == marker_before:
            _undo_rename(final)  # (a failure after `latest` moved, fsyncing its directory, keeps the new one)
        raise
    if group_rank(group) == 0:
        shutil.rmtree(final + REPLACED, ignore_errors=True)
    _barrier(group)
    return final


def _rename_into_place(checkpoint_dir: str, iteration: int) -> None:
    final = os.path.join(checkpoint_dir, checkpoint_name(iteration))
    staged = incomplete_path(checkpoint_dir, iteration)
    if os.path.isdir(final):  # saving the same iteration again
        shutil.rmtree(final + REPLACED, ignore_errors=True)
        os.replace(final, final + REPLACED)
    try:
        os.replace(staged, final)
    except OSError:
        if os.path.isdir(final + REPLACED):
            os.replace(final + REPLACED, final)
        raise


def _marker_identity(checkpoint_dir: str) -> Optional[tuple[int, int]]:
    """(inode, mtime) of `latest`: a rewrite (a rename onto it) changes it."""
    try:
        stat = os.stat(os.path.join(checkpoint_dir, LATEST))
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _undo_rename(final: str) -> None:
    """`latest` did not move: the new directory goes (its copy of an earlier save comes back)."""
    shutil.rmtree(final, ignore_errors=True)
    if os.path.isdir(final + REPLACED) and not os.path.exists(final):
        os.replace(final + REPLACED, final)


def _point_latest(checkpoint_dir: str, iteration: int) -> None:
    marker = os.path.join(checkpoint_dir, LATEST)
    previous = None
    if os.path.isfile(marker):
        with open(marker) as f:
            match = CHECKPOINT_NAME.fullmatch(f.read().strip())
        previous = int(match.group(1)) if match else None
    if previous is not None and previous > iteration:
        warnings.warn(
            f"'{LATEST}' in {checkpoint_dir} moves back from {checkpoint_name(previous)} to "
            f"{checkpoint_name(iteration)}: a load without an explicit iteration now resumes from "
            f"{iteration}. Expected when resuming from an earlier checkpoint; otherwise another run "
            f"saves into this directory.",
            stacklevel=4,
        )
    _write_atomically(marker, checkpoint_name(iteration))


def read_manifest(path: str) -> dict[str, Any]:
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it is not a complete megatron_eopt checkpoint."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{manifest_path} is corrupt: {error}.") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {manifest.get('format')!r}; this version reads "
            f"format {FORMAT_VERSION}."
        )
    return manifest


def verify_files(path: str, manifest: dict[str, Any], group: Optional[ProcessGroup]) -> None:
    """Check every file's size and CRC-32 against the manifest; the ranks split the files."""
    names = sorted(manifest["files"])
    problems = []
    for name in names[group_rank(group)::group_size(group)]:
        expected = manifest["files"][name]
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            problems.append(f"{name} is missing")
            continue
        actual = _file_record(file_path)
        if actual["size"] != expected["size"]:
            problems.append(f"{name} has {actual['size']} bytes, the manifest says {expected['size']} (truncated?)")
        elif actual["crc32"] != expected["crc32"]:
            problems.append(f"{name} fails its checksum (corrupted)")
    problems = sorted(p for part in all_gather_objects(problems, group) for p in part)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems) + ". Load an earlier checkpoint.")


def agree(step: Callable[[], T], group: Optional[ProcessGroup], activity: str = "loading",
          saving: bool = False) -> T:
    """Run `step` on every rank; if it fails on any, raise on all (the failing rank's own error).
    With `saving`, an OS error (or torch.distributed.checkpoint's CheckpointException) on any
    rank raises SaveFailed on every rank, naming the rank and the error."""
    try:
        result, failure = step(), None
    except (ValueError, TypeError) as error:
        result, failure, own = None, ("error", f"rank {group_rank(group)}: {error}"), error
    except (OSError, CheckpointException) as error:
        if not saving:
            raise
        failure = ("os", _error_line(error) if isinstance(error, CheckpointException)
                   else f"rank {group_rank(group)}: {_error_line(error)}")
        result, own = None, SaveFailed(failure[1])
    failures = [f for f in all_gather_objects(failure, group) if f is not None]
    if failure is not None:
        raise own
    if failures:
        kind, message = failures[0]
        raise SaveFailed(message) if kind == "os" else CheckpointError(f"{activity} stopped on every rank: {message}")
    return result


def _error_line(error: BaseException) -> str:
    """One line for an OS error, or for the first failure inside a CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        ranks = sorted(error.failures)
        inner = error.failures[ranks[0]][0]
        return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: writing the shards: " + \
            _error_line(inner)
    return " ".join(f"{type(error).__name__}: {error}".split())[:400]


def _file_record(path: str) -> dict[str, int]:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return {"size": os.path.getsize(path), "crc32": crc}


def _write_atomically(path: str, text: str) -> None:
    staged = path + ".tmp"
    try:
        with open(staged, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(staged)
        raise
    _fsync_directory(os.path.dirname(path) or ".")


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(group: Optional[ProcessGroup]) -> None:
    if group is not None:
        dist.barrier(group=group)


def all_gather_objects(obj: Any, group: Optional[ProcessGroup]) -> list[Any]:
    if group is None:
        return [obj]
    gathered: list[Any] = [None] * group_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
