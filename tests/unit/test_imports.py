"""Guardrails on imports.

`import megatron_eopt` must not import megatron-core (its model stack costs ~16 s; checked in
a fresh interpreter). The package's layers import only downwards (read from the source with
`ast`): config/param_key -> ops -> optimizers -> registry -> param_groups ->
wrappers/distributed -> checkpointing -> factory; megatron-core appears only where allowed.
"""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_eopt"
LAYER_OF = {  # first component below megatron_eopt -> layer; a module imports layers <= its own
    "config": 0, "param_key": 0, "ops": 1, "optimizers": 2, "registry": 3, "param_groups": 4,
    "wrappers": 5, "distributed": 5, "checkpointing": 6, "factory": 7, "muon": 8, "bridge": 8,
    "integrations": 9,
}
MEGATRON_CORE_ALLOWED = {"distributed/process_groups.py", "factory.py", "bridge.py", "wrappers/megatron_sharded.py",
                         "integrations/megatron_lm.py"}
# Megatron-LM's training package (megatron.training, in the megatron-core wheel): only its adapter.
MEGATRON_TRAINING_ALLOWED = {"integrations/megatron_lm.py"}
# Upward imports that are deliberate, each inside a function: OptimizerConfig.provide() is
# Megatron-Bridge's custom-optimizer hook, so the config must be able to build the optimizer.
UPWARD_ALLOWED = {("config.py", "megatron_eopt.bridge")}


def package_imports(path: pathlib.Path) -> list[str]:
    """Every absolute module name imported anywhere in the file (function bodies included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def layer(relative: pathlib.Path) -> int:
    top = relative.parts[0].removesuffix(".py")
    if top not in LAYER_OF:
        raise AssertionError(f"megatron_eopt/{relative} is in no layer; add it to LAYER_OF")
    return LAYER_OF[top]


def test_import_does_not_load_megatron_core() -> None:
    code = "import sys, megatron_eopt, megatron_eopt.integrations; print('\\n'.join(sys.modules))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = output.stdout.split()
    assert "megatron_eopt.factory" in modules
    assert not [m for m in modules if m.startswith("megatron.")], "megatron-core imported eagerly"


def test_layers_import_only_downwards() -> None:
    violations = []
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(files) > 5
    for path in files:
        relative = path.relative_to(PACKAGE)
        for name in package_imports(path):
            if name.startswith("megatron_eopt."):
                target = pathlib.Path(*name.split(".")[1:])
                if layer(target) > layer(relative) and (relative.as_posix(), name) not in UPWARD_ALLOWED:
                    violations.append(f"{relative} imports {name}")
            elif name.startswith("megatron.") and relative.as_posix() not in MEGATRON_CORE_ALLOWED:
                violations.append(f"{relative} imports megatron-core ({name})")
            if name.startswith("megatron.training") and relative.as_posix() not in MEGATRON_TRAINING_ALLOWED:
                violations.append(f"{relative} imports Megatron-LM's training package ({name})")
    assert not violations, violations
