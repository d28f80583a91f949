"""megatron-core 0.19.2's optimizer checkpoint layouts: the one table of them.

`CORE_FORMATS`: where each kind of megatron-core optimizer keeps its state in `state_dict()`;
`LAYOUTS`: the names `metadata[LAYOUT_KEY]` gives a sharded checkpoint's optimizer layout; the keys
our state dicts add. dist_checkpointing.py writes and reads them, layer_wise_optimizer.py joins children.
"""

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_eopt.checkpointable.child import CheckpointableChild

LAYOUT_KEY = "eopt_optimizer_layout"
MEGATRON_CORE_LAYOUT = "megatron_core"  # what this module writes: megatron-core's optimizer of the same kind's
# with a distributed-optimizer format in the metadata: its DistributedOptimizer's fully_reshardable
MEGATRON_CORE_DISTRIBUTED_LAYOUT = "megatron_core_distributed"
# the same for an emerging optimizer's run: megatron-core's layer-wise chain (`kept_by_layer_wise`)
MEGATRON_CORE_LAYER_WISE_LAYOUT = "megatron_core_layer_wise"
# its layer-wise chain over an all-reducing DDP (its "ping-pong" path, as Megatron-LM's pretrain_gpt.py
# builds it): every child keyed by parameter as the layer-wise one, the sharding type as given
MEGATRON_CORE_PING_PONG_LAYOUT = "megatron_core_layer_wise_ping_pong"
EOPT_V1_LAYOUT = "megatron_eopt_v1"  # keyed by our child names: written before megatron-core's layout
LAYOUTS = (MEGATRON_CORE_LAYOUT, MEGATRON_CORE_DISTRIBUTED_LAYOUT, MEGATRON_CORE_LAYER_WISE_LAYOUT,
           MEGATRON_CORE_PING_PONG_LAYOUT, EOPT_V1_LAYOUT)
DISTRIBUTED_LAYOUTS = (MEGATRON_CORE_DISTRIBUTED_LAYOUT, MEGATRON_CORE_LAYER_WISE_LAYOUT)
STATE_PREFIX = "optimizer.state"  # + .<state name>.<model key>
MAIN_PARAM_STATE = "fp32_param"
COMMON_STEP = "common_step"
EXTRA_SCALARS = "eopt_scalar_state"
# State of other shapes than its parameter's (SOAP's factors, NorMuon's second moment), which
# megatron-core has no key for: {index: {name: ShardedObject keyed `eopt_own_state.<name>.<model key>`}}.
OWN_STATE = "eopt_own_state"
# Fields of our param groups that megatron-core's do not have (it records no names).
OWN_GROUP_FIELDS = ("params", "param_fqns", "group_key")
# megatron-core's DistributedOptimizer formats keyed by parameter (DistributedOptimizer.
# checkpoint_fully_reshardable_formats); the others are keyed by its DDP buckets (distributed_optimizer.py).
PARAMETER_KEYED_FORMATS = ("fully_reshardable", "fully_sharded_model_space")


@dataclass(frozen=True)
class CoreFormat:
    """Where one kind of megatron-core optimizer keeps its state in `state_dict()` (optimizer.py)."""

    kind: str  # megatron-core's class
    torch_state_key: Optional[str]  # torch's optimizer state dict: the dict itself (None) or under this key
    main_params_key: Optional[str]  # fp32 main copies of the 16-bit parameters, one list per param group
    # DistributedOptimizer: per-parameter state under this key instead of torch's 'state' (read only),
    # with the fp32 main copy as its state `param`, and the step in each param group.
    param_state_key: Optional[str] = None
    sharding_type: Optional[str] = None  # DistributedOptimizer: its `param_state_sharding_type`
    # dp_reshardable: each state tensor is a range of a DDP bucket (distributed_optimizer.py), read flat.
    keyed_by_bucket: bool = False


# DistributedOptimizer's `dp_zero_gather_scatter` and `fully_sharded_bucket_space` (deprecated) are not read.
CORE_FORMATS = {
    "distributed_fully_reshardable": CoreFormat("DistributedOptimizer (fully_reshardable)", "optimizer", None,
                                                "param_state", "fully_reshardable"),
    "distributed_dp_reshardable": CoreFormat("DistributedOptimizer (dp_reshardable)", "optimizer", None,
                                             "param_state", "dp_reshardable", keyed_by_bucket=True),
    "fp32": CoreFormat("FP32Optimizer", None, None),
    "float16": CoreFormat("Float16OptimizerWithFloat16Params", "optimizer", "fp32_from_fp16_params"),
}
DISTRIBUTED_MAIN_PARAM = "param"
SHARDING_TYPE_KEY = "param_state_sharding_type"
# dp_reshardable keeps the param groups in a sharded object without their parameters; a load request
# carries ours here, as the other formats' requests carry them in the groups themselves.
GROUP_PARAMS = "eopt_param_group_params"
READ_DISTRIBUTED_FORMATS = {f.sharding_type: f for f in CORE_FORMATS.values() if f.sharding_type is not None}


def core_format_of(child: CheckpointableChild) -> CoreFormat:
    """megatron-core's kind for the child: Float16... when the run is bf16/fp16, as its factory builds."""
    config = child.config
    return CORE_FORMATS["float16" if config.bf16 or config.fp16 else "fp32"]


def core_format_in(state_dict: Any) -> Optional[CoreFormat]:
    """The megatron-core format `state_dict` is in, or None (ours, or not a state dict)."""
    if not isinstance(state_dict, Mapping):
        return None
    for layout in CORE_FORMATS.values():
        torch_state = state_dict if layout.torch_state_key is None else state_dict.get(layout.torch_state_key)
        if (isinstance(torch_state, Mapping) and isinstance(torch_state.get("param_groups"), list)
                and (layout.param_state_key is None or (layout.param_state_key in state_dict and state_dict.get(
                    SHARDING_TYPE_KEY) == layout.sharding_type))):
            return layout
    return None


def torch_state_of(state_dict: Mapping, layout: CoreFormat) -> Mapping:
    return state_dict if layout.torch_state_key is None else state_dict[layout.torch_state_key]
