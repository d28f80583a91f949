"""Building an emerging optimizer: constructor arguments from the config, checked first.

For each `__init__` argument `arg` (through `**kwargs` to the parent class's): `config.<prefix>_<arg>`
for the entry's prefixes (its name first, then `config_prefixes`), else `config.<arg>`, else the
Newton-Schulz fields set in the config (`muon_fp32_matmul_prec`, `muon_coefficient_type`,
`muon_num_ns_steps`; config/newton_schulz.py), else the class default; config values that are None
count as unset. Then, where the class takes them:
`weight_decay_method` is 'decoupled' or 'l2' from `decoupled_weight_decay`; the entry's
`config_to_kwargs(config)` may add or replace values; `tp_group`/`layouts` (and, for FSDP2,
`fsdp_group`/`fsdp_shards`) come from the factory. Matmul precisions are honoured on every device;
'medium' (bf16 Newton-Schulz) on a CPU without bf16 instructions warns once that it is emulated.
Names and values are checked against the signature (`Literal` annotations, the installed
emerging_optimizers' Newton-Schulz coefficient sets and matmul precisions) before building; the
state is then created eagerly (`init_state_fn`, by default `init_state_step_free`).
"""

import dataclasses
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

import torch

from megatron_eopt.config.newton_schulz import NEWTON_SCHULZ_FIELDS, fields_set
from megatron_eopt.runtime.hardware import CPU_BF16_FLAGS, native_bf16_matmul
from megatron_eopt.runtime.once import warn_once
from megatron_eopt.optimizers.compiled_step import watch_first_step
from megatron_eopt.params.names import named_params
from megatron_eopt.registry.entries import CONTEXT_ARGS, BuildContext, EmergingOptimizerEntry


@dataclass(frozen=True)
class _Argument:
    parameter: inspect.Parameter
    annotation: Any  # resolved type hint, or inspect.Parameter.empty


def constructor_parameters(optimizer_cls: type) -> dict[str, _Argument]:
    """Named `__init__` arguments of `optimizer_cls`, following `**kwargs` into parent classes."""
    found: dict[str, _Argument] = {}
    for klass in optimizer_cls.__mro__:
        if klass in (torch.optim.Optimizer, object):
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # unresolvable annotations: no value checks for this class
            hints = {}
        forwards_kwargs = False
        for parameter in list(inspect.signature(init).parameters.values())[1:]:
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                forwards_kwargs = True
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL and parameter.name != "params":
                annotation = hints.get(parameter.name, inspect.Parameter.empty)
                found.setdefault(parameter.name, _Argument(parameter, annotation))
        if not forwards_kwargs:
            break
    return found


def build_emerging(
    name: str, entry: EmergingOptimizerEntry, param_groups: list[dict], config: Any, context: BuildContext
) -> torch.optim.Optimizer:
    arguments = constructor_parameters(entry.optimizer_cls)
    kwargs, sources = optimizer_kwargs(name, entry, config, context)
    if "lr" in arguments and "lr" not in kwargs and param_groups:
        kwargs["lr"], sources["lr"] = param_groups[0]["lr"], "the first param group's lr"
    _check_kwargs(name, entry.optimizer_cls, arguments, kwargs, sources)
    check_fields_taken(name, entry, config, sources)
    _check_param_shapes(name, entry.routing, param_groups, takes_matrix_batches(entry.optimizer_cls))
    if entry.param_check is not None:
        check_params(name, entry, param_groups, config, context)
    optimizer = entry.optimizer_cls(param_groups, **kwargs)
    (entry.init_state_fn or init_state_step_free)(optimizer)
    return watch_first_step(name, optimizer, config)  # torch.compile'd updates (optimizers/compiled_step.py)


def optimizer_kwargs(
    name: str, entry: EmergingOptimizerEntry, config: Any, context: BuildContext = BuildContext()
) -> tuple[dict[str, Any], dict[str, str]]:
    """(constructor kwargs, where each came from) for `entry` under `config` (module docstring)."""
    arguments = constructor_parameters(entry.optimizer_cls)
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    prefixes = (name, *entry.config_prefixes)
    for argument in arguments:
        if argument in CONTEXT_ARGS:
            continue
        for field_name in (*(f"{prefix}_{argument}" for prefix in prefixes), argument):
            if getattr(config, field_name, None) is not None:
                kwargs[argument], sources[argument] = getattr(config, field_name), f"OptimizerConfig.{field_name}"
                break
    _add_newton_schulz_fields(name, entry.optimizer_cls, arguments, config, kwargs, sources)
    if "weight_decay_method" in arguments and "weight_decay_method" not in kwargs:
        kwargs["weight_decay_method"] = "decoupled" if config.decoupled_weight_decay else "l2"
        sources["weight_decay_method"] = "OptimizerConfig.decoupled_weight_decay"
    if entry.config_to_kwargs is not None:
        extra = dict(entry.config_to_kwargs(config))
        kwargs.update(extra)
        sources.update({key: f"config_to_kwargs of optimizer {name!r}" for key in extra})
    if context.on_cpu:
        _warn_if_bf16_is_emulated({a: kwargs[a] for a in kwargs if a.endswith("fp32_matmul_prec")}, sources)
    if "tp_group" in arguments:
        kwargs["tp_group"], sources["tp_group"] = context.tp_group, "the factory"
    if "layouts" in arguments:
        kwargs["layouts"], sources["layouts"] = dict(context.layouts or {}), "the factory"
    if context.fsdp_shards is not None:  # only classes that take them support FSDP2 (`Support`)
        kwargs["fsdp_group"], sources["fsdp_group"] = context.fsdp_group, "the factory"
        kwargs["fsdp_shards"], sources["fsdp_shards"] = dict(context.fsdp_shards), "the factory"
    return kwargs, sources


