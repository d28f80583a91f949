"""Test-only entry: `torchrun -m tests.functional.megatron_lm_fault_entry <flags>` runs
scripts/pretrain_gpt_megatron_lm.py's `main` (Megatron-LM's loop, ours installed unless
--megatron-core-optimizer) with the faults of MEGATRON_EOPT_FAULTS (tests/functional/faults.py).

Phases: "step" (as iteration N starts: Megatron-LM's `train_step` is called), "write" (the save
of iteration N: this rank's shards written, the checkpoint's metadata and `latest` not yet; for
torch_dist, in the finalization that follows the (background) write).
"""

from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint import filesystem

from megatron_eopt.integrations.megatron_lm_gpt import main
from tests.functional.faults import fire, say, wrap


def _iteration(*args, **kwargs) -> int:
    """The iteration the loop runs or has just run: it sets curr_iteration to N - 1 before train_step(N)."""
    from megatron.training import get_args

    return get_args().curr_iteration + 1


def _hook_train_step() -> None:
    """Megatron-LM's train() calls the `train_step` of its own module."""
    import megatron.training.training as training

    wrap(training, "train_step", before=lambda *a, **k: fire("step", _iteration()))


wrap(filesystem.FileSystemWriter, "write_data", after=lambda *a, **k: fire("write", _iteration()))  # torch_dcp, fsdp_dtensor
wrap(filesystem_async.FileSystemWriterAsync, "retrieve_write_results",
     after=lambda *a, **k: fire("write", _iteration()))  # torch_dist, sync and async

if __name__ == "__main__":
    say("starts")
    _hook_train_step()
    main()
