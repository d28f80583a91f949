"""Per-parameter overrides: which parameters a rule matches (`ParamKey`) and what it changes.

A parameter matches a `ParamKey` if any of its name globs (fnmatch on the full parameter
name), attribute names (truthy on the parameter), predicates `fn(param)` or name-aware
predicates `fn(param, name)` matches. Several matching keys merge their overrides; two that
disagree on a value are an error, never a silent pick.
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypedDict, Union

import torch


@dataclass(frozen=True)
class ParamPredicate:
    """A named `fn(param) -> bool`; hashes and compares by `name` so keys stay hashable."""

    name: str
    fn: Callable[[torch.nn.Parameter], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return bool(self.fn(param))


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """A named `fn(param, name) -> bool`; hashes and compares by `name`."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return bool(self.fn(param, name))


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@dataclass(frozen=True, slots=True)
class ParamKey:
    """Selects parameters; each field is one value or a tuple of values, any of which may match."""

    name: Union[str, tuple[str, ...]] = field(default_factory=tuple)
    attr: Union[str, tuple[str, ...]] = field(default_factory=tuple)
    predicate: Union[ParamPredicate, tuple[ParamPredicate, ...]] = field(default_factory=tuple)
    with_name_predicate: Union[ParamWithNamePredicate, tuple[ParamWithNamePredicate, ...]] = (
        field(default_factory=tuple)
    )

    def __post_init__(self) -> None:
        kinds = (
            ("name", str, "a glob string"),
            ("attr", str, "an attribute name"),
            ("predicate", ParamPredicate, "a ParamPredicate"),
            ("with_name_predicate", ParamWithNamePredicate, "a ParamWithNamePredicate"),
        )
        for field_name, kind, description in kinds:
            for value in _as_tuple(getattr(self, field_name)):
                if not isinstance(value, kind):
                    raise TypeError(
                        f"ParamKey.{field_name} must be {description} or a tuple of them; got "
                        f"{type(value).__name__} {value!r}."
                    )

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        """True if any glob, attribute, predicate or name-aware predicate matches."""
        return (
            any(fnmatch.fnmatch(param_name, glob) for glob in _as_tuple(self.name))
            or any(getattr(param, attr, False) for attr in _as_tuple(self.attr))
            or any(predicate(param) for predicate in _as_tuple(self.predicate))
            or any(predicate(param, param_name) for predicate in _as_tuple(self.with_name_predicate))
        )

    def describe(self) -> str:
        """A deterministic text naming this key (predicates by their `name`, never by `fn`)."""
        parts = [
            *(f"name={glob}" for glob in _as_tuple(self.name)),
            *(f"attr={attr}" for attr in _as_tuple(self.attr)),
            *(f"predicate={p.name}" for p in _as_tuple(self.predicate)),
            *(f"with_name_predicate={p.name}" for p in _as_tuple(self.with_name_predicate)),
        ]
        return ",".join(parts) if parts else "<matches nothing>"


class ParamGroupOverride(TypedDict, total=False):
    """What an override may change for the parameters it matches.

    The scheduler reads `max_lr`, `min_lr`, `start_wd`, `end_wd` and `wd_mult` from each
    group; any other key (for example `eps`) passes into the torch param group unchanged.
    """

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float


# Keys that describe a parameter group itself; an override must not replace them.
PROTECTED_GROUP_KEYS = frozenset({"params", "optimizer", "is_expert_parallel", "group_key"})


