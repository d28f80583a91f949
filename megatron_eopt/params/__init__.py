"""Parameters by name: per-parameter overrides (overrides.py: ParamKey, ParamGroupOverride), the
param groups and routing built from them (groups.py), and name helpers (names.py).

This package re-exports nothing: `from megatron_eopt import ParamKey`.
"""

# The table's q/k/v entries of the families whose rows fused_layouts.py does not describe (Falcon, MPT,
# GPTBigCode, CodeGen): registered whenever the table is, since every reader imports this package first.
from megatron_eopt.params import qkv_layouts  # noqa: E402,F401
# More families' fused weights (vision q/k/v, gated MLPs, DeBERTa, LFM's short convolutions, DeepSeek-V4, Flux)
# and the weights named like fused ones kept whole on purpose.
from megatron_eopt.params import zoo_layouts  # noqa: E402,F401
# GPT-2 style Conv1D c_attn ([in, out]: q, k, v are column blocks), each block one matrix of the
# weight's transposed view.
from megatron_eopt.params import conv1d_layouts  # noqa: E402,F401
