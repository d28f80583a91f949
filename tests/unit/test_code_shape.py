"""Guardrails on the shape of the code outside tests/, read from the source with `ast`.

Functions fit on a screen (at most 80 lines), modules stay below 700 lines, module docstrings
stay short (15 lines), megatron_eopt/ holds at most 4 modules outside its folders and a library
package at most 2,500 lines, entry scripts are thin and nothing imports them, and nothing edits
`sys.path` (the package is installed; scripts run with their own folder on the path). The
packages of megatron_eopt/ form layers, which docs/layers.md draws: a module imports only its own
layer and the layers below it, imports inside functions included.
"""

import ast
import pathlib
import re
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("megatron_eopt", "arguments", "scripts", "benchmarks", "tools")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700
MAX_DOCSTRING_LINES = 15
MAX_ROOT_MODULES = 4  # megatron_eopt/ groups its modules by concern in folders
MAX_PACKAGE_LINES = 2500  # a library package (the trainer, training/, has folders by concern)
MAX_ENTRY_SCRIPT_LINES = {"scripts/pretrain_gpt.py": 150, "scripts/demo.py": 40, "scripts/pretrain_gpt_megatron_lm.py": 40}


def source_files() -> list[pathlib.Path]:
    files = [p for folder in SOURCE_FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    assert len(files) > 50, "no source found"
    return sorted(files)


def relative(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_functions_and_modules_are_short() -> None:
    too_long = []
    for path in source_files():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{relative(path)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{relative(path)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


def test_module_docstrings_are_short() -> None:
    long_docstrings = []
    for path in source_files():
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if docstring and docstring.strip().count("\n") + 1 > MAX_DOCSTRING_LINES:
            long_docstrings.append(f"{relative(path)}: {docstring.strip().count(chr(10)) + 1} lines")
    assert not long_docstrings, long_docstrings


def test_nothing_edits_sys_path_or_imports_an_entry_script() -> None:
    offenders = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                offenders.append(f"{relative(path)}:{node.lineno} uses sys.path")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "scripts":
                offenders.append(f"{relative(path)}:{node.lineno} imports from scripts/")
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "scripts" for a in node.names):
                offenders.append(f"{relative(path)}:{node.lineno} imports scripts/")
    assert not offenders, offenders


def test_entry_scripts_are_thin() -> None:
    lengths = {name: (ROOT / name).read_text().count("\n") for name in MAX_ENTRY_SCRIPT_LINES}
    assert all(lengths[name] <= limit for name, limit in MAX_ENTRY_SCRIPT_LINES.items()), lengths


def test_the_package_root_holds_few_modules() -> None:
    root_modules = sorted(p.name for p in (ROOT / "megatron_eopt").glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules


# What checkpointing/ and megatron_core_formats/ may not read of a child: its inner torch optimizer and its parameter lists.
# They call the child's methods instead (CheckpointableChild, checkpointable/child.py), so the wrappers may
# change how they hold these.
CHILD_INTERNALS = {"optimizer", "records", "model_params", "main_params"}


def _foreign_attribute_uses(tree: ast.AST, names: set[str], stores: bool) -> list[ast.Attribute]:
    """Attribute reads (or, with `stores`, assignments) of `names` on anything but `self`."""
    wanted = ast.Store if stores else ast.Load
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.ctx, wanted)
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")]


def test_checkpointing_reads_children_through_their_methods() -> None:
    offenders = [f"{relative(path)}:{node.lineno} reads .{node.attr}"
                 for folder in ("checkpointing", "megatron_core_formats")
                 for path in sorted((ROOT / "megatron_eopt" / folder).glob("*.py"))
                 for node in _foreign_attribute_uses(ast.parse(path.read_text()), CHILD_INTERNALS, stores=False)]
    assert not offenders, offenders


def test_qk_clip_is_given_to_constructors_not_set_on_built_objects() -> None:
    offenders = [f"{relative(path)}:{node.lineno} sets .qk_clip"
                 for path in source_files()
                 for node in _foreign_attribute_uses(ast.parse(path.read_text()), {"qk_clip"}, stores=True)]
    assert not offenders, offenders


# megatron_eopt/'s layers, lowest first, as docs/layers.md draws them: a package (or root module)
# imports only its own layer and the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime",),  # process groups, hardware, warn-once: no other megatron_eopt module
    ("config",),
    ("ops",),
    ("params",),
    ("optimizers",),
    ("registry",),
    ("placement",),  # where a sharded model's parameters lie: read by distributed/ and checkpointing/
    ("checkpointable",),  # what checkpoints read of an optimizer child
    ("megatron_core_formats",),  # megatron-core's checkpoint files; the wrappers' sharded_state_dict() writes them
    ("offload",),  # optimizer state off the accelerator: during the step (optimizer_cpu_offload) and between steps
    ("wrappers",),
    ("distributed",),
    ("checkpointing",),  # our own checkpoint files
    ("factory",),
    ("arguments",),  # the top-level package beside megatron_eopt/: the optimizer's flags, Megatron-LM's parser and ours
    ("integrations", "muon"),  # muon.py: the deprecated import path, re-exports integrations/deprecated_muon.py
    ("training",),  # the trainer, its flags in training/arguments/: nothing in the library imports it
)
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}
# The one upward import, inside the method that needs it: OptimizerConfig.provide() is
# Megatron-Bridge's custom-optimizer hook, so the config must be able to call the factory (the
# root circle config <-> factory). It is a function-level import of the factory alone (never of the
# Bridge layer), so importing the config never imports what lies above it. Every other import
# inside a function counts like one at the top: a late import that hides a cycle is still one.
UPWARD_ALLOWED = {("config/optimizer_config.py", "megatron_eopt.factory", "provide")}


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
    """The file of megatron_eopt or arguments module `name` (a package's `__init__.py`), or None when it is not one."""
    if name.split(".")[0] not in ("megatron_eopt", "arguments") or name == "megatron_eopt":
        return None
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def layer(module: str) -> int:
    """The layer of `module`, a path below megatron_eopt/ ('checkpointing/state.py') or a dotted name
    below it ('checkpointing.state'); or one of arguments/ ('arguments/validate.py', 'arguments.validate')."""
    top = re.split(r"[./]", module)[0]
    if top not in LAYER_OF:
        raise AssertionError(f"megatron_eopt/{module} is in no layer; add it to LAYERS (and docs/layers.md)")
    return LAYER_OF[top]


def upward_imports(imports: dict[str, list[tuple[str, Optional[str]]]]) -> list[str]:
    """'module imports name' for each import of `imports` (module below megatron_eopt/ or arguments/... ->
    [(imported name, enclosing function or None)]) that climbs to a higher layer, the allowed one left out."""
    violations = []
    for module, names in sorted(imports.items()):
        for name, function in names:
            ours = name == "arguments" or name.startswith(("megatron_eopt.", "arguments."))
            if not ours or (module, name, function) in UPWARD_ALLOWED:
                continue
            if layer(name.removeprefix("megatron_eopt.")) > layer(module):
                where = f" (in {function}())" if function else ""
                violations.append(f"{module} imports {name}{where}")
    return violations


def test_layers_import_only_downwards() -> None:
    package = ROOT / "megatron_eopt"
    imports = {p.relative_to(package).as_posix(): package_imports(p) for p in package.rglob("*.py")
               if p != package / "__init__.py"}  # the root re-exports every layer, on first use
    imports |= {p.relative_to(ROOT).as_posix(): package_imports(p) for p in (ROOT / "arguments").rglob("*.py")}
    assert len(imports) > 100 and "arguments/optimizer_args.py" in imports
    assert not upward_imports(imports), upward_imports(imports)


def test_an_upward_import_fails_the_check() -> None:
    imports = {
        "placement/fully_sharded_layout.py": [("megatron_eopt.distributed.fsdp2", None)],
        "wrappers/fp32.py": [("megatron_eopt.checkpointing.state", "load_state_dict"), ("megatron_eopt.params", None)],
        "checkpointing/state.py": [("megatron_eopt.wrappers.fp32", None), ("megatron_eopt.placement", None)],
        "config/optimizer_config.py": [("megatron_eopt.factory", "provide")],  # the allowed one
        "config/rules.py": [("megatron_eopt.factory", None)],  # at the top: not allowed
        "arguments/validate.py": [("megatron_eopt.registry", "optimizer_names"), ("megatron_eopt.training.errors", None)],
        "integrations/megatron_lm.py": [("arguments.optimizer_args", None)],  # the flags lie below the integrations
        "factory.py": [("arguments.to_config", "build")],  # and above the library
    }
    assert upward_imports(imports) == [
        "arguments/validate.py imports megatron_eopt.training.errors",
        "config/rules.py imports megatron_eopt.factory",
        "factory.py imports arguments.to_config (in build())",
        "placement/fully_sharded_layout.py imports megatron_eopt.distributed.fsdp2",
        "wrappers/fp32.py imports megatron_eopt.checkpointing.state (in load_state_dict())",
    ]


def test_every_package_is_in_a_layer_as_docs_draw_them() -> None:
    package = ROOT / "megatron_eopt"
    found = {p.name.removesuffix(".py") for p in package.iterdir()
             if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")}
    found.add("arguments")  # beside megatron_eopt/
    assert found == set(LAYER_OF), f"packages without a layer {sorted(found - set(LAYER_OF))}, gone {sorted(set(LAYER_OF) - found)}"
    drawing = (ROOT / "docs" / "layers.md").read_text().split("```")[1]
    drawn = re.findall(r"^ *(\d+)? +([a-z_]+)(?:/|\.py) ", drawing, re.MULTILINE)
    layers: list[list[str]] = []
    for number, name in drawn:
        if number:
            layers.append([name])
        elif layers:
            layers[-1].append(name)
    assert [tuple(names) for names in reversed(layers)] == list(LAYERS), "docs/layers.md draws other layers"


def test_library_packages_are_small() -> None:
    package = ROOT / "megatron_eopt"
    sizes = {folder.name: sum(p.read_text().count("\n") for p in folder.rglob("*.py"))
             for folder in package.iterdir() if folder.is_dir() and folder.name not in ("training", "__pycache__")}
    assert all(lines <= MAX_PACKAGE_LINES for lines in sizes.values()), sizes
