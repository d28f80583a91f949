"""The optimizer names and Newton-Schulz coefficient sets that exist, known without importing torch.

Command-line parsers check `--optimizer` and `--muon-coefficient-type` against these before the
heavy imports, so a misspelt name fails at once. The registry (registry/table.py) checks the
installed emerging_optimizers against `EMERGING_OPTIMIZERS` when it loads, and
tests/unit/library/config/test_optimizer_names.py checks both lists against the installed package. They
describe one release series of emerging-optimizers: with another installed, `optimizer_names` and
`coefficient_types` return None, and only the installed package (after the import) can say.
"""

import importlib.metadata
from typing import Optional

EMERGING_OPTIMIZERS_SERIES = "0.3"  # the emerging-optimizers releases the lists below are of
BUILTIN_OPTIMIZERS = ("adam", "sgd")
EMERGING_OPTIMIZERS = (  # emerging_optimizers.registry's names
    "adaptive_muon", "laprop", "lion", "mop", "muon", "muon_hyperball", "oblique_adam", "oblique_sgd",
    "polargrad", "psgd_pro", "rekls", "scion", "sinkhorn_muon", "soap", "spel",
)
COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")  # NSCoeffT, less 'custom'
DEPRECATED_OPTIMIZER_NAMES = ("dist_muon",)  # accepted by --optimizer, rewritten by validate_args
ENTRY_POINT_GROUP = "megatron_eopt.optimizers"  # third-party optimizers, registered under their names
# Why an emerging optimizer takes no fp16 (registry/support.py), said before the import too.
FP16_NEEDS_LOSS_SCALING = "it has no loss scaling, which fp16 needs (bf16 works)"


def run_optimizer(config) -> str:
    """The optimizer `config` names, its deprecated `dist_` spelling read as the plain name."""
    return config.optimizer.removeprefix("dist_")


def series_installed() -> bool:
    """Whether the installed emerging-optimizers is of the series the lists describe."""
    try:
        version = importlib.metadata.version("emerging-optimizers")
    except importlib.metadata.PackageNotFoundError:
        return False
    return version == EMERGING_OPTIMIZERS_SERIES or version.startswith(EMERGING_OPTIMIZERS_SERIES + ".")


def optimizer_names() -> Optional[tuple[str, ...]]:
    """Every name the registry will hold, sorted (entry points included, read without loading
    them), or None when only the installed emerging_optimizers can say."""
    if not series_installed():
        return None
    plugins = [entry_point.name for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    return tuple(sorted({*BUILTIN_OPTIMIZERS, *EMERGING_OPTIMIZERS, *plugins}))


def coefficient_types() -> Optional[tuple[str, ...]]:
    """The installed emerging_optimizers' Newton-Schulz coefficient sets, or None when unknown."""
    return COEFFICIENT_TYPES if series_installed() else None


def mismatch(listed: tuple[str, ...], installed: list[str] | tuple[str, ...], what: str) -> Optional[str]:
    """What differs between a list here and the installed package's (None: they agree, or the
    installed package is of another series, which the lists do not describe)."""
    if not series_installed() or set(listed) == set(installed):
        return None
    missing, extra = sorted(set(installed) - set(listed)), sorted(set(listed) - set(installed))
    return (f"megatron_eopt/config/optimizer_names.py's {what} differ from the installed emerging_optimizers "
            f"{importlib.metadata.version('emerging-optimizers')}: not listed {missing}, listed but absent {extra}; "
            f"flag checks before the import may refuse or accept the wrong names")
