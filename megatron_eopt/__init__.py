"""megatron_eopt: the optimizer layer of Megatron-style training.

`get_megatron_optimizer(config, model_chunks)` returns a ready optimizer with megatron-core's
contract. This module only re-exports, lazily: importing it imports neither torch nor megatron-core.
"""

from megatron_eopt.runtime.lazy_exports import lazy_exports

# Public name -> the module that defines it, imported on first use (PEP 562), so that
# `import arguments` or the trainer's flag parser does not import torch.
_LAZY = {
    "AdamOptimizerConfig": "megatron_eopt.config.optimizer_config",
    "OptimizerConfig": "megatron_eopt.config.optimizer_config",
    "SGDOptimizerConfig": "megatron_eopt.config.optimizer_config",
    "LayerWiseDistributedOptimizer": "megatron_eopt.distributed.layer_wise",
    "ParallelGroups": "megatron_eopt.runtime.process_groups",
    "get_megatron_optimizer": "megatron_eopt.factory",
    "ParamGroupOverride": "megatron_eopt.params.overrides",
    "ParamKey": "megatron_eopt.params.overrides",
    "ParamPredicate": "megatron_eopt.params.overrides",
    "ParamWithNamePredicate": "megatron_eopt.params.overrides",
    "get_standard_config_overrides": "megatron_eopt.params.overrides",
    "TensorParallelAdaptiveMuon": "megatron_eopt.optimizers.muon.tensor_parallel_adaptive_muon",
    "TensorParallelMuon": "megatron_eopt.optimizers.muon.tensor_parallel_muon",
    "EmergingOptimizerEntry": "megatron_eopt.registry",
    "OptimizerEntry": "megatron_eopt.registry",
    "list_optimizers": "megatron_eopt.registry",
    "lookup_optimizer": "megatron_eopt.registry",
    "register_emerging_optimizer": "megatron_eopt.registry",
    "register_optimizer": "megatron_eopt.registry",
    "MegatronOptimizer": "megatron_eopt.wrappers.base",
    "ChainedOptimizer": "megatron_eopt.wrappers.chained",
    "FP32Optimizer": "megatron_eopt.wrappers.fp32",
    "ConstantGradScaler": "megatron_eopt.wrappers.grad_scaler",
    "DynamicGradScaler": "megatron_eopt.wrappers.grad_scaler",
    "MixedPrecisionOptimizer": "megatron_eopt.wrappers.mixed_precision",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
