"""Guardrails on imports.

`import megatron_eopt` must not import megatron-core (its model stack costs ~16 s; checked in
a fresh interpreter). The package's modules import each other without cycles (read from the
source with `ast`, so imports inside functions and `if TYPE_CHECKING:` blocks count too), and
megatron-core appears only where allowed; tests/unit/test_code_shape.py holds the layers. The
top-level arguments/ (the optimizer's flags) and the trainer's training/arguments/ import without
torch, and the library never imports arguments/. A subpackage's `__init__.py` counts as a module, so a module of the
registry package that imported the package itself (which imports it) is a cycle.
"""

import json
import pathlib
import subprocess
import sys
from typing import Optional

import pytest

from tests.unit.test_code_shape import UPWARD_ALLOWED, _module_path, package_imports

ROOT = pathlib.Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "megatron_eopt"
ARGUMENTS = ROOT / "arguments"  # the optimizer's command-line flags (Megatron-LM's parser and ours)
TRAINER_FLAGS = PACKAGE / "training" / "arguments"  # the trainer's flags, checks and settings
# checkpointing/rng.py: megatron-core's process-global RNG tracker, only once megatron-core is imported.
MEGATRON_CORE_ALLOWED = {"runtime/process_groups.py", "factory.py", "integrations/megatron_bridge.py",
                         "megatron_core_formats/dist_checkpointing.py", "megatron_core_formats/layer_wise_optimizer.py",
                         "megatron_core_formats/distributed_optimizer.py", "megatron_core_formats/moved_state.py",
                         "checkpointing/rng.py", "integrations/megatron_lm.py", "integrations/megatron_lm_gpt.py",
                         "integrations/megatron_lm_qk_clip.py",
                         "runtime/megatron_lm_cpu.py", "runtime/megatron_core_torch_adam.py",
                         "runtime/megatron_lm_saves.py"}
MEGATRON_CORE_ALLOWED_UNDER = ("training/",)  # the trainer: megatron-core's models, Megatron-LM's helpers
# Megatron-LM's training package (megatron.training, in the megatron-core wheel): only its adapter, and
# the run-time patches that let its loop run on CPU and its saves survive a dead writer (their imports inside
# install(), which the script calls).
MEGATRON_TRAINING_ALLOWED = {"integrations/megatron_lm.py", "integrations/megatron_lm_gpt.py",
                             "runtime/megatron_lm_cpu.py", "runtime/megatron_lm_saves.py"}


def package_files() -> list[pathlib.Path]:
    """Every module of the package; subpackages' `__init__.py` too, not the top-level one (it re-exports all)."""
    files = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    assert len(files) > 5
    return files


def arguments_files() -> list[pathlib.Path]:
    files = list(ARGUMENTS.rglob("*.py"))
    assert len(files) >= 5
    return files


def flag_files() -> list[pathlib.Path]:
    """Every module that declares or checks a command-line flag: arguments/ and the trainer's training/arguments/."""
    files = arguments_files() + list(TRAINER_FLAGS.rglob("*.py"))
    assert len(files) > 20
    return files


def import_graph() -> dict[str, set[str]]:
    """module (path relative to the repository) -> modules it imports, allowed exceptions left out."""
    graph: dict[str, set[str]] = {}
    for path in package_files() + arguments_files():
        targets = graph.setdefault(path.relative_to(ROOT).as_posix(), set())
        in_package = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None
        for name, function in package_imports(path):
            target = _module_path(name)
            if target is not None and (in_package, name, function) not in UPWARD_ALLOWED:
                targets.add(target.relative_to(ROOT).as_posix())
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


# One fresh interpreter imports these in turn, each on top of the ones before, and reports what is
# loaded after each: a check on a stage holds for its imports and everything before it, so one launch
# (seconds of torch's import) stands for one per stage.
IMPORT_STAGES = {
    "config": "import megatron_eopt.config.optimizer_config",
    "checkpointing": "import megatron_eopt.factory, megatron_eopt.checkpointing.checkpoint",  # no integrations
    "library": "import megatron_eopt, megatron_eopt.integrations; megatron_eopt.get_megatron_optimizer",
    "flags": "import arguments",
}


