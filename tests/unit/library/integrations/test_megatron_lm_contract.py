"""Megatron-LM's loop, logging and checkpointing call our optimizer object: check every call.
And every public member of megatron-core 0.19.2's optimizer classes that ours lack is listed, with
why no caller needs it, in docs/library.md (`test_the_members_ours_lack_are_the_documented_ones`).

Reads the installed Megatron-LM training package (`megatron/training/**/*.py`, shipped in the
megatron-core wheel) with `ast`, without importing it, and collects each attribute used on a
name `optimizer` (the object `setup_model_and_optimizer` got from `get_megatron_optimizer`):
`optimizer.X` and the arguments of each call `optimizer.X(...)`. Our returned objects
(ChainedOptimizer, and LayerWiseDistributedOptimizer for the layer-wise case) must have each
one, and each call must bind to the method's signature. When Megatron-LM starts using a new
member this test fails naming it; add it to the optimizer or to KNOWINGLY_UNSUPPORTED with why.
"""

import ast
import functools
import importlib.util
import inspect
import pathlib
import re
import textwrap
from dataclasses import dataclass, field

import pytest

from megatron_eopt import ChainedOptimizer, FP32Optimizer, LayerWiseDistributedOptimizer, MixedPrecisionOptimizer

OPTIMIZER_CLASSES = (ChainedOptimizer, LayerWiseDistributedOptimizer)
KNOWINGLY_UNSUPPORTED = {
    "save_parameter_state": "megatron-core DistributedOptimizer's file of byte-sharded state; Megatron-LM "
    "calls it only with --use-distributed-optimizer and --ckpt-format torch, which "
    "megatron_eopt.integrations.megatron_lm refuses when it builds the optimizer",
    "load_parameter_state": "the loading half of save_parameter_state (same condition)",
}


@dataclass
class Use:
    """How Megatron-LM uses one member: where, and the shapes of its calls."""

    files: set = field(default_factory=set)
    calls: list = field(default_factory=list)  # (n_positional, keyword names, location)


def training_sources() -> list[pathlib.Path]:
    spec = importlib.util.find_spec("megatron.training")
    assert spec is not None and spec.submodule_search_locations, "megatron.training is not installed"
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.py"))
    assert len(files) > 10, f"too few Megatron-LM sources under {root}"
    return files


def spread_keys(tree: ast.AST, name: str) -> set[str]:
    """Keys a `**name` spread can hold: `name=dict(k=...)` bindings and `name['k'] = ...`."""
    keys = set()
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
        elif isinstance(node, ast.keyword) and node.arg == name:
            value = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name:
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                keys.add(node.slice.value)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
            keys |= {kw.arg for kw in value.keywords if kw.arg}
    return keys


