"""Test tiers, marked from what each test starts, read from its code (nobody writes them by hand).

- `multirank`: it uses the harness's worker processes (the `run_distributed` fixture, or
  tests/distributed_harness.py directly), itself or through a fixture or helper it calls.
- `subprocess`: it starts a process of its own (`subprocess.run`, `Popen`, ...): a trainer under
  torchrun, an entry script, a fresh interpreter.
- neither: in-process, the tier of `make test-fast`, the loop while you work.

What a test starts is found in the source of the test function, of the fixtures it uses and of
every function defined under tests/ that these reach by name (a call, or a function handed to
`run_distributed`), read with `ast`. `--require-library-imported` (set by `make test-fast`) fails
the run when a module of the library was never imported by it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import subprocess
import sys
import textwrap
from types import FunctionType, ModuleType
from typing import Any, Optional

import pytest

from tests import distributed_harness

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
MARKERS = {
    "multirank": "runs on the harness's worker ranks (tests/distributed_harness.py); marked automatically",
    "subprocess": "starts a process of its own (a trainer, a script, an interpreter); marked automatically",
}
STARTS_A_PROCESS = {subprocess.run, subprocess.Popen, subprocess.call, subprocess.check_call,
                    subprocess.check_output}
USES_THE_WORKERS = {distributed_harness.run_distributed, distributed_harness.prestart_distributed}
# The library: megatron_eopt/ without the trainer (its tiers are not the library's loop).
LIBRARY_EXCLUDED = ("megatron_eopt.training",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-library-imported", action="store_true",
                     help="fail unless the tests that ran imported every module of megatron_eopt's library")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for marker in tier_markers(item):
            item.add_marker(marker)


def tier_markers(item: pytest.Item) -> set[str]:
    if "run_distributed" in getattr(item, "fixturenames", ()):
        return {"multirank"} | _started(item)
    return _started(item)


def _started(item: pytest.Item) -> set[str]:
    functions = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for definition in (fixture_info.name2fixturedefs.get(name, ()) if fixture_info else ()):
            functions.append(definition.func)
    found: set[str] = set()
    for function in functions:
        if isinstance(function, FunctionType):
            found |= starts(function)
    return found


@functools.cache
def starts(function: FunctionType) -> frozenset[str]:
    """The tiers that `function` and the test helpers it reaches by name put a test in."""
    found: set[str] = set()
    seen: set[FunctionType] = set()
    todo = [function]
    while todo:
        current = todo.pop()
        if current in seen or not _under_tests(current):
            continue
        seen.add(current)
        for value in _referenced(current):
            if value in STARTS_A_PROCESS:
                found.add("subprocess")
            elif value in USES_THE_WORKERS:
                found.add("multirank")
            elif isinstance(value, FunctionType):
                todo.append(value)
    return frozenset(found)


def _under_tests(function: FunctionType) -> bool:
    source = inspect.getsourcefile(function)
    return source is not None and pathlib.Path(source).resolve().is_relative_to(TESTS)


def _referenced(function: FunctionType) -> list[Any]:
    """The module-level objects the function's source names: `name` and `module.attribute`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return []
    namespace = function.__globals__
    values = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in namespace:
            values.append(namespace[node.id])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = namespace.get(node.value.id)
            if isinstance(owner, ModuleType):
                values.append(getattr(owner, node.attr, None))
    return [v for v in values if _hashable(v)]


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def library_modules() -> set[str]:
    package = ROOT / "megatron_eopt"
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in package.rglob("*.py")}
    return {n for n in names if not n.startswith(LIBRARY_EXCLUDED)}


def never_imported() -> list[str]:
    return sorted(library_modules() - set(sys.modules))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("--require-library-imported") or exitstatus != 0:
        return
    missing = never_imported()
    if missing:
        reporter: Optional[Any] = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\nthe tests that ran never imported these library modules: {missing}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
