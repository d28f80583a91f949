"""Megatron-Bridge style set-up: `setup_optimizer(optimizer_config, scheduler_config, model)`.

Megatron-Bridge's `setup_optimizer` builds the optimizer and megatron-core's
`OptimizerParamScheduler` from two configs; this module offers the same call:
- `SchedulerConfig`: Bridge's scheduler fields, plus `global_batch_size` and `train_iters` or
  `train_samples`, which Bridge reads from its `TrainingConfig`. Checked in `__post_init__`
  (re-run with `finalize()`).
- `setup_optimizer(...) -> (optimizer, scheduler)`: the optimizer through
  `optimizer_config.provide(...)` when the config has that hook, else `get_megatron_optimizer`.
  The scheduler counts steps in samples, so the trainer calls `scheduler.step(global_batch_size)`.
- `OptimizerConfigOverrideProvider` and its context: Bridge's hook for per-parameter overrides.
- `to_dict/from_dict/to_yaml/from_yaml` for both configs (YAML needs PyYAML).
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

import torch

from megatron_eopt import factory
from megatron_eopt.config.choices import is_megatron_core_default
from megatron_eopt.config.scheduler import (  # noqa: F401 (re-exported)
    LrDecayStyle,
    SchedulerConfig,
    WdIncrStyle,
    WsdDecayStyle,
    check_weight_decay_pair,
)

ConfigOverrides = Optional[Mapping[Any, Mapping[str, Any]]]
ModelChunks = Union[torch.nn.Module, Iterable[torch.nn.Module]]


# ------------------------------------------------------------------------------------------------
# Config overrides (Megatron-Bridge's hook)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerConfigOverrideProviderContext:
    """What an override provider sees (Megatron-Bridge's field names)."""

    scheduler_config: SchedulerConfig
    optimizer_config: Any
    model: Any


class OptimizerConfigOverrideProvider:
    """Bridge's hook: `build_config_overrides(context) -> {ParamKey: ParamGroupOverride} | None`.

    The default returns None, which makes `get_megatron_optimizer` use its standard overrides
    (no weight decay on biases and 1-D parameters, decoupled lr on embedding/output). Subclass
    and override `build_config_overrides` to change them; `{}` means no overrides at all.
    """

    def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext) -> ConfigOverrides:
        return None


def _config_overrides(provider: Any, context: OptimizerConfigOverrideProviderContext) -> ConfigOverrides:
    """Accepts Bridge's provider object, or a callable taking the same context."""
    if provider is None:
        return None
    if hasattr(provider, "build_config_overrides"):
        return provider.build_config_overrides(context)
    if callable(provider):
        return provider(context)
    raise TypeError(
        f"optimizer_config_override_provider must have a build_config_overrides(context) method "
        f"or be a callable taking OptimizerConfigOverrideProviderContext; got {type(provider).__name__}."
    )


# ------------------------------------------------------------------------------------------------
# setup_optimizer
# ------------------------------------------------------------------------------------------------


def setup_optimizer(
    optimizer_config: Any,
    scheduler_config: SchedulerConfig,
    model: ModelChunks,
    use_gloo_process_groups: bool = False,
    pg_collection: Any = None,
    optimizer_config_override_provider: Any = None,
) -> tuple[Any, Any]:
    """Build `(optimizer, scheduler)` as Megatron-Bridge does.

    Args:
        optimizer_config: our OptimizerConfig (or any config with a `provide(model_chunks=,
            config_overrides=, use_gloo_process_groups=, pg_collection=)` hook), or
            megatron-core's OptimizerConfig (built through get_megatron_optimizer).
        scheduler_config: SchedulerConfig; its step counts are in samples.
        model: a module or a list of model chunks.
        optimizer_config_override_provider: None (standard overrides), an object with
            `build_config_overrides(OptimizerConfigOverrideProviderContext)` (Bridge's API), or a
            callable taking that context; either returns config_overrides (None: standard).
    Returns:
        The optimizer and megatron-core's OptimizerParamScheduler; call
        `scheduler.step(global_batch_size)` after each successful optimizer step.
    """
    scheduler_config.finalize()  # it may have been mutated since construction
    context = OptimizerConfigOverrideProviderContext(scheduler_config, optimizer_config, model)
    config_overrides = _config_overrides(optimizer_config_override_provider, context)
    build = getattr(optimizer_config, "provide", None)
    if build is None:
        optimizer = factory.get_megatron_optimizer(
            optimizer_config, model, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
        )
    else:
        optimizer = build(
            model_chunks=model, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
        )
    return optimizer, get_scheduler(optimizer_config, scheduler_config, optimizer)


