"""Test-only entry: `torchrun -m tests.functional.megatron_lm_fault_entry <flags>` runs
scripts/pretrain_gpt_megatron_lm.py's `main` (Megatron-LM's loop, ours installed unless
--megatron-core-optimizer) with the faults of MEGATRON_EOPT_FAULTS (tests/functional/faults.py).

Phases: "step" (as iteration N starts: Megatron-LM's `train_step` is called), "write" (the save
of iteration N: this rank's shards written, the checkpoint's metadata and `latest` not yet; for
torch_dist in the finalization after the write, which --async-save runs while later iterations go on),
"nan gradient" (iteration N's gradient of the first parameter is NaN on this rank: the rank prints
whether its parameters and optimizer state changed in that iteration, and how it ended).
"""

import re

from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint import filesystem

from megatron_eopt.integrations.megatron_lm_gpt import main
from tests.functional.faults import FAULTS, fire, say, wrap


def _iteration(*args, **kwargs) -> int:
    """The iteration the loop starts: it sets curr_iteration to N - 1 before train_step(N)."""
    from megatron.training import get_args

    return get_args().curr_iteration + 1


def _saved_iteration(writer, *args, **kwargs) -> int:
    """The iteration of the checkpoint a writer writes, from its directory (iter_000000N)."""
    path = str(getattr(writer, "checkpoint_dir", None) or writer.path)
    return int(re.findall(r"iter_(\d+)", path)[-1])


def _hook_train_step() -> None:
    import megatron.training.training as training

    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        iteration = _iteration()
        fire("step", iteration)
        if not any(f["phase"] == "nan gradient" and f["iteration"] == iteration for f in FAULTS):
            return original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        return _with_nan_gradient(original, model, optimizer, forward_step_func, data_iterator, *args, **kwargs)

    training.train_step = train_step


def _with_nan_gradient(train_step, model, optimizer, forward_step_func, data_iterator, *args, **kwargs):
    """train_step with the first parameter's gradient NaN; says whether the state changed."""
    import torch

    from tests.megatron_lm_faults_in_process import state_of, states_equal

    parameter = next(p for p in model[0].parameters() if p.requires_grad)
    hook = parameter.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    before = state_of(model, optimizer)
    say("NaN gradient")
    outcome = "went on"
    try:
        return train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
    except Exception as error:
        outcome = f"raised {type(error).__name__}: {str(error).splitlines()[0]}"
        raise
    finally:
        hook.remove()
        say(f"state unchanged: {states_equal(state_of(model, optimizer), before)}; the step {outcome}")


# torch_dcp and fsdp_dtensor write through torch's FileSystemWriter; torch_dist through megatron-core's.
wrap(filesystem.FileSystemWriter, "write_data", after=lambda writer, *a, **k: fire("write", _saved_iteration(writer)))
wrap(filesystem_async.FileSystemWriterAsync, "retrieve_write_results",
     after=lambda writer, *a, **k: fire("write", _saved_iteration(writer)))

if __name__ == "__main__":
    say("starts")
    _hook_train_step()
    main()
