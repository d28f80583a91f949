"""What a run is configured with: OptimizerConfig (optimizer_config.py), the rules on its values
(rules.py), the closed sets of its string fields (choices.py), the optimizer names known without
torch (optimizer_names.py) and the lr/wd scheduler's config (scheduler.py).

Everything but optimizer_config.py imports without torch, so command-line parsers can read it.
This package re-exports nothing: `from megatron_eopt import OptimizerConfig`.
"""