def get_scheduler(optimizer_config: Any, scheduler_config: SchedulerConfig, optimizer: Any) -> Any:
    """megatron-core's OptimizerParamScheduler over `optimizer`, steps counted in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    max_lr, min_lr = optimizer_config.lr, optimizer_config.min_lr
    _check_learning_rates(max_lr, min_lr, scheduler_config.lr_warmup_init, optimizer.param_groups)
    start_wd, end_wd = _weight_decay_range(optimizer_config, scheduler_config)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=scheduler_config.lr_warmup_init,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=scheduler_config.lr_warmup_steps,
        lr_decay_steps=scheduler_config.lr_decay_steps,
        lr_decay_style=scheduler_config.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=scheduler_config.wd_incr_steps,
        wd_incr_style=scheduler_config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=scheduler_config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=scheduler_config.override_opt_param_scheduler,
        wsd_decay_steps=scheduler_config.wsd_decay_steps,
        lr_wsd_decay_style=scheduler_config.lr_wsd_decay_style,
    )


def _check_learning_rates(max_lr: Any, min_lr: Any, init_lr: float, param_groups: list[dict]) -> None:
    """What megatron-core's scheduler asserts, as errors that say what to set."""
    if max_lr is None or min_lr is None:
        raise ValueError(
            f"the scheduler needs OptimizerConfig.lr and OptimizerConfig.min_lr (e.g. min_lr=0.0); "
            f"got lr={max_lr}, min_lr={min_lr}."
        )
    if init_lr > max_lr:
        raise ValueError(
            f"SchedulerConfig.lr_warmup_init ({init_lr}) must not exceed OptimizerConfig.lr ({max_lr})."
        )
    for group in param_groups:
        if group.get("max_lr", max_lr) is None or group.get("min_lr", min_lr) is None:
            raise ValueError(
                f"param group {group.get('group_key', '?')!r} has max_lr={group.get('max_lr')}, "
                f"min_lr={group.get('min_lr')}; set both (e.g. decoupled_min_lr with decoupled_lr)."
            )


def _weight_decay_range(optimizer_config: Any, scheduler_config: SchedulerConfig) -> tuple[float, float]:
    start = scheduler_config.start_weight_decay
    end = scheduler_config.end_weight_decay
    start = optimizer_config.weight_decay if start is None else start
    end = optimizer_config.weight_decay if end is None else end
    check_weight_decay_pair(start, end, scheduler_config.weight_decay_incr_style)
    return start, end


# ------------------------------------------------------------------------------------------------
# Serialisation
# ------------------------------------------------------------------------------------------------

ConfigT = TypeVar("ConfigT")


def to_dict(config: Any) -> dict[str, Any]:
    """The config's fields as plain values: torch dtypes as names ('float32'); callables
    (such as `timers`) left out, so they come back as their defaults; so are the fields left at
    megatron-core's defaults (`MegatronCoreDefault`), so that they come back as defaults, not as
    values the user set (docs/newton-schulz.md)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"to_dict takes a dataclass instance (OptimizerConfig, SchedulerConfig); got {config!r}.")
    values = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if callable(value) or _is_callable_field(type(config), field.name) or is_megatron_core_default(value):
            continue
        values[field.name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return values


def from_dict(cls: type[ConfigT], values: Mapping[str, Any]) -> ConfigT:
    """`cls(**values)` after undoing `to_dict`: dtype names to torch dtypes, numbers written as
    strings ('1e-3', which YAML 1.1 reads as a string) to floats. Unknown keys raise."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(map(repr, unknown))}.")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _from_plain(cls, name, hints[name], value) for name, value in values.items()})


def _from_plain(cls: type, name: str, hint: Any, value: Any) -> Any:
    optional_of = [t for t in typing.get_args(hint) if t is not type(None)]
    target = optional_of[0] if typing.get_origin(hint) is typing.Union and len(optional_of) == 1 else hint
    if target is torch.dtype and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{cls.__name__}.{name}: {value!r} is not a torch dtype name (e.g. 'float32').")
        return dtype
    if target is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{cls.__name__}.{name} must be a number; got {value!r}.") from None
    return value


def _is_callable_field(cls: type, name: str) -> bool:
    hint = typing.get_type_hints(cls).get(name)
    candidates = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    return any(t is Callable or typing.get_origin(t) is typing.get_origin(Callable) for t in candidates)


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ImportError(
            "to_yaml/from_yaml need the optional package PyYAML (pip install pyyaml); without "
            "it use to_dict/from_dict with your own serialiser (e.g. json)."
        ) from None
    return yaml


def to_yaml(config: Any) -> str:
    """`to_dict(config)` as YAML text (needs PyYAML)."""
    return _yaml().safe_dump(to_dict(config), sort_keys=False)


def from_yaml(cls: type[ConfigT], text: str) -> ConfigT:
    """`from_dict(cls, ...)` of YAML text written by `to_yaml` or by hand (needs PyYAML)."""
    values = _yaml().safe_load(text)
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ValueError(f"from_yaml: the YAML must be a mapping of field names; got {type(values).__name__}.")
    return from_dict(cls, values)
