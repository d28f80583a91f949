"""What checkpoints read of an optimizer child, so that the formats (megatron_core_formats/, checkpointing/)
and the wrappers that implement it (wrappers/fp32.py and its subclasses) depend on this contract
and not on each other: `CheckpointableChild`'s methods, the `ChildParam` each parameter is seen as,
and `param_group_identifier`, the values that tell param groups apart on load (megatron-core's
`param_group_identifier_keys`).
"""

from typing import Any, Mapping, NamedTuple, Protocol

import torch

from megatron_eopt.params.overrides import ParamGroupOverride

# megatron-core's `param_group_identifier_keys`: what tells param groups apart on load, every
# ParamGroupOverride field (and `optimizer`), then the structural flags every group carries.
PARAM_GROUP_IDENTIFIER_KEYS: tuple[str, ...] = (
    *sorted({*ParamGroupOverride.__annotations__, "optimizer"}), "lr_mult", "is_expert_parallel", "is_decoupled_lr",
)


def param_group_identifier(group: Mapping[str, Any]) -> tuple:
    """A group's identifying values: a missing key counts as None; NeMo's `pre_<key>` stands in."""
    return tuple(group.get(key, group.get(f"pre_{key}")) for key in PARAM_GROUP_IDENTIFIER_KEYS)


class ChildParam(NamedTuple):
    """One parameter a child steps, as checkpoints see it (CheckpointableChild.checkpoint_params)."""

    fqn: str  # its name here (named_trainable_parameters)
    model: torch.nn.Parameter  # the model's parameter
    main: torch.nn.Parameter  # what the inner optimizer steps: `model` itself, an fp32 copy, or an FSDP2 shard
    state: dict  # the inner optimizer's state of `main`, live (empty before its first step)
    # its name in DTensor optimizer state (torch DCP, fsdp_dtensor): `fqn`, or a routed expert's on a
    # mesh of its own by global index; "" when its expert layout has none (ParamRecord.stored_name)
    stored_name: str
    # whether `stored_name` is a routed expert's global name (on EP rank 0 it can equal `fqn`)
    globally_named: bool = False


class CheckpointableChild(Protocol):
    """What checkpointing/ reads of a child (FP32Optimizer and its subclasses): these methods only,
    so that the wrappers can change how they hold parameters and the inner optimizer freely."""

    name: str
    config: Any  # the OptimizerConfig (megatron-core's format depends on bf16/fp16 and the optimizer)
    grad_scaler: Any
    fqn_of_main: dict[int, str]  # id(main parameter) -> fqn

    @property
    def param_groups(self) -> list[dict]: ...  # the inner optimizer's, live (the schedule sets lr bounds)

    def checkpoint_params(self) -> list[ChildParam]: ...

    def fp32_main_params(self) -> list[torch.Tensor]: ...  # parallel to checkpoint_params()

    def set_main_params(self, values: dict[int, torch.Tensor]) -> None: ...

    def hyperparameter_names(self) -> tuple[str, ...]: ...  # the inner optimizer's defaults

    def inner_class_name(self) -> str: ...

    def init_state(self) -> None: ...  # state tensors exist before a sharded load fills them

    def state_dict(self, is_loading: bool = False) -> dict: ...

    def local_state_dict(self) -> dict: ...  # state_dict() with plain tensors (this rank's shards)

    def load_state_dict(self, state_dict: dict) -> None: ...