# Prefixes whose fields megatron_eopt's own code reads too (the factory's routing, Muon's TP modes and
# q/k/v splits), not only as constructor arguments of the same name: not checked by `fields_not_taken`.
PREFIXES_READ_BY_MEGATRON_EOPT = ("muon",)


def fields_not_taken(name: str, entry: EmergingOptimizerEntry, config: Any,
                     sources: Optional[Mapping[str, str]] = None) -> list[str]:
    """The config fields under the entry's own prefixes (its name, then `config_prefixes`, but not
    PREFIXES_READ_BY_MEGATRON_EOPT) set away from their defaults that reach neither a constructor
    argument nor the entry's `config_to_kwargs`: the installed optimizer would ignore them (e.g.
    `soap_precondition_frequency`, which emerging_optimizers 0.3.0's SOAP no longer takes).
    `sources`: optimizer_kwargs' second value, when already at hand."""
    prefixes = [p + "_" for p in (name, *entry.config_prefixes) if p not in PREFIXES_READ_BY_MEGATRON_EOPT]
    if not prefixes or not dataclasses.is_dataclass(config):
        return []
    if sources is None:
        sources = optimizer_kwargs(name, entry, config, BuildContext(on_cpu=False))[1]
    taken = {source.removeprefix("OptimizerConfig.") for source in sources.values()} | _read_by(entry, config)
    return [field.name for field in dataclasses.fields(config)
            if field.name.startswith(tuple(prefixes)) and field.name not in taken
            and getattr(config, field.name) != field.default]


def check_fields_taken(name: str, entry: EmergingOptimizerEntry, config: Any,
                       sources: Optional[Mapping[str, str]] = None) -> None:
    """ValueError naming the first field of `fields_not_taken`, with its default to go back to."""
    ignored = fields_not_taken(name, entry, config, sources)
    if ignored:
        field = next(f for f in dataclasses.fields(config) if f.name == ignored[0])
        cls = entry.optimizer_cls
        raise ValueError(
            f"OptimizerConfig.{field.name}={getattr(config, field.name)!r} has no effect with optimizer {name!r}: "
            f"the installed {cls.__module__.split('.')[0]} {_version(cls)} {cls.__name__} takes no such setting; "
            f"leave {field.name} at its default ({field.default!r})."
        )


class _RecordingReads:
    """`config` with every attribute read recorded (what a `config_to_kwargs` reads)."""

    def __init__(self, config: Any) -> None:
        self._config, self.names = config, set()

    def __getattr__(self, name: str) -> Any:
        self.names.add(name)
        return getattr(self._config, name)


def _read_by(entry: EmergingOptimizerEntry, config: Any) -> set[str]:
    if entry.config_to_kwargs is None:
        return set()
    recording = _RecordingReads(config)
    entry.config_to_kwargs(recording)
    return recording.names


