"""Which OptimizerConfig fields an optimizer reads, from how it is built, so that a setting of
another optimizer (`--muon-momentum` with `--optimizer adam`) can be named as having no effect.

An optimizer's own fields are those under a registered optimizer's name or config prefix
(`adam_`, `sgd_`, `muon_`, `lion_`, `soap_`, `adaptive_muon_`, ...). What one optimizer reads:
- adam, sgd and other built-in style entries: the fields their `build` reads, recorded on a
  one-element parameter;
- an emerging optimizer: the fields its constructor arguments come from (`optimizer_kwargs`), those
  its `config_to_kwargs` reads, and every field under a prefix megatron_eopt's own code reads
  (`muon_`: routing, TP modes, q/k/v splits); unless it steps every parameter, also
  `muon_scalar_optimizer` and what that scalar optimizer reads.
"""

import dataclasses
from typing import Any, Iterable

import torch

from megatron_eopt.config.optimizer_names import run_optimizer
from megatron_eopt.registry.entries import BuildContext
from megatron_eopt.registry.kwargs import PREFIXES_READ_BY_MEGATRON_EOPT, _RecordingReads, _read_by, optimizer_kwargs
from megatron_eopt.registry.table import get_optimizer_entry, list_optimizers, lookup_optimizer


def optimizer_field_prefixes() -> tuple[str, ...]:
    """`<name>_` for every registered optimizer name and config prefix: the fields one optimizer sets."""
    names = set(list_optimizers())
    for name in list(names):
        names |= set(getattr(get_optimizer_entry(name), "config_prefixes", ()))
    return tuple(sorted(f"{name}_" for name in names))


def fields_read(name: str, config: Any) -> set[str]:
    """The fields of `config` that building optimizer `name` (and its scalar optimizer) reads."""
    spec = lookup_optimizer(name)
    if not spec.emerging:
        return _read_by_build(spec.entry, config)
    _, sources = optimizer_kwargs(name, spec.entry, config, BuildContext(on_cpu=False))
    read = {source.removeprefix("OptimizerConfig.") for source in sources.values()} | _read_by(spec.entry, config)
    own = tuple(f"{p}_" for p in (name, *spec.entry.config_prefixes) if p in PREFIXES_READ_BY_MEGATRON_EOPT)
    read |= {field.name for field in dataclasses.fields(config) if own and field.name.startswith(own)}
    if spec.routing != "all":
        read |= {"muon_scalar_optimizer"} | fields_read(config.muon_scalar_optimizer, config)
    return read


def _read_by_build(entry: Any, config: Any) -> set[str]:
    """What `entry.build` reads; every field when it cannot build so (nothing is then named). An lr
    not set yet (megatron-core's scheduler sets it) is set: torch's optimizers refuse None."""
    recording = _RecordingReads(config if config.lr is not None else dataclasses.replace(config, lr=1e-3))
    try:
        entry.build([{"params": [torch.nn.Parameter(torch.zeros(1))]}], recording)
    except Exception:  # a third-party build we cannot run this way: claim nothing about it
        return {field.name for field in dataclasses.fields(config)}
    return recording.names


def fields_without_effect(config: Any, given: Iterable[str]) -> list[str]:
    """Of the `given` fields, in config order, those that set an optimizer and that
    `config.optimizer` does not read: another optimizer's settings."""
    given, prefixes = set(given), optimizer_field_prefixes()
    read = fields_read(run_optimizer(config), config)
    return [field.name for field in dataclasses.fields(config)
            if field.name in given and field.name.startswith(prefixes) and field.name not in read]
