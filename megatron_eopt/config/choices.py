"""The closed sets of OptimizerConfig's string fields, importable without torch.

`megatron_eopt.config.optimizer_config` re-exports them; command-line parsers read them here so
that building a parser (and `--help`) does not import torch.
"""

from typing import Any, Literal

ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
# 'auto': per matrix, the exact mode (duplicated, distributed, sharded) predicted cheapest.
TpMode = Literal["blockwise", "duplicated", "distributed", "sharded", "auto"]
# What muon_tp_mode='auto' predicts with: named figures ('h100'), or rates calibrated here ('cpu');
# ops/muon_cost.py holds them (tests/unit/library/ops/test_muon_cost.py checks the two agree).
HardwareProfileName = Literal["h100", "cpu"]
# What emerging_optimizers' `FP32MatmulPrecT` and `torch.set_float32_matmul_precision` accept
# (Megatron-LM's 'low' is neither); the one list of them: config checks and command-line choices
# read it, and tests/unit/library/config/test_optimizer_config.py checks it against the installed emerging_optimizers.
MatmulPrecision = Literal["highest", "high", "medium"]
ScalarOptimizer = Literal["adam", "lion"]
AdaptiveMoment2Method = Literal["adamuon", "normuon"]

# Turbo-Muon's Newton-Schulz (muon_aol_preconditioner), for the fields the user left at megatron-core's
# defaults (`MegatronCoreDefault`): one step fewer than megatron-core's quintic x 5, as the paper's code
# runs quintic steps after the preconditioner. Not emerging_optimizers' 'aol' set: its 4 steps map
# singular values above 0.87 to negative ones, and the preconditioner puts the largest near 1.
TURBO_MUON_COEFFICIENT_TYPE, TURBO_MUON_NUM_NS_STEPS = "quintic", 4


class MegatronCoreDefault:
    """A field's value left at megatron-core's default by the user, as opposed to one set to it.

    Mixed into the value's own type (`megatron_core_default("quintic")` is a str), so it reads,
    compares, prints and serializes as that value. Where an option brings defaults of its own
    (Turbo-Muon's coefficients and steps; an emerging optimizer's own matmul precision), they
    replace this value and never one the user set: any value assigned or parsed is a plain one.
    Copies keep the mark; pickles drop it, so a pickled config loads where megatron_eopt is not
    installed. Namespaces that get pickled into checkpoints (Megatron-LM's args, loaded weights-only)
    hold plain values: its integration records the given flags instead (integrations/megatron_lm.py).
    """

    __slots__ = ()

    def __copy__(self) -> "MegatronCoreDefault":
        return self

    def __deepcopy__(self, memo: dict) -> "MegatronCoreDefault":
        return self

    def __reduce__(self) -> tuple:
        plain = plain_value(self)
        return type(plain), (plain,)


class _DefaultStr(MegatronCoreDefault, str):
    __slots__ = ()


class _DefaultInt(MegatronCoreDefault, int):
    __slots__ = ()


def megatron_core_default(value: Any) -> Any:
    """`value` marked as megatron-core's default (a str or an int)."""
    return {str: _DefaultStr, int: _DefaultInt}[type(value)](value)


def is_megatron_core_default(value: Any) -> bool:
    return isinstance(value, MegatronCoreDefault)


def plain_value(value: Any) -> Any:
    """`value` without the mark (a plain str or int); anything else as it is."""
    if isinstance(value, _DefaultStr):
        return str(value)
    return int(value) if isinstance(value, _DefaultInt) else value
