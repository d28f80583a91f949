"""The table of optimizers that `OptimizerConfig.optimizer` may name, and its public functions.

Importing this module has no side effects; the table fills at its first use from three sources:
1. built in: 'adam' and 'sgd' (registry/builtin.py);
2. every optimizer in `emerging_optimizers.registry`: its optimizer subpackages are imported
   explicitly (their `@register_optimizer` decorators fill that registry). If one fails to
   import, asking for any optimizer but adam/sgd raises an ImportError naming the failure, so a
   renamed module can never silently disable them;
3. Python entry points of group `megatron_eopt.optimizers` (third-party packages): each loads to
   an `EmergingOptimizerEntry` (registered under the entry point's name), a torch optimizer
   class (registered with default settings) or a callable that registers by itself.
"""

import importlib
import importlib.metadata
import warnings

import torch

from megatron_eopt.ops.newton_schulz import coefficient_types
from megatron_eopt.config.optimizer_names import COEFFICIENT_TYPES, EMERGING_OPTIMIZERS, ENTRY_POINT_GROUP, mismatch
from megatron_eopt.registry.builtin import CURATED, build_adam, build_sgd, emerging_entry
from megatron_eopt.registry.entries import NAME_PATTERN, EmergingOptimizerEntry, Entry, OptimizerEntry
from megatron_eopt.registry.spec import OptimizerSpec
from megatron_eopt.registry.support import SUPPORT_COLUMNS

# Modules whose import registers emerging_optimizers' optimizers (or that we read values from).
EMERGING_MODULES = (
    "emerging_optimizers.registry",
    "emerging_optimizers.utils",
    "emerging_optimizers.orthogonalized_optimizers",
    "emerging_optimizers.orthogonalized_optimizers.muon_utils",
    "emerging_optimizers.scalar_optimizers",
    "emerging_optimizers.soap",
    "emerging_optimizers.psgd",
    "emerging_optimizers.riemannian_optimizers",
)


# What get_megatron_optimizer also accepts (factory.py rewrites it), named wherever names are listed.
DEPRECATED_SPELLINGS = ("Deprecated spelling: 'dist_muon' (and 'dist_<name>'), which is <name> with the layer-wise "
                        "distributed optimizer.")