def _version(optimizer_cls: type) -> str:
    from importlib import metadata

    package = optimizer_cls.__module__.split(".")[0]
    try:
        return metadata.version(package.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _add_newton_schulz_fields(name: str, optimizer_cls: type, arguments: Mapping[str, Any], config: Any,
                              kwargs: dict[str, Any], sources: dict[str, str]) -> None:
    """The Newton-Schulz fields set in the config reach every optimizer that takes them
    (config/newton_schulz.py); an orthogonalized optimizer that does not take one refuses it."""
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer

    for field_name, value in fields_set(config).items():
        argument = NEWTON_SCHULZ_FIELDS[field_name]
        if argument in arguments:
            kwargs.setdefault(argument, value)
            sources.setdefault(argument, f"OptimizerConfig.{field_name}")
        elif issubclass(optimizer_cls, OrthogonalizedOptimizer):
            raise ValueError(
                f"OptimizerConfig.{field_name}={value!r} does not apply to optimizer {name!r}: it takes no "
                f"{argument} (it does not orthogonalize by Newton-Schulz steps of its own). Leave "
                f"{field_name} unset for it."
            )


def _warn_if_bf16_is_emulated(precisions: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """'medium' means bf16 matrix products: honoured, but slow on a CPU that emulates them."""
    medium = [argument for argument, value in precisions.items() if value == "medium"]
    if not medium or native_bf16_matmul(torch.device("cpu")):
        return
    warn_once(
        "emulated_bf16",
        f"{sources[medium[0]]}='medium' runs matrix products in bf16, which this CPU emulates "
        f"(no {'/'.join(CPU_BF16_FLAGS)} instructions): expect it far slower than fp32. Set it to "
        f"'highest' for fp32 on this machine.",
        stacklevel=4,
    )


def _allowed_values(argument: str, annotation: Any) -> Optional[tuple]:
    """The values an argument may take, when its annotation or name says so; None: any."""
    if argument == "coefficient_type":
        from megatron_eopt.ops.newton_schulz import coefficient_types

        return coefficient_types()
    if argument.endswith("fp32_matmul_prec"):
        from emerging_optimizers.utils import FP32MatmulPrecT

        return typing.get_args(FP32MatmulPrecT)
    return _literal_values(annotation)


def _literal_values(annotation: Any) -> Optional[tuple]:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [_literal_values(arg) if arg is not type(None) else (None,) for arg in typing.get_args(annotation)]
        if all(m is not None for m in members):
            return tuple(value for m in members for value in m)
    return None


def _check_kwargs(
    name: str,
    optimizer_cls: type,
    arguments: Mapping[str, _Argument],
    kwargs: Mapping[str, Any],
    sources: Mapping[str, str],
) -> None:
    unknown = sorted(set(kwargs) - set(arguments))
    if unknown:
        raise TypeError(
            f"optimizer {name!r}: {optimizer_cls.__name__} takes no argument(s) {unknown} (from "
            f"{sources[unknown[0]]}); it takes {sorted(arguments)}."
        )
    for argument, value in kwargs.items():
        allowed = _allowed_values(argument, arguments[argument].annotation)
        if allowed is not None and value not in allowed:
            raise ValueError(
                f"optimizer {name!r}: {sources[argument]} must be one of "
                f"{', '.join(map(repr, allowed))} for {optimizer_cls.__name__}.{argument} (from the "
                f"installed {optimizer_cls.__module__.split('.')[0]}); got {value!r}."
            )
    missing = [
        argument for argument, spec in arguments.items()
        if spec.parameter.default is inspect.Parameter.empty and argument not in kwargs
    ]
    if missing:
        raise ValueError(
            f"optimizer {name!r}: {optimizer_cls.__name__} needs {missing}, which the config does not "
            f"give; set OptimizerConfig fields named '{name}_<argument>' or '<argument>' (or give the "
            f"entry a config_to_kwargs)."
        )


def check_params(
    name: str, entry: EmergingOptimizerEntry, param_groups: list[dict], config: Any,
    context: BuildContext = BuildContext(),
) -> None:
    """Run `entry.param_check` on every parameter; the first failure raises, naming it by fqn."""
    if entry.param_check is None:
        return
    defaults = {
        argument: spec.parameter.default
        for argument, spec in constructor_parameters(entry.optimizer_cls).items()
        if spec.parameter.default is not inspect.Parameter.empty
    }
    kwargs = {**defaults, **optimizer_kwargs(name, entry, config, context)[0]}
    for param, fqn in named_params(param_groups):
        problem = entry.param_check(param, kwargs)
        if problem:
            raise ValueError(
                f"optimizer {name!r} cannot step parameter {fqn!r} (shape {tuple(param.shape)}): {problem}"
            )


def takes_matrix_batches(optimizer_cls: type) -> bool:
    """Whether the class orthogonalizes an N-D tensor as a batch of matrices (MoE experts stored
    as one tensor) given its layout: it says so with `orthogonalizes_matrix_batches = True`."""
    return bool(getattr(optimizer_cls, "orthogonalizes_matrix_batches", False))


def _check_param_shapes(name: str, routing: str, param_groups: list[dict], batches: bool = False) -> None:
    if routing == "all":
        return
    for param, fqn in named_params(param_groups):
        if param.dim() != 2 and not (batches and param.dim() > 2):  # the class checks a batch's layout
            raise ValueError(
                f"parameter {fqn!r} has shape {tuple(param.shape)}, but optimizer {name!r} steps "
                f"2-D matrices only; route it to the scalar optimizer (muon_scalar_optimizer)."
            )


def init_state_step_free(optimizer: torch.optim.Optimizer) -> None:
    """The default `init_state_fn`: the class's `_init_group(group, skip_non_grad_params=False)`.

    Classes without such a method keep torch's lazy state (created at the first step).
    """
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None or "skip_non_grad_params" not in inspect.signature(init_group).parameters:
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            init_group(group, skip_non_grad_params=False)
