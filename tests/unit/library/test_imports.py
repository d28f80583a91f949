"""Guardrails on imports.

`import megatron_eopt` must not import megatron-core (its model stack costs ~16 s; checked in
a fresh interpreter). The package's modules import each other without cycles, and only
downwards through the layers (read from the source with `ast`, so imports inside functions and
`if TYPE_CHECKING:` blocks count too):
once/hardware/param_names -> config/param_key -> ops -> optimizers -> registry -> param_groups ->
wrappers/distributed -> checkpointing -> factory -> muon/bridge; megatron-core appears only where
allowed. A subpackage's `__init__.py` counts as a module, so a module of the registry package
that imported the package itself (which imports it) is a cycle.
"""

import ast
import pathlib
import subprocess
import sys
from typing import Optional

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "megatron_eopt"
LAYER_OF = {  # first component below megatron_eopt -> layer; a module imports layers <= its own
    "once": 0, "hardware": 0, "param_names": 0,  # leaves: they import no megatron_eopt module
    "config": 0, "param_key": 0, "ops": 1, "optimizers": 2, "registry": 3, "param_groups": 4,
    "wrappers": 5, "distributed": 5, "checkpointing": 6, "factory": 7, "muon": 8, "bridge": 8,
    "integrations": 9, "arguments": 9, "config_choices": 0, "optimizer_names": 0, "close_match": 0,
    "config_rules": 0, "config_precision": 0, "scheduler_config": 0,
    "training": 10,  # the trainer: nothing in the library imports it
}
# checkpointing/rng.py: megatron-core's process-global RNG tracker, only once megatron-core is imported.
MEGATRON_CORE_ALLOWED = {"distributed/process_groups.py", "factory.py", "bridge.py", "wrappers/megatron_sharded.py",
                         "checkpointing/rng.py", "integrations/megatron_lm.py", "integrations/megatron_lm_gpt.py"}
MEGATRON_CORE_ALLOWED_UNDER = ("training/",)  # the trainer: megatron-core's models, Megatron-LM's helpers
# The one upward import, inside the method that needs it: OptimizerConfig.provide() is
# Megatron-Bridge's custom-optimizer hook, so the config must be able to call the factory.
# It is a function-level import of the factory alone (never of the Bridge layer), so importing
# the config never imports what lies above it.
UPWARD_ALLOWED = {("config.py", "megatron_eopt.factory", "provide")}
# Megatron-LM's training package (megatron.training, in the megatron-core wheel): only its adapter.
MEGATRON_TRAINING_ALLOWED = {"integrations/megatron_lm.py", "integrations/megatron_lm_gpt.py"}


def package_imports(path: pathlib.Path) -> list[tuple[str, Optional[str]]]:
    """(absolute module name, enclosing function or None) of every import in the file."""
    found: list[tuple[str, Optional[str]]] = []

    def visit(node: ast.AST, function: Optional[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                # `from megatron_eopt.wrappers import fp32` imports the module wrappers.fp32 (and
                # only that, as far as layers and cycles go: the package itself is not the target).
                modules = [f"{child.module}.{alias.name}" for alias in child.names
                           if _module_path(f"{child.module}.{alias.name}") is not None]
                if len(modules) < len(child.names):
                    found.append((child.module, function))
                found.extend((module, function) for module in modules)
            visit(child, function)

    visit(ast.parse(path.read_text()), None)
    return found


def _module_path(name: str) -> Optional[pathlib.Path]:
    """The file of megatron_eopt module `name` (a subpackage's `__init__.py`), or None when it is not one."""
    if not name.startswith("megatron_eopt."):
        return None
    path = PACKAGE.joinpath(*name.split(".")[1:])
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def layer(relative: pathlib.Path) -> int:
    top = relative.parts[0].removesuffix(".py")
    if top not in LAYER_OF:
        raise AssertionError(f"megatron_eopt/{relative} is in no layer; add it to LAYER_OF")
    return LAYER_OF[top]


def package_files() -> list[pathlib.Path]:
    """Every module of the package; subpackages' `__init__.py` too, not the top-level one (it re-exports all)."""
    files = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    assert len(files) > 5
    return files


def import_graph() -> dict[str, set[str]]:
    """module (path relative to the package) -> modules it imports, allowed exceptions left out."""
    graph: dict[str, set[str]] = {}
    for path in package_files():
        relative = path.relative_to(PACKAGE).as_posix()
        targets = graph.setdefault(relative, set())
        for name, function in package_imports(path):
            target = _module_path(name)
            if target is not None and (relative, name, function) not in UPWARD_ALLOWED:
                targets.add(target.relative_to(PACKAGE).as_posix())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, str] = {}  # module -> "open" (on the current path) or "done"
    path: list[str] = []

    def visit(module: str) -> Optional[list[str]]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_import_does_not_load_megatron_core() -> None:
    # The package's names are imported on first use: get_megatron_optimizer imports the factory.
    code = ("import sys, megatron_eopt, megatron_eopt.integrations; megatron_eopt.get_megatron_optimizer; "
            "print('\\n'.join(sys.modules))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = output.stdout.split()
    assert "megatron_eopt.factory" in modules
    assert not [m for m in modules if m.startswith("megatron.")], "megatron-core imported eagerly"


def test_the_library_never_imports_the_trainer() -> None:
    library = [p for p in package_files() if p.relative_to(PACKAGE).parts[0] != "training"]
    imports = [f"{p.relative_to(PACKAGE)} imports {name}" for p in library for name, _ in package_imports(p)
               if name == "megatron_eopt.training" or name.startswith("megatron_eopt.training.")]
    assert not imports, imports
    code = "import sys, megatron_eopt, megatron_eopt.integrations, megatron_eopt.arguments; print('\\n'.join(sys.modules))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not [m for m in output.stdout.split() if m.startswith("megatron_eopt.training")]


def test_importing_the_config_does_not_import_the_bridge_layer() -> None:
    # The config's provide() reaches the factory only when called.
    code = "import sys, megatron_eopt.config; print('\\n'.join(sys.modules))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "megatron_eopt.bridge" not in output.stdout.split()


def test_layers_import_only_downwards() -> None:
    violations = []
    for path in package_files():
        relative = path.relative_to(PACKAGE)
        for name, function in package_imports(path):
            if name.startswith("megatron_eopt."):
                target = pathlib.Path(*name.split(".")[1:])
                if layer(target) > layer(relative) and (relative.as_posix(), name, function) not in UPWARD_ALLOWED:
                    where = f" (in {function}())" if function else ""
                    violations.append(f"{relative} imports {name}{where}")
            elif name.startswith("megatron.") and relative.as_posix() not in MEGATRON_CORE_ALLOWED and not (
                    relative.as_posix().startswith(MEGATRON_CORE_ALLOWED_UNDER)):
                violations.append(f"{relative} imports megatron-core ({name})")
            if name.startswith("megatron.training") and relative.as_posix() not in MEGATRON_TRAINING_ALLOWED and not (
                    relative.as_posix().startswith(MEGATRON_CORE_ALLOWED_UNDER)):
                violations.append(f"{relative} imports Megatron-LM's training package ({name})")
    assert not violations, violations


def test_no_import_cycles() -> None:
    # Module by module, counting imports inside functions and TYPE_CHECKING blocks: a cycle that
    # only works because one side imports late is still two modules that need each other.
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}}) == ["a.py", "b.py", "c.py", "a.py"]
    assert find_cycle({"a.py": {"b.py"}, "b.py": set(), "c.py": {"a.py", "b.py"}}) is None