class OptimizerTable:
    """Registered optimizers by name; fills itself from emerging_optimizers and entry points."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.emerging_import_errors: list[str] = []
        self.unavailable: dict[str, str] = {}  # name -> why it could not be registered
        self._state = "empty"  # -> "loading" -> "loaded"
        self._add("adam", OptimizerEntry("adam", build_adam, "torch AdamW (Adam if not decoupled)"))
        self._add("sgd", OptimizerEntry("sgd", build_sgd, "torch SGD with momentum"))

    def register(self, name: str, entry: Entry) -> None:
        self.ensure_loaded()  # a duplicate of a name loaded later would go unnoticed
        self._add(name, entry)

    def names(self) -> list[str]:
        self.ensure_loaded()
        return sorted(self.entries)

    def lookup(self, name: str) -> OptimizerSpec:
        self.ensure_loaded()
        if self.emerging_import_errors and not isinstance(self.entries.get(name), OptimizerEntry):
            raise ImportError(
                f"optimizer {name!r} is unavailable: emerging_optimizers did not import completely "
                f"({'; '.join(self.emerging_import_errors)}). Install a compatible "
                f"emerging-optimizers (this library is tested with 0.3); only 'adam' and 'sgd' work "
                f"without it."
            )
        if name in self.unavailable:
            raise ImportError(f"optimizer {name!r} is unavailable: {self.unavailable[name]}")
        if name not in self.entries:
            failed = ""
            if self.unavailable:
                failed = f" (could not be registered: {', '.join(sorted(self.unavailable))})"
            raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(self.names())}.{failed} "
                             f"{DEPRECATED_SPELLINGS}")
        return OptimizerSpec(name, self.entries[name])

    def ensure_loaded(self) -> None:
        if self._state != "empty":
            return
        self._state = "loading"
        try:
            self._load_emerging()
            self._load_entry_points()
        finally:
            self._state = "loaded"

    def _add(self, name: str, entry: Entry) -> None:
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ValueError(
                f"optimizer names are lower-case identifiers (letters, digits, '_'; starting with a "
                f"letter); got {name!r}."
            )
        if not isinstance(entry, (OptimizerEntry, EmergingOptimizerEntry)):
            raise TypeError(
                f"optimizer {name!r}: expected an OptimizerEntry or EmergingOptimizerEntry; got "
                f"{type(entry).__name__}."
            )
        if isinstance(entry, OptimizerEntry) and entry.name != name:
            raise ValueError(f"OptimizerEntry named {entry.name!r} registered as {name!r}.")
        if name in self.entries:
            raise ValueError(f"an optimizer named {name!r} is already registered; names are unique.")
        self.entries[name] = entry

    def _load_emerging(self) -> None:
        for module in EMERGING_MODULES:
            try:
                importlib.import_module(module)
            except Exception as error:  # any failure must surface, not just ImportError
                self.emerging_import_errors.append(f"import {module} failed: {type(error).__name__}: {error}")
        if self.emerging_import_errors:
            return
        from emerging_optimizers import registry as eo_registry

        names = eo_registry.get_optimizer_name_list()
        _check_listed_names(names)
        for name in names:
            try:
                entry = emerging_entry(name, eo_registry.get_optimizer_cls(name))
            except Exception as error:
                self.unavailable[name] = f"making its entry failed: {type(error).__name__}: {error}"
                continue
            self._add(name, entry)
        for name in sorted(set(CURATED) - set(names)):
            self.unavailable[name] = (
                f"the installed emerging_optimizers ({_emerging_version()}) has no optimizer named "
                f"{name!r} (it has {', '.join(sorted(names))})."
            )

    def _load_entry_points(self) -> None:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = entry_point.load()
                if isinstance(loaded, (OptimizerEntry, EmergingOptimizerEntry)):
                    self._add(entry_point.name, loaded)
                elif isinstance(loaded, type) and issubclass(loaded, torch.optim.Optimizer):
                    self._add(entry_point.name, EmergingOptimizerEntry(loaded))
                elif callable(loaded):
                    loaded()
                else:
                    raise TypeError(
                        f"it loaded {type(loaded).__name__}, not an EmergingOptimizerEntry, an "
                        f"optimizer class or a callable that registers optimizers"
                    )
            except Exception as error:
                why = (
                    f"entry point {entry_point.name!r} ({entry_point.value}) of group "
                    f"{ENTRY_POINT_GROUP!r} failed: {type(error).__name__}: {error}"
                )
                self.unavailable.setdefault(entry_point.name, why)
                warnings.warn(why, RuntimeWarning, stacklevel=2)


def _check_listed_names(names: list[str]) -> None:
    """Warn when the torch-free lists that flags are checked against before the import
    (optimizer_names.py) differ from the installed emerging_optimizers."""
    for listed, installed, what in ((EMERGING_OPTIMIZERS, names, "optimizer names"),
                                    (COEFFICIENT_TYPES, coefficient_types(), "Newton-Schulz coefficient sets")):
        difference = mismatch(listed, installed, what)
        if difference:
            warnings.warn(difference + ".", RuntimeWarning, stacklevel=3)


def _emerging_version() -> str:
    try:
        return f"version {importlib.metadata.version('emerging-optimizers')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


# Public functions, on the process's table (`_TABLE`, at the end of this file).


def register_optimizer(entry: OptimizerEntry) -> None:
    """Add a built-in style `entry` under `entry.name`; an existing name is an error."""
    if not isinstance(entry, OptimizerEntry):
        raise TypeError(f"register_optimizer takes an OptimizerEntry; got {type(entry).__name__}.")
    _TABLE.register(entry.name, entry)


def register_emerging_optimizer(name: str, entry: EmergingOptimizerEntry) -> None:
    """Add `entry` under `name`; an existing or malformed name is an error."""
    if not isinstance(entry, EmergingOptimizerEntry):
        raise TypeError(
            f"register_emerging_optimizer takes an EmergingOptimizerEntry; got {type(entry).__name__}."
        )
    _TABLE.register(name, entry)


def list_optimizers() -> list[str]:
    """Every name `OptimizerConfig.optimizer` accepts, sorted."""
    return _TABLE.names()


def lookup_optimizer(name: str) -> OptimizerSpec:
    """The optimizer named `name`; unknown names list the valid ones."""
    return _TABLE.lookup(name)


def get_optimizer_entry(name: str) -> Entry:
    return _TABLE.lookup(name).entry


def support_table_markdown() -> str:
    """The README's support table: one row per registered optimizer, 'yes'/'no' per column."""
    header = "| optimizer | " + " | ".join(title for _, title in SUPPORT_COLUMNS) + " |"
    rows = [header, "|---" * (len(SUPPORT_COLUMNS) + 1) + "|"]
    for name in list_optimizers():
        support = lookup_optimizer(name).support
        cells = ["yes" if getattr(support, field) else "no" for field, _ in SUPPORT_COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def optimizers_supporting(feature: str) -> list[str]:
    """Registered optimizers whose `Support.<feature>` is True (for error messages)."""
    return [name for name in list_optimizers() if getattr(lookup_optimizer(name).support, feature)]


_TABLE = OptimizerTable()  # the process's table; filled at its first use
