"""torchtitan's Trainer with our optimizer, named in its job config in one line:
`optimizer=MegatronOptimizers.Config(optimizer_config=OptimizerConfig(optimizer="muon", ...))`.

torchtitan builds `config.optimizer.build(model_parts=...)` and expects an `OptimizersContainer`: a
torch optimizer over the container, iterable over the optimizers its lr schedulers wrap. The container
built here holds one optimizer, `get_megatron_optimizer(optimizer_config, model_parts)`. torchtitan keeps
its own lr schedule (a LambdaLR on ours), its clipping (set `clip_grad=0.0`: the engine clips) and its
checkpoints: the container's `state_dict()` is torchtitan's, keyed by parameter name from our torch-layout
`state_dict()` (its `param_names`), saved through DCP. Its FSDP2 and tensor parallelism (alone or
together) need nothing here: the optimizer takes their DTensor placements (docs/fsdp2.md, "Other placements").
This module imports torchtitan; `import megatron_eopt` never imports this module.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.optimizer import OptimizersContainer

from megatron_eopt import factory

# OptimizersContainer.Config's own fields pick torchtitan's optimizers; ours routes by its OptimizerConfig.
_TORCHTITAN_ONLY_FIELDS = {"param_groups": [], "optimizer_factory_kwargs_by_name": {}, "implementation": "fused"}


class MegatronOptimizers(OptimizersContainer):
    """torchtitan's optimizer container holding megatron_eopt's optimizer (`self.optimizers == [ours]`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        optimizer_config: Any = None
        """megatron_eopt's (or megatron-core's) OptimizerConfig."""

        config_overrides: Any = None
        """get_megatron_optimizer's config_overrides (None: the standard ones)."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        _check(config)
        self.model_parts = model_parts
        self.optimizers = [factory.get_megatron_optimizer(config.optimizer_config, model_parts,
                                                          config_overrides=config.config_overrides)]
        # torch's Optimizer.__init__ on the container gives it step hooks (torchtitan's MoE
        # load balancing registers one), as OptimizersContainer does.
        params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
        torch.optim.Optimizer.__init__(self, params, {})


def _check(config: "MegatronOptimizers.Config") -> None:
    if config.optimizer_config is None:
        raise ValueError("MegatronOptimizers.Config needs optimizer_config=OptimizerConfig(...) "
                         "(megatron_eopt's or megatron-core's)")
    changed = [name for name, default in _TORCHTITAN_ONLY_FIELDS.items() if getattr(config, name) != default]
    if changed:
        raise ValueError(f"MegatronOptimizers.Config: {', '.join(changed)} choose torchtitan's own optimizers and "
                         "are not read here; route parameters with optimizer_config and config_overrides instead")
