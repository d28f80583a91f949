"""The torch-free lists of optimizer names and coefficient sets (config/optimizer_names.py) against the
installed emerging_optimizers, which the registry reads after importing torch."""

import json
import subprocess
import sys
import warnings

import pytest

from megatron_eopt import registry
from megatron_eopt.config import optimizer_names
from megatron_eopt.ops.newton_schulz import coefficient_types
from megatron_eopt.registry import OptimizerTable


def test_the_lists_are_the_installed_packages() -> None:
    assert optimizer_names.series_installed()
    assert optimizer_names.optimizer_names() == tuple(registry.list_optimizers())
    assert set(optimizer_names.coefficient_types()) == set(coefficient_types())


def test_they_import_no_torch() -> None:
    code = ("import json, sys\nfrom megatron_eopt.config import optimizer_names\n"
            "names = optimizer_names.optimizer_names(), optimizer_names.coefficient_types()\n"
            "print(json.dumps({'names': names, 'torch': 'torch' in sys.modules}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert report["torch"] is False and "muon" in report["names"][0] and "quintic" in report["names"][1]


def test_another_series_leaves_the_names_to_the_installed_package(monkeypatch) -> None:
    monkeypatch.setattr(optimizer_names, "EMERGING_OPTIMIZERS_SERIES", "0.99")
    assert optimizer_names.optimizer_names() is None and optimizer_names.coefficient_types() is None
    assert optimizer_names.mismatch(("muon",), ["muon", "new"], "optimizer names") is None


def test_the_registry_warns_when_the_list_differs(monkeypatch) -> None:
    monkeypatch.setattr(registry.table, "EMERGING_OPTIMIZERS", optimizer_names.EMERGING_OPTIMIZERS[1:] + ("gone",))
    monkeypatch.setattr(registry.table, "_TABLE", OptimizerTable())
    first = optimizer_names.EMERGING_OPTIMIZERS[0]
    with pytest.warns(RuntimeWarning, match=rf"optimizer names differ .* not listed \['{first}'\], listed but "
                                            r"absent \['gone'\]"):
        registry.list_optimizers()


def test_the_registry_is_silent_when_the_lists_agree(monkeypatch) -> None:
    monkeypatch.setattr(registry.table, "_TABLE", OptimizerTable())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        registry.list_optimizers()
