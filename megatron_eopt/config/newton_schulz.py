"""The Newton-Schulz settings a config asks for, importable without torch.

`muon_fp32_matmul_prec`, `muon_coefficient_type` and `muon_num_ns_steps` reach every optimizer
that orthogonalizes by Newton-Schulz. Left at megatron-core's defaults (`MegatronCoreDefault`),
they give way: to Turbo-Muon's coefficients and steps when `muon_aol_preconditioner` is on, and to
an emerging optimizer's own defaults (PolarGrad's 'highest' precision) in the others.
"""

from typing import Any

from megatron_eopt.config.choices import (
    TURBO_MUON_COEFFICIENT_TYPE,
    TURBO_MUON_NUM_NS_STEPS,
    is_megatron_core_default,
)

# OptimizerConfig field -> the constructor argument of emerging_optimizers' orthogonalized optimizers.
NEWTON_SCHULZ_FIELDS = {"muon_fp32_matmul_prec": "fp32_matmul_prec", "muon_coefficient_type": "coefficient_type",
                        "muon_num_ns_steps": "num_ns_steps"}


def coefficients_and_steps(config: Any) -> tuple[str, int]:
    """(coefficient type, steps) of Muon's Newton-Schulz: Turbo-Muon's for those left at
    megatron-core's defaults when the AOL preconditioner is on."""
    coefficient_type, steps = config.muon_coefficient_type, config.muon_num_ns_steps
    if getattr(config, "muon_aol_preconditioner", False):
        if is_megatron_core_default(coefficient_type):
            coefficient_type = TURBO_MUON_COEFFICIENT_TYPE
        if is_megatron_core_default(steps):
            steps = TURBO_MUON_NUM_NS_STEPS
    return str(coefficient_type), int(steps)


def fields_set(config: Any) -> dict[str, Any]:
    """The Newton-Schulz fields given a value of their own (not None, not megatron-core's default)."""
    values = {name: getattr(config, name, None) for name in NEWTON_SCHULZ_FIELDS}
    return {name: value for name, value in values.items() if value is not None and not is_megatron_core_default(value)}
