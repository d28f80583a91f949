"""The rules on megatron-core's precision-aware optimizer fields (docs/memory.md).

`use_precision_aware_optimizer`, `store_param_remainders`, `main_params_dtype`, `exp_avg_dtype`,
`exp_avg_sq_dtype` and `main_grads_dtype` keep megatron-core's names, defaults and meanings. As
in megatron-core, every dtype field must be torch.float32 unless `use_precision_aware_optimizer`
is on. megatron-core allows it with adam and its byte-sharded distributed optimizer only; here
every registered optimizer and the replicated, layer-wise and torch FSDP2 layouts take it (FSDP2's
fp32 shards are the main weights, so there only the moment dtypes apply). `check_precision_fields` raises a one-line ValueError for the first broken rule.
"""

from typing import Any

import torch

# What each field may be set to (megatron-core's field types; fp8 is refused, not emulated).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAIN_GRADS_DTYPES = (torch.float32, torch.bfloat16)  # Megatron-LM's --main-grads-dtype choices
PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d) for d in dtypes)


def remainders_apply(config: Any) -> bool:
    """Whether bf16 parameters keep their fp32 main weight as the parameter plus a 16-bit remainder
    (megatron-core's rule: `store_param_remainders and bf16`, with the precision-aware optimizer)."""
    return bool(config.use_precision_aware_optimizer and config.store_param_remainders and config.bf16)


def check_precision_fields(config: Any) -> None:
    """Raise ValueError for the first precision-aware rule `config` breaks."""
    if not config.use_precision_aware_optimizer:
        for name in PRECISION_FIELDS:
            value = getattr(config, name)
            if value != torch.float32:
                raise ValueError(f"OptimizerConfig.{name} can only be torch.float32 without "
                                 f"use_precision_aware_optimizer=True (as in megatron-core); got {value}.")
        return
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
        value = getattr(config, name)
        if value not in STATE_DTYPES:
            raise ValueError(f"OptimizerConfig.{name} must be one of {dtype_names(STATE_DTYPES)} (fp8 optimizer "
                             f"state is not implemented); got {value}.")
    if config.main_grads_dtype not in MAIN_GRADS_DTYPES:
        raise ValueError(f"OptimizerConfig.main_grads_dtype must be one of {dtype_names(MAIN_GRADS_DTYPES)}; "
                         f"got {config.main_grads_dtype}.")
    _check_main_params_dtype(config)


def _check_main_params_dtype(config: Any) -> None:
    main = config.main_params_dtype
    if main == torch.float32:
        return
    if remainders_apply(config):
        raise ValueError(f"OptimizerConfig.main_params_dtype={main} conflicts with store_param_remainders=True, "
                         f"which keeps exact fp32 main weights for bf16 parameters; set one of them back.")
    model_dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    if main != model_dtype:
        raise ValueError(f"OptimizerConfig.main_params_dtype must be torch.float32 or the model's own 16-bit dtype "
                         f"({model_dtype} with bf16={config.bf16}, fp16={config.fp16}); got {main}.")
