"""Test-only entry: `torchrun -m tests.functional.megatron_lm_fault_entry <flags>` runs
scripts/pretrain_gpt_megatron_lm.py's `main` (Megatron-LM's loop, ours installed unless
--megatron-core-optimizer) with the faults of MEGATRON_EOPT_FAULTS (tests/functional/faults.py).

Phases: "step" (as iteration N starts: Megatron-LM's `train_step` is called), "write" (the save
of iteration N: this rank's shards written, the checkpoint's metadata and `latest` not yet; for
torch_dist in the finalization after the write, which --async-save runs while later iterations go on),
"nan gradient" (iteration N's gradient of the word embeddings is NaN on this rank: every rank prints
whether its parameters and optimizer state changed in that iteration, and how it ended),
"worker write" (in the persistent checkpoint worker: tests/functional/checkpoint_worker_faults.py).
"""

import json
import multiprocessing
import os
import re

from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint import filesystem

from megatron_eopt.integrations.megatron_lm_gpt import main
from tests.functional.faults import ATTEMPT, FAULTS, fire, say, wrap

# The iterations where some rank's gradient is NaN: every rank takes the snapshots there.
NAN_ITERATIONS = {f["iteration"] for f in json.loads(os.environ.get("MEGATRON_EOPT_FAULTS", "[]"))
                  if f["attempt"] == ATTEMPT and f["phase"] == "nan gradient"}


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
        if iteration not in NAN_ITERATIONS:
            return original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        return _with_nan_gradient(original, model, optimizer, forward_step_func, data_iterator, *args, **kwargs)

    training.train_step = train_step


def _with_nan_gradient(train_step, model, optimizer, forward_step_func, data_iterator, *args, **kwargs):
    """train_step with the word embeddings' gradient NaN on the faulted rank; every rank says
    whether its state changed (each takes the snapshots: on FSDP2 and Megatron-FSDP they are
    collectives)."""
    import torch

    from tests.megatron_lm_faults_in_process import all_finite, state_of, states_equal

    hooks = []
    if any(f["phase"] == "nan gradient" and f["iteration"] == _iteration() for f in FAULTS):  # this rank's
        # The gradient of the word embeddings' output: NaN reaches their weights' gradient through
        # autograd, before any engine's hooks reduce it (a hook on a parameter is bypassed by
        # Megatron-FSDP's gradient buffers).
        def nan_gradient_of(module, inputs, output) -> None:  # None: the output stays as it is
            output.register_hook(lambda grad: torch.full_like(grad, float("nan")))

        embedding = next(m for name, m in model[0].named_modules() if name.endswith("word_embeddings"))
        hooks.append(embedding.register_forward_hook(nan_gradient_of))
        say("NaN gradient")
    before = state_of(model, optimizer)
    outcome = "went on"
    try:
        return train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
    except Exception as error:
        outcome = f"raised {type(error).__name__}: {str(error).splitlines()[0]}"
        raise
    finally:
        for hook in hooks:
            hook.remove()
        after = state_of(model, optimizer)
        say(f"state unchanged: {states_equal(after, before)}, finite: {all_finite(after)}; the step {outcome}")


# torch_dcp and fsdp_dtensor write through torch's FileSystemWriter; torch_dist through megatron-core's.
wrap(filesystem.FileSystemWriter, "write_data", after=lambda writer, *a, **k: fire("write", _saved_iteration(writer)))
wrap(filesystem_async.FileSystemWriterAsync, "retrieve_write_results",
     after=lambda writer, *a, **k: fire("write", _saved_iteration(writer)))

if __name__ == "__main__":
    say("starts")
    multiprocessing.set_forkserver_preload(["tests.functional.checkpoint_worker_faults"])
    _hook_train_step()
    main()
