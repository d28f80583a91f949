"""ChainedOptimizer: several optimizers that step together under one gradient norm.

The chain clips every child by the norm over all children's gradients and skips all of them
when any gradient is inf/NaN. Its `param_groups` is the concatenation of the children's, in
order, and may be replaced as a whole (the lr scheduler only mutates groups in place).
"""

from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch

from megatron_eopt.wrappers.base import MegatronOptimizer, SteppableChild, StepResult, take_step
from megatron_eopt.checkpointing.megatron_sharded import child_sharded_state_dict
from megatron_eopt.wrappers.qk_clip import QKClip, qk_clip_step


class ChainedOptimizer(MegatronOptimizer):
    """Steps `chained_optimizers` (each an FP32Optimizer or MixedPrecisionOptimizer) as one."""

    # In megatron-core's sharded format a state's main replica is data-parallel rank 0, which
    # holds every state; the layer-wise optimizer sets this: there the owner writes it.
    owner_is_main_replica = False
    qk_clip: Optional[QKClip] = None  # set by the factory when QK-clip or max-logit logging is on
    # Megatron-LM skips optimizer calls on a rank whose optimizer is a stub (megatron-core builds
    # one for a rank without parameters); the factory never builds a chain without parameters.
    is_stub_optimizer = False

    def __init__(self, chained_optimizers: list[MegatronOptimizer]) -> None:
        children = list(chained_optimizers)
        if not children:
            raise ValueError("ChainedOptimizer needs at least one optimizer.")
        for child in children:
            if not isinstance(child, SteppableChild):
                raise TypeError(
                    f"ChainedOptimizer children must be FP32Optimizer/MixedPrecisionOptimizer "
                    f"(or another SteppableChild); got {type(child).__name__}."
                )
        names = [child.name for child in children]
        if len(set(names)) != len(names):
            raise ValueError(f"ChainedOptimizer children need distinct names; got {names}.")
        self.chained_optimizers = children

    @property
    def config(self) -> Any:
        return self.chained_optimizers[0].config

    def step(self) -> StepResult:
        with qk_clip_step(self.qk_clip):
            return take_step(self.chained_optimizers, self.config)

    @property
    def max_attention_logit(self) -> Optional[float]:
        """The largest attention logit of the last step (qk_clip/log_max_attention_logit), else None."""
        return self.qk_clip.max_attention_logit if self.qk_clip is not None else None

    @property
    def param_groups(self) -> list[dict]:
        return [group for child in self.chained_optimizers for group in child.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        sizes = [len(child.param_groups) for child in self.chained_optimizers]
        if len(value) != sum(sizes):
            raise ValueError(
                f"ChainedOptimizer.param_groups must keep its {sum(sizes)} groups (children hold "
                f"{sizes}); got {len(value)}."
            )
        start = 0
        for child, size in zip(self.chained_optimizers, sizes):
            child.param_groups = list(value[start : start + size])
            start += size

    @property
    def state(self) -> "ChainedState":
        return ChainedState([child.state for child in self.chained_optimizers])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.chained_optimizers:
            child.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.chained_optimizers[0].get_loss_scale()

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        for child in self.chained_optimizers:
            child.reload_model_params(state_dict)

    def prepare_model_params_for_param_sync(self) -> None:
        """Megatron-LM calls this before it forces a parameter all-gather. Nothing to stage:
        step() leaves every model parameter up to date (children copy their main params back,
        the layer-wise optimizer broadcasts from the owners)."""

    def state_dict(self, is_loading: bool = False) -> dict:
        """`is_loading`: Megatron-LM's torch_dcp load asks for a dict to load into; the state
        is created eagerly here, so the same dict serves both ways and the flag changes nothing."""
        return {"optimizers": {child.name: child.state_dict() for child in self.chained_optimizers}}

    def save_state_dict_to_file(self, filename: str) -> None:
        """This rank's state_dict() to `filename` (Megatron-LM's --ckpt-format torch with the
        layer-wise optimizer: one file per data-parallel rank, each holding its owned state)."""
        torch.save(self.state_dict(), filename)

    def load_state_dict_from_file(self, filename: str) -> None:
        """Load what save_state_dict_to_file wrote on this rank."""
        self.load_state_dict(torch.load(filename, weights_only=True))

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's format for dist_checkpointing (see checkpointing/megatron_sharded.py)."""
        return {"optimizers": {
            child.name: child_sharded_state_dict(child, model_sharded_state_dict, is_loading, self.owner_is_main_replica)
            for child in self.chained_optimizers
        }}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if saved is None:
            raise ValueError(
                "not a ChainedOptimizer state dict (no 'optimizers' entry); it was not written "
                "by megatron_eopt's ChainedOptimizer.state_dict()."
            )
        names = [child.name for child in self.chained_optimizers]
        if sorted(saved) != sorted(names):
            raise ValueError(
                f"the checkpoint holds optimizers {sorted(saved)} but this chain has {names}; "
                f"the optimizer or the parameter routing changed since it was saved."
            )
        for child in self.chained_optimizers:  # check all before loading any: never half-load
            child.check_state_dict(saved[child.name])
        for child in self.chained_optimizers:
            child.load_state_dict(saved[child.name])


class ChainedState(Mapping):
    """Read-only view of the children's `state` by parameter.

    torch keeps state in a defaultdict: a plain lookup would create empty entries in the first
    child (hiding a later child's state and breaking its state_dict), so look before reading.
    """

    def __init__(self, states: list[Mapping]) -> None:
        self._states = states

    def __getitem__(self, param: Any) -> Any:
        for state in self._states:
            if param in state:
                return state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[Any]:
        for state in self._states:
            yield from state

    def __len__(self) -> int:
        return sum(len(state) for state in self._states)

