"""megatron_eopt: the optimizer layer of Megatron-style training.

`get_megatron_optimizer(config, model_chunks)` returns a ready optimizer with megatron-core's
contract. This module only re-exports; importing it does not import megatron-core.
"""

from megatron_eopt.config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from megatron_eopt.distributed.layer_wise import LayerWiseDistributedOptimizer
from megatron_eopt.distributed.process_groups import ParallelGroups
from megatron_eopt.factory import get_megatron_optimizer
from megatron_eopt.param_key import (
    ParamGroupOverride,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    get_standard_config_overrides,
)
from megatron_eopt.optimizers.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon
from megatron_eopt.optimizers.tensor_parallel_muon import TensorParallelMuon
from megatron_eopt.registry import (
    EmergingOptimizerEntry,
    OptimizerEntry,
    list_optimizers,
    lookup_optimizer,
    register_emerging_optimizer,
    register_optimizer,
)
from megatron_eopt.wrappers.base import MegatronOptimizer
from megatron_eopt.wrappers.chained import ChainedOptimizer
from megatron_eopt.wrappers.fp32 import FP32Optimizer
from megatron_eopt.wrappers.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_eopt.wrappers.mixed_precision import MixedPrecisionOptimizer

__all__ = [
    "AdamOptimizerConfig",
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "EmergingOptimizerEntry",
    "FP32Optimizer",
    "LayerWiseDistributedOptimizer",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "OptimizerEntry",
    "ParallelGroups",
    "ParamGroupOverride",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
    "SGDOptimizerConfig",
    "TensorParallelAdaptiveMuon",
    "TensorParallelMuon",
    "get_megatron_optimizer",
    "get_standard_config_overrides",
    "list_optimizers",
    "lookup_optimizer",
    "register_emerging_optimizer",
    "register_optimizer",
]
