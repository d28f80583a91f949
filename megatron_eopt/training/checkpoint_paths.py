"""--save and --load checked at start-up, before any model is built (no torch import).

A --save that cannot be created or written (a path through a file, a directory without write
permission, a read-only file system) would otherwise be found at the first save, as a traceback
after the training done so far; a --load the flags need (--exit-on-missing-checkpoint,
--ckpt-step) that holds no such checkpoint, after the model is built. Checkpoint names follow
checkpointing/storage.py (`iter_NNNNNNN`, `latest`, Megatron-LM's `latest_checkpointed_iteration.txt`),
read here without importing it.
"""

import argparse
import os
import re
import tempfile

_CHECKPOINT = re.compile(r"iter_\d{7,}(\.replaced)?")


def check_checkpoint_paths(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag, the path and what is wrong with it."""
    if args.save:
        _check_writable_directory(args.save)
    load = getattr(args, "load", None)
    if not load:
        return
    if os.path.exists(load) and not os.path.isdir(load):
        raise ValueError(f"--load {load} is not a directory (a checkpoint directory, as --save writes, is expected).")
    step = getattr(args, "ckpt_step", None)
    if step is not None:
        name = f"iter_{step:07d}"
        if not any(os.path.isdir(os.path.join(load, n)) for n in (name, name + ".replaced")):
            raise ValueError(f"--ckpt-step {step}: no checkpoint {name} in --load {load} ({_contents(load)}).")
    elif getattr(args, "exit_on_missing_checkpoint", False) and not _holds_checkpoints(load):
        raise ValueError(f"--exit-on-missing-checkpoint: no checkpoint in --load {load} ({_contents(load)}).")


def _check_writable_directory(path: str) -> None:
    """`path` is a writable directory, or the nearest existing ancestor is one it can be made in
    (probed by creating and removing a file: permission bits do not tell root or a read-only
    file system)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"--save {path} is a file, not a directory; give a directory to save checkpoints in.")
        problem = _write_problem(path)
        if problem:
            raise ValueError(f"--save {path} is not writable ({problem}); give a directory this run can write to.")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--save {path} cannot be created: {parent} is a file, not a directory.")
    problem = _write_problem(parent)
    if problem:
        raise ValueError(f"--save {path} cannot be created: {parent} is not writable ({problem}).")


def _write_problem(directory: str) -> str:
    """Why no file can be made in `directory` ('' if one can)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=directory)
    except OSError as error:
        return error.strerror or str(error)
    os.close(fd)
    os.unlink(probe)
    return ""


def _holds_checkpoints(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    return any(name in ("latest", "latest_checkpointed_iteration.txt") or (_CHECKPOINT.fullmatch(name) and os.path.isdir(os.path.join(path, name)))
               for name in os.listdir(path))


def _contents(path: str) -> str:
    if not os.path.isdir(path):
        return "it does not exist"
    found = sorted(n for n in os.listdir(path) if _CHECKPOINT.fullmatch(n) and os.path.isdir(os.path.join(path, n)))
    if not found:
        return "it holds no checkpoint"
    return "it holds " + ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
