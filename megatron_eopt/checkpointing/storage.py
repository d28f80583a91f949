"""Checkpoint directories that are either complete or absent.

Layout of `checkpoint_dir`:
    iter_0000010/                  a complete checkpoint: torch.distributed.checkpoint files
        .metadata, __<rank>_<i>.distcp
        megatron_eopt.json         manifest: what is inside, and every file's size and CRC-32
    latest                         the name of the last complete checkpoint
    .iter_0000020.incomplete/      a save in progress (or one killed midway)

A save writes into the `.incomplete` directory; when every rank has written its files and
rank 0 the manifest, rank 0 renames it into place and only then rewrites `latest` (itself
through a rename), so a process killed at any moment leaves the previous checkpoint and its
marker intact. (Saving an iteration again moves the old copy to `iter_N.replaced` for the
moment of the swap; a load finds it there if the swap was cut short.) A load verifies every
file against the manifest first (the ranks share the work), so a truncated or corrupted
checkpoint is named, never half-loaded.

Every collective runs over `group`, the ranks that save or load this checkpoint together (None:
one rank alone); ranks are numbered within it. Other jobs may share torch's WORLD.
"""

import json
import os
import shutil
import zlib
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from megatron_eopt.distributed.process_groups import ProcessGroup

MANIFEST = "megatron_eopt.json"
LATEST = "latest"
REPLACED = ".replaced"  # a checkpoint being replaced by a new save of the same iteration
FORMAT_VERSION = 1
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message says why and what to do."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def incomplete_path(checkpoint_dir: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir, f".{checkpoint_name(iteration)}.incomplete")


def latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """Path of the checkpoint `latest` points at, None if there is no marker."""
    marker = os.path.join(checkpoint_dir, LATEST)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        name = f.read().strip()
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


def _complete_copy(path: str) -> str:
    """`path`, or the copy `commit` moved aside if it was killed while saving that iteration again."""
    if not os.path.isdir(path) and os.path.isdir(path + REPLACED):
        return path + REPLACED
    return path


def begin_save(checkpoint_dir: str, iteration: int, group: Optional[ProcessGroup]) -> str:
    """Create the empty `.incomplete` directory on rank 0 (removing a killed save's leftovers)."""
    path = incomplete_path(checkpoint_dir, iteration)
    if rank(group) == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    _barrier(group)
    return path


def write_manifest(path: str, manifest: dict[str, Any], group: Optional[ProcessGroup]) -> None:
    """Every rank checksums the files it wrote; rank 0 writes the manifest with all of them."""
    own_prefix = f"__{rank(group)}_"
    own = {name: _file_record(os.path.join(path, name)) for name in os.listdir(path) if name.startswith(own_prefix)}
    gathered = all_gather_objects(own, group)
    if rank(group) == 0:
        files = {name: record for part in gathered for name, record in part.items()}
        files[".metadata"] = _file_record(os.path.join(path, ".metadata"))
        _write_atomically(os.path.join(path, MANIFEST), json.dumps({**manifest, "files": files}, indent=1))


def commit(checkpoint_dir: str, iteration: int, group: Optional[ProcessGroup]) -> str:
    """Rename the finished `.incomplete` directory into place and point `latest` at it."""
    _barrier(group)  # every rank has finished writing
    final = os.path.join(checkpoint_dir, checkpoint_name(iteration))
    if rank(group) == 0:
        staged = incomplete_path(checkpoint_dir, iteration)
        replaced = final + REPLACED
        if os.path.isdir(final):  # saving the same iteration again
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(staged, final)
        _write_atomically(os.path.join(checkpoint_dir, LATEST), checkpoint_name(iteration))
        shutil.rmtree(replaced, ignore_errors=True)
    _barrier(group)
    return final


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
    for name in names[rank(group)::world_size(group)]:
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


def agree(step: Callable[[], T], group: Optional[ProcessGroup]) -> T:
    """Run `step` on every rank; if it fails on any, raise on all (the failing rank's own error)."""
    try:
        result, message = step(), None
    except (ValueError, TypeError) as error:
        result, message, own = None, f"rank {rank(group)}: {error}", error
    messages = [m for m in all_gather_objects(message, group) if m is not None]
    if message is not None:
        raise own
    if messages:
        raise CheckpointError(f"loading stopped on every rank: {messages[0]}")
    return result


def _file_record(path: str) -> dict[str, int]:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return {"size": os.path.getsize(path), "crc32": crc}


def _write_atomically(path: str, text: str) -> None:
    staged = path + ".tmp"
    with open(staged, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, path)
    _fsync_directory(os.path.dirname(path) or ".")


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank(group: Optional[ProcessGroup]) -> int:
    """This rank's number in `group` (None: a rank alone)."""
    return 0 if group is None else dist.get_rank(group)


def world_size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _barrier(group: Optional[ProcessGroup]) -> None:
    if group is not None:
        dist.barrier(group=group)


def all_gather_objects(obj: Any, group: Optional[ProcessGroup]) -> list[Any]:
    if group is None:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
