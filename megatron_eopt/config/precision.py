"""The rules on megatron-core's precision-aware optimizer fields (docs/memory.md), importable without torch.

`use_precision_aware_optimizer`, `store_param_remainders`, `main_params_dtype`, `exp_avg_dtype`,
`exp_avg_sq_dtype` and `main_grads_dtype` keep megatron-core's names, defaults and meanings. As
in megatron-core, every dtype field must be torch.float32 unless `use_precision_aware_optimizer`
is on. megatron-core allows it with adam and its byte-sharded distributed optimizer only; here
every registered optimizer and the replicated, layer-wise and torch FSDP2 layouts take it (FSDP2's
fp32 shards are the main weights, so there only the moment dtypes apply).

`check_precision_fields` raises a one-line ValueError for the first broken rule. It reads dtypes
by name, so it takes torch dtypes (an OptimizerConfig) as well as Megatron-LM's flag values
('fp32', 'bf16', 'fp16': a parsed command line, checked before torch is imported). A field that is
None is not given yet and has its default (fp32; off, but on for `store_param_remainders`).
Messages spell dtypes as torch does; arguments/validate.py's `flag_message` spells them as the
flags take them.
"""

from typing import Any, Optional

# torch's name of each dtype -> Megatron-LM's flag value (fp8 is refused, not emulated).
FLAG_VALUE_OF: dict[str, str] = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
TORCH_NAME_OF: dict[str, str] = {flag: name for name, flag in FLAG_VALUE_OF.items()}
STATE_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")  # what each state field may be
MAIN_GRADS_DTYPES = ("torch.float32", "torch.bfloat16")  # Megatron-LM's --main-grads-dtype choices
PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
FP32 = "torch.float32"


def dtype_name(value: Any) -> Optional[str]:
    """torch's name of a dtype given as a torch.dtype or as a flag value ('bf16' -> 'torch.bfloat16'); None stays None."""
    if value is None:
        return None
    return TORCH_NAME_OF.get(value, str(value)) if isinstance(value, str) else str(value)


def _on(config: Any, name: str) -> bool:
    """A switch, None (not given) as its default: off, but on for store_param_remainders."""
    value = getattr(config, name, None)
    return value is not False if name == "store_param_remainders" else bool(value)


def model_dtype_name(config: Any) -> str:
    return "torch.bfloat16" if _on(config, "bf16") else "torch.float16" if _on(config, "fp16") else FP32


def remainders_apply(config: Any) -> bool:
    """Whether bf16 parameters keep their fp32 main weight as the parameter plus a 16-bit remainder
    (megatron-core's rule: `store_param_remainders and bf16`, with the precision-aware optimizer)."""
    return all(_on(config, name) for name in ("use_precision_aware_optimizer", "store_param_remainders", "bf16"))


def check_precision_fields(config: Any) -> None:
    """Raise ValueError for the first precision-aware rule `config` breaks."""
    names = {name: dtype_name(getattr(config, name, None)) for name in PRECISION_FIELDS}
    if not _on(config, "use_precision_aware_optimizer"):
        for name, value in names.items():
            if value not in (None, FP32):
                raise ValueError(f"OptimizerConfig.{name} can only be torch.float32 without "
                                 f"use_precision_aware_optimizer=True (as in megatron-core); got {value}.")
        return
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
        if names[name] not in (None, *STATE_DTYPES):
            raise ValueError(f"OptimizerConfig.{name} must be one of {', '.join(STATE_DTYPES)} (fp8 optimizer "
                             f"state is not implemented); got {names[name]}.")
    if names["main_grads_dtype"] not in (None, *MAIN_GRADS_DTYPES):
        raise ValueError(f"OptimizerConfig.main_grads_dtype must be one of {', '.join(MAIN_GRADS_DTYPES)}; "
                         f"got {names['main_grads_dtype']}.")
    _check_main_params_dtype(config, names["main_params_dtype"])


def _check_main_params_dtype(config: Any, main: Optional[str]) -> None:
    # The model's dtype first: a value no setting of the remainders allows is refused as such.
    if main in (None, FP32):
        return
    model = model_dtype_name(config)
    if model == FP32:
        raise ValueError(f"OptimizerConfig.main_params_dtype must be torch.float32 for an fp32 model (16-bit main "
                         f"weights need bf16=True or fp16=True); got {main}.")
    model_switch = "bf16=True" if model == "torch.bfloat16" else "fp16=True"
    if main != model:
        raise ValueError(f"OptimizerConfig.main_params_dtype must be torch.float32 or the model's own 16-bit dtype, "
                         f"{model} with {model_switch}; got {main}.")
    if remainders_apply(config):
        raise ValueError(f"OptimizerConfig.main_params_dtype {main} with {model_switch} needs "
                         f"store_param_remainders=False: by default the main weights are exact fp32, each the bf16 "
                         f"parameter plus a 16-bit remainder. Allowed: main_params_dtype torch.float32, or "
                         f"{main} with store_param_remainders=False.")
