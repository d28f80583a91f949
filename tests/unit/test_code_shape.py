"""Guardrails on the shape of the code outside tests/, read from the source with `ast`.

Functions fit on a screen (at most 80 lines), modules stay below 700 lines, module docstrings
stay short (15 lines), megatron_eopt/ holds at most 4 modules outside its folders, entry scripts
are thin and nothing imports them, and nothing edits `sys.path` (the package is installed;
scripts run with their own folder on the path).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("megatron_eopt", "arguments", "scripts", "benchmarks", "tools")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700
MAX_DOCSTRING_LINES = 15
MAX_ROOT_MODULES = 4  # megatron_eopt/ groups its modules by concern in folders
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


# What checkpointing/ may not read of a child: its inner torch optimizer and its parameter lists.
# It calls the child's methods instead (CheckpointableChild, wrappers/base.py), so the wrappers may
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
                 for path in sorted((ROOT / "megatron_eopt" / "checkpointing").glob("*.py"))
                 for node in _foreign_attribute_uses(ast.parse(path.read_text()), CHILD_INTERNALS, stores=False)]
    assert not offenders, offenders


def test_qk_clip_is_given_to_constructors_not_set_on_built_objects() -> None:
    offenders = [f"{relative(path)}:{node.lineno} sets .qk_clip"
                 for path in source_files()
                 for node in _foreign_attribute_uses(ast.parse(path.read_text()), {"qk_clip"}, stores=True)]
    assert not offenders, offenders
