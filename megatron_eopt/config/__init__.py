"""What a run is configured with: OptimizerConfig (optimizer_config.py), the rules on its values
(rules.py), the closed sets of its string fields (choices.py), the optimizer names known without
torch (optimizer_names.py) and the lr/wd scheduler's config (scheduler.py).

Everything but optimizer_config.py imports without torch, so command-line parsers can read it.
The names of the former module `megatron_eopt.config` are re-exported on first use, so that
`from megatron_eopt.config import OptimizerConfig` keeps working and a parser importing
choices.py does not import torch.
"""

from megatron_eopt.runtime.lazy_exports import lazy_exports

_LAZY = {name: "megatron_eopt.config.optimizer_config"
         for name in ("OptimizerConfig", "FieldUse", "MEGATRON_CORE_FIELDS", "as_optimizer_config")}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