@pytest.fixture(scope="module")
def loaded_after() -> dict[str, list[str]]:
    """stage -> the modules loaded once it and the stages before it were imported."""
    code = "import json, sys\nloaded = {}\n" + "".join(
        f"{statement}\nloaded[{stage!r}] = list(sys.modules)\n" for stage, statement in IMPORT_STAGES.items()
    ) + "print(json.dumps(loaded))"
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     cwd=ROOT).stdout.splitlines()[-1])


def test_import_does_not_load_megatron_core(loaded_after) -> None:
    # The package's names are imported on first use: get_megatron_optimizer imports the factory.
    modules = loaded_after["library"]
    assert "megatron_eopt.factory" in modules
    assert not [m for m in modules if m.startswith("megatron.")], "megatron-core imported eagerly"


def test_the_library_never_imports_the_trainer(loaded_after) -> None:
    library = [p for p in package_files() if p.relative_to(PACKAGE).parts[0] != "training"]
    imports = [f"{p.relative_to(PACKAGE)} imports {name}" for p in library for name, _ in package_imports(p)
               if name == "megatron_eopt.training" or name.startswith("megatron_eopt.training.")]
    assert not imports, imports
    assert not [m for m in loaded_after["flags"] if m.startswith("megatron_eopt.training")]


def test_the_library_never_imports_the_flags(loaded_after) -> None:
    # The library is megatron_eopt/ without its two users of the flags: the trainer and the integrations.
    library = [p for p in package_files() if p.relative_to(PACKAGE).parts[0] not in ("training", "integrations")]
    imports = [f"{p.relative_to(PACKAGE)} imports {name}" for p in library for name, _ in package_imports(p)
               if name.split(".")[0] == "arguments"]
    assert not imports, imports
    assert not [m for m in loaded_after["checkpointing"] if m.split(".")[0] == "arguments"]


# config/'s modules that the flag parsers run before torch is imported (docs/layers.md: torch in optimizer_config.py only).
TORCH_FREE_CONFIG = ("rules", "precision", "choices", "optimizer_names", "scheduler")


def test_config_imports_torch_in_optimizer_config_only() -> None:
    # At module level: the parsers check OptimizerConfig's rules on the flags before the import.
    config = PACKAGE / "config"
    assert {p.stem for p in config.glob("*.py")} >= {*TORCH_FREE_CONFIG, "optimizer_config"}
    imports = [f"config/{p.name} imports {name}" for p in config.glob("*.py") if p.stem != "optimizer_config"
               for name, function in package_imports(p) if function is None and name.split(".")[0] == "torch"]
    assert not imports, imports


def test_the_flags_import_without_torch() -> None:
    # --help and a flag typo are answered before torch (seconds) or megatron-core (more) is imported,
    # and so are OptimizerConfig's rules on the flags (config/rules.py and what it imports).
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in flag_files()) + [f"megatron_eopt.config.{name}" for name in TORCH_FREE_CONFIG]
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
            "print('\\n'.join(sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "megatron_eopt.training.arguments.parser" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "megatron")]


def test_the_optimizer_flags_never_import_megatron() -> None:
    # arguments/*.py serve Megatron-LM's parser as well as ours (their layer: tests/unit/test_code_shape.py).
    imports = [f"{p.relative_to(ROOT)} imports {name}" for p in arguments_files() for name, _ in package_imports(p)
               if name.split(".")[0] == "megatron"]
    assert not imports, imports


def test_importing_the_config_does_not_import_the_bridge_layer(loaded_after) -> None:
    # The config's provide() reaches the factory only when called.
    assert "megatron_eopt.integrations.megatron_bridge" not in loaded_after["config"]


def test_megatron_core_only_where_allowed() -> None:
    violations = []
    for path in package_files():
        relative = path.relative_to(PACKAGE)
        for name, function in package_imports(path):
            if name.startswith("megatron.") and relative.as_posix() not in MEGATRON_CORE_ALLOWED and not (
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