@functools.cache
def instance_attributes(cls: type) -> set[str]:
    """Attributes our classes set on `self` (e.g. `chained_optimizers` in __init__)."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("megatron_eopt."):
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        names.add(node.attr)
    return names


def optimizer_uses() -> dict[str, Use]:
    uses: dict[str, Use] = {}
    for path in training_sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "optimizer":
                uses.setdefault(node.attr, Use()).files.add(path.name)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func
            if isinstance(target.value, ast.Name) and target.value.id == "optimizer":
                keywords = {kw.arg for kw in node.keywords if kw.arg}
                for kw in node.keywords:
                    if kw.arg is None and isinstance(kw.value, ast.Name):
                        keywords |= spread_keys(tree, kw.value.id)
                uses.setdefault(target.attr, Use()).calls.append((len(node.args), keywords, f"{path.name}:{node.lineno}"))
    return uses


def test_the_scan_finds_the_members_megatron_lm_is_known_to_use() -> None:
    """Guards the scanner itself: an empty scan would pass every check below."""
    found = set(optimizer_uses())
    assert {"step", "zero_grad", "get_loss_scale", "param_groups", "state_dict", "load_state_dict",
            "sharded_state_dict", "reload_model_params"} <= found, sorted(found)


@pytest.mark.parametrize("cls", OPTIMIZER_CLASSES, ids=lambda c: c.__name__)
def test_every_member_megatron_lm_uses_exists_with_a_compatible_signature(cls: type) -> None:
    problems = []
    for name, use in sorted(optimizer_uses().items()):
        if name in KNOWINGLY_UNSUPPORTED:
            continue
        if name in instance_attributes(cls) and not hasattr(cls, name):
            if use.calls:
                problems.append(f"{cls.__name__}.{name} is data; Megatron-LM calls it at {use.calls[0][2]}")
            continue
        if not hasattr(cls, name):
            problems.append(f"{cls.__name__} has no '{name}' (Megatron-LM uses it in {sorted(use.files)})")
            continue
        member = inspect.getattr_static(cls, name)
        for n_positional, keywords, where in use.calls:
            if isinstance(member, property) or not callable(getattr(cls, name)):
                problems.append(f"{cls.__name__}.{name} is not callable; Megatron-LM calls it at {where}")
                continue
            try:
                inspect.signature(getattr(cls, name)).bind(None, *[None] * n_positional, **dict.fromkeys(keywords))
            except TypeError as error:
                problems.append(
                    f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} cannot take "
                    f"{n_positional} positional argument(s) and keywords {sorted(keywords)} as at {where}: {error}"
                )
    assert not problems, "\n".join(problems)


def test_knowingly_unsupported_members_are_still_used() -> None:
    """An entry Megatron-LM no longer uses must leave the list (it would hide nothing)."""
    stale = sorted(set(KNOWINGLY_UNSUPPORTED) - set(optimizer_uses()))
    assert not stale, f"Megatron-LM no longer uses {stale}; remove them from KNOWINGLY_UNSUPPORTED"


def test_members_added_for_megatron_lm_behave() -> None:
    """Values Megatron-LM branches on: a chain is not a stub optimizer unless it has no children
    (tests/unit/library/wrappers/test_stub_optimizer.py)."""
    for cls in OPTIMIZER_CLASSES:
        assert cls.is_stub_optimizer is False
    params = inspect.signature(LayerWiseDistributedOptimizer.load_state_dict_from_file).parameters
    assert list(params) == ["self", "filename"]


# megatron-core's classes that get_megatron_optimizer returns or chains, by the name both libraries
# give them. Left out: the abstract MegatronOptimizer (nothing returns it) and DistributedOptimizer,
# which ours hands over to megatron-core's own (adam on a reduce-scattering DDP).
SAME_NAMED_CLASSES = ("ChainedOptimizer", "LayerWiseDistributedOptimizer", "FP32Optimizer", "MixedPrecisionOptimizer")
LIBRARY_DOC = pathlib.Path(__file__).resolve().parents[4] / "docs" / "library.md"
LACKED = re.compile(r"<!-- megatron-core members not provided: begin -->\n(.*?)<!-- megatron-core members not "
                    r"provided: end -->", re.S)


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_members_ours_lack_are_the_documented_ones() -> None:
    """The set difference of public members, megatron-core's class minus ours, is exactly the
    `Class.member` names in docs/library.md's list: fails when ours gains one still listed, and
    when megatron-core has one ours lacks that the list does not give a reason for."""
    import megatron.core.optimizer.layer_wise_optimizer as core_layer_wise
    import megatron.core.optimizer.optimizer as core_optimizer

    import megatron_eopt

    ours = {cls.__name__: cls for cls in (ChainedOptimizer, LayerWiseDistributedOptimizer, FP32Optimizer,
                                          MixedPrecisionOptimizer)}
    core = {name: getattr(core_optimizer, name, None) or getattr(core_layer_wise, name) for name in SAME_NAMED_CLASSES}
    lacked = {f"{name}.{member}" for name in SAME_NAMED_CLASSES for member in _public(core[name]) - _public(ours[name])}
    assert all(getattr(megatron_eopt, name) is ours[name] for name in SAME_NAMED_CLASSES)
    found = LACKED.search(LIBRARY_DOC.read_text())
    assert found, f"{LIBRARY_DOC.name}: no `<!-- megatron-core members not provided: begin -->` ... `end -->` list"
    listed = set(re.findall(r"`(\w+\.\w+)`", found.group(1)))
    assert lacked == listed, (f"ours lack, not listed: {sorted(lacked - listed)}; listed, not lacked: "
                              f"{sorted(listed - lacked)}")
