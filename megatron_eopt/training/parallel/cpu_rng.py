"""megatron-core's RNG tracker on CPU: dropout streams per tensor-parallel rank and activation
recompute without CUDA.

megatron-core keeps named RNG streams in a tracker (`tensor_parallel.get_cuda_rng_tracker()`):
dropout inside tensor-parallel regions (attention heads, the sequence-parallel region) runs in
`fork()` of the model-parallel stream, one per TP rank, and activation recompute
(`tensor_parallel.checkpoint`) saves the CPU generator, the CUDA generator and the tracker's
streams before the forward and restores them for the recompute, so dropout draws the same masks
twice. All of it reads and sets CUDA generator states. Without CUDA, :func:`use_cpu_rng_tracker`
makes the tracker keep its streams as CPU generator states (:class:`CPURNGStatesTracker`) and
makes megatron's CUDA-generator save and restore do nothing, there being no CUDA generator.
"""

import contextlib

import torch
from megatron.core.tensor_parallel import random as megatron_random

# megatron-core's RNG offsets (model_parallel_cuda_manual_seed): the model-parallel stream of a
# tensor-parallel rank starts at seed + 2718 + its rank.
_MODEL_PARALLEL_SEED_OFFSET = 2718


class CPURNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron's RNG-state tracker over the CPU generator: `add` keeps a named stream,
    `fork` runs a block on it and restores the default stream afterwards."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} or seed {seed} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"RNG stream {name!r} is not tracked")
        default_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(default_state)


def use_cpu_rng_tracker(seed: int, tp_rank: int) -> None:
    """Make megatron's tracker a :class:`CPURNGStatesTracker` with its model-parallel stream
    seeded as megatron seeds it on CUDA (one stream per TP rank), and megatron's save and restore
    of the CUDA generator (recompute) nothing. For machines without CUDA only. The tracker object
    stays the one megatron created (its class changes), so code holding it, such as checkpoint
    I/O, sees the streams."""
    tracker = megatron_random.get_cuda_rng_tracker()
    if type(tracker) is megatron_random.CudaRNGStatesTracker:
        tracker.__class__ = CPURNGStatesTracker
    elif not isinstance(tracker, CPURNGStatesTracker):
        raise TypeError(f"megatron's RNG tracker is a {type(tracker).__name__}; on CPU it must be megatron's "
                        f"CudaRNGStatesTracker, which use_cpu_rng_tracker runs on the CPU generator")
    tracker.reset()
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _set_no_cuda_rng_state


def _no_cuda_rng_state(*args, **kwargs) -> None:
    """megatron's `_get_cuda_rng_state` without CUDA: there is no CUDA generator to save."""
    return None


def _set_no_cuda_rng_state(state, *args, **kwargs) -> None:
    """megatron's `_set_cuda_rng_state` without CUDA: nothing was saved (`_no_cuda_rng_state`)."""
