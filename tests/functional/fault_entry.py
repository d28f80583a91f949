"""Test-only entry: `torchrun -m tests.functional.fault_entry <pretrain_gpt flags>` with faults.

MEGATRON_EOPT_FAULTS lists the faults (tests/functional/faults.py). Phases: "step" (as iteration N
starts), "write" (the save of iteration N: this rank's shards written, the metadata not yet),
"rename" (all files and the manifest written, before the rename into place), "latest" (after the
rename, before `latest` moves); with --async-save the save phases happen in the background thread
while later iterations run.
"""

from torch.distributed.checkpoint import filesystem

from megatron_eopt.checkpointing import storage
from megatron_eopt.training.loop import train
from megatron_eopt.training.parallel import elastic
from megatron_eopt.training.pretrain import main
from tests.functional.faults import fire, say, wrap

STATE = {"iteration": 0, "saving": None, "committing": False}


def maybe_fault(phase: str) -> None:
    fire(phase, STATE["iteration"] if phase == "step" else STATE["saving"])  # a save: its own iteration


def _iteration_starts(args, settings, device, run, housekeeping, iteration) -> None:
    STATE["iteration"] = iteration
    maybe_fault("step")


def _verify(*args, **kwargs) -> None:
    if STATE["committing"]:
        STATE["committing"] = False
        maybe_fault("latest")  # commit verifies the renamed directory before moving `latest`


def _commit(*args, **kwargs) -> None:
    maybe_fault("rename")
    STATE["committing"] = True


def _save_begins(checkpoint_dir, iteration, group) -> None:
    STATE["saving"] = iteration


wrap(train, "train_iteration", before=_iteration_starts)
wrap(storage, "begin_save", before=_save_begins)
wrap(filesystem.FileSystemWriter, "write_data", after=lambda *a, **k: maybe_fault("write"))
wrap(storage, "commit", before=_commit)
wrap(storage, "verify_files", before=_verify)
wrap(elastic, "fail", before=lambda *a, **k: say("fails"))

if __name__ == "__main__":
    say("starts")
    main()
