"""Deprecated entry point `get_megatron_muon_optimizer`, kept because old callers still use it.

megatron-core (<= 0.15) built Muon through `megatron.core.optimizer.muon.get_megatron_muon_optimizer`
with a `layer_wise_distributed_optimizer` flag; Megatron-LM and older Megatron-Bridge call it for
every matrix optimizer (Bridge sends 'soap' here too). Everything it did is now
`get_megatron_optimizer` with `OptimizerConfig.use_layer_wise_distributed_optimizer`; this
shim forwards there with a DeprecationWarning that says what to write instead.
"""

import dataclasses
import warnings
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from megatron_eopt import factory
from megatron_eopt.config.optimizer_config import OptimizerConfig, as_optimizer_config
from megatron_eopt.registry import lookup_optimizer

# Arguments of megatron-core's older optimizer getters; accepted only at their no-op defaults.
_LEGACY_DEFAULTS = {"no_weight_decay_cond": None, "scale_lr_cond": None, "lr_mult": 1.0}


def get_megatron_muon_optimizer(
    config: Any,
    model_chunks: Union[torch.nn.Module, Iterable[torch.nn.Module]],
    config_overrides: Optional[Mapping[Any, Mapping[str, Any]]] = None,
    use_gloo_process_groups: bool = True,
    layer_wise_distributed_optimizer: bool = False,
    pg_collection: Any = None,
    dump_param_to_param_group_map: Optional[str] = None,
    **unused: Any,
) -> Any:
    """Deprecated: forwards to `megatron_eopt.get_megatron_optimizer`.

    `layer_wise_distributed_optimizer=True` (or the legacy name 'dist_<optimizer>') becomes
    `use_layer_wise_distributed_optimizer=True` on a copy of `config`; the caller's config is
    never changed. `config.optimizer` must name a matrix optimizer (Muon and the other emerging
    optimizers that route scalars to `muon_scalar_optimizer`); for adam, sgd, lion, ... call
    `get_megatron_optimizer` directly.
    """
    _check_unused(unused)
    forwarded, replacement = _forwarded_config(config, layer_wise_distributed_optimizer)
    warnings.warn(
        f"get_megatron_muon_optimizer is deprecated and forwards to get_megatron_optimizer; write "
        f"{replacement} instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    return factory.get_megatron_optimizer(
        forwarded,
        model_chunks,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
        dump_param_to_param_group_map=dump_param_to_param_group_map,
    )


def _forwarded_config(config: Any, layer_wise: bool) -> tuple[OptimizerConfig, str]:
    """A copy of `config` for get_megatron_optimizer, and the call to suggest in the warning."""
    base = as_optimizer_config(config)
    name = base.optimizer
    if name.startswith(factory.LEGACY_DISTRIBUTED_PREFIX):
        name, layer_wise = name[len(factory.LEGACY_DISTRIBUTED_PREFIX):], True
    _check_matrix_optimizer(base.optimizer, name)
    changes: dict[str, Any] = {"optimizer": name}
    if layer_wise:
        changes["use_layer_wise_distributed_optimizer"] = True
    # replace() builds a new object (validated again by __post_init__); `config` stays as it was.
    forwarded = dataclasses.replace(base, **changes)
    settings = ", ".join(f"{k}={v!r}" for k, v in changes.items() if getattr(base, k) != v)
    config_text = f"the config with {settings}" if settings else "the config"
    return forwarded, f"get_megatron_optimizer({config_text}, model_chunks, ...)"


def _check_matrix_optimizer(given: str, name: str) -> None:
    if lookup_optimizer(name).routing == "all":  # an unknown name raises, listing the valid ones
        raise ValueError(
            f"get_megatron_muon_optimizer builds Muon-family (matrix) optimizers; got "
            f"optimizer={given!r}, which takes every parameter. Call "
            f"megatron_eopt.get_megatron_optimizer(config, model_chunks) instead."
        )


def _check_unused(unused: Mapping[str, Any]) -> None:
    ignored = {k: v for k, v in unused.items() if k not in _LEGACY_DEFAULTS or v != _LEGACY_DEFAULTS[k]}
    if ignored:
        raise TypeError(
            f"get_megatron_muon_optimizer got arguments it cannot honour: "
            f"{', '.join(f'{k}={v!r}' for k, v in ignored.items())}. Per-parameter weight decay and "
            f"lr go in config_overrides (ParamKey -> ParamGroupOverride)."
        )
