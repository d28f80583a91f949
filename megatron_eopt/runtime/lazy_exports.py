"""Re-exports imported on first use (PEP 562), for packages whose `__init__.py` only re-exports.

`__getattr__, __dir__ = lazy_exports(__name__, {"Name": "megatron_eopt.module", ...})`: importing
the package imports none of those modules, so importing one of its submodules (or the package
itself) costs nothing and closes no import cycle.
"""

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, origins: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, which re-exports each name from its module in `origins`."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in origins:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(origins[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(origins))

    return __getattr__, __dir__