def check_config_overrides(config_overrides: Mapping[Any, Mapping[str, Any]]) -> None:
    """Reject overrides that cannot work, before any parameter is looked at."""
    if not isinstance(config_overrides, Mapping):
        raise TypeError(
            f"config_overrides must be a dict of ParamKey -> ParamGroupOverride (or None for "
            f"the standard overrides); got {type(config_overrides).__name__}."
        )
    for key, override in config_overrides.items():
        if not callable(getattr(key, "matches", None)):
            raise TypeError(
                f"config_overrides keys must be ParamKey objects; got {type(key).__name__} {key!r}."
            )
        if not isinstance(override, Mapping):
            raise TypeError(
                f"the override for {describe_key(key)} must be a dict (ParamGroupOverride); got "
                f"{type(override).__name__}."
            )
        if "optimizer" in override:
            raise ValueError(
                f"the override for {describe_key(key)} sets 'optimizer'={override['optimizer']!r}; "
                f"overrides may not change the optimizer per parameter. Choose the optimizer "
                f"with OptimizerConfig.optimizer (Muon runs route non-matrix parameters to "
                f"muon_scalar_optimizer by themselves)."
            )
        protected = sorted(PROTECTED_GROUP_KEYS.intersection(override) - {"optimizer"})
        if protected:
            raise ValueError(
                f"the override for {describe_key(key)} sets {protected}, which describe the "
                f"parameter group itself and cannot be overridden."
            )


def describe_key(key: Any) -> str:
    """Deterministic description of a key; works for megatron-core's ParamKey too."""
    if isinstance(key, ParamKey):
        return f"ParamKey({key.describe()})"
    parts = []
    for field_name in ("name", "attr", "predicate", "with_name_predicate"):
        for value in _as_tuple(getattr(key, field_name, ())):
            parts.append(f"{field_name}={getattr(value, 'name', value)}")
    return f"ParamKey({','.join(parts)})"


def matching_keys(
    config_overrides: Mapping[Any, Mapping[str, Any]], param: torch.nn.Parameter, name: str
) -> list[Any]:
    """The keys of `config_overrides` that match this parameter, in the dict's order."""
    return [key for key in config_overrides if key.matches(param, name)]


def merge_overrides(
    keys: Iterable[Any], config_overrides: Mapping[Any, Mapping[str, Any]], param_name: str
) -> dict[str, Any]:
    """Merge the overrides of `keys`; two keys giving one field different values is an error."""
    merged: dict[str, Any] = {}
    source: dict[str, Any] = {}
    for key in keys:
        for field_name, value in config_overrides[key].items():
            if field_name in merged and merged[field_name] != value:
                raise ValueError(
                    f"parameter {param_name!r}: conflicting overrides for {field_name!r}: "
                    f"{merged[field_name]!r} from {describe_key(source[field_name])} and "
                    f"{value!r} from {describe_key(key)}. Make the keys disjoint or give them "
                    f"the same value."
                )
            merged[field_name] = value
            source[field_name] = key
    return merged


def _is_1d_or_bias(param: torch.nn.Parameter, name: str) -> bool:
    return param.dim() == 1 or name.endswith(".bias")


def _is_1d_or_bias_but_not_qk_layernorm(param: torch.nn.Parameter, name: str) -> bool:
    return _is_1d_or_bias(param, name) and not ("q_layernorm." in name or "k_layernorm." in name)


def get_standard_config_overrides(config: Any) -> dict[ParamKey, ParamGroupOverride]:
    """The overrides `config_overrides=None` means.

    No weight decay for 1-D parameters and biases (QK-layernorm weights keep it when
    `apply_wd_to_qk_layernorm`); `decoupled_lr`/`decoupled_min_lr` as the lr range of
    parameters tagged `is_embedding_or_output_parameter`, when `decoupled_lr` is set.
    """
    if config.apply_wd_to_qk_layernorm:
        no_wd_key = ParamKey(
            with_name_predicate=ParamWithNamePredicate(
                name="1d_or_bias_not_qk_layernorm", fn=_is_1d_or_bias_but_not_qk_layernorm
            )
        )
    else:
        no_wd_key = ParamKey(
            name="*.bias", predicate=ParamPredicate(name="param_len_1", fn=lambda p: p.dim() == 1)
        )
    overrides: dict[ParamKey, ParamGroupOverride] = {no_wd_key: ParamGroupOverride(wd_mult=0.0)}
    if config.decoupled_lr is not None:
        decoupled: dict[str, Any] = {"max_lr": config.decoupled_lr, "is_decoupled_lr": True}
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides
