"""The word at build about parameters routed by a fallback, OptimizerConfig.muon_strict_layouts,
and muon_include_params on an N-D tensor of unknown layout (params/groups.py: routing_fallbacks)."""

import warnings

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

CONFIG = OptimizerConfig(optimizer="muon", lr=0.1)


class _Block(torch.nn.Module):
    """A module no table describes: a `qkv` linear layer (named like a fused weight), a 3-D table
    (an N-D tensor of no known layout), a conv kernel and a [1, 1, 6] token (no matrices)."""

    def __init__(self, qkv_name: str = "qkv") -> None:
        super().__init__()
        setattr(self, qkv_name, torch.nn.Linear(6, 18))
        self.table = torch.nn.Parameter(torch.randn(2, 5, 6))
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.token = torch.nn.Parameter(torch.randn(1, 1, 6))


def _fallback_warnings(model: torch.nn.Module, **fields) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, **fields), [model])
    return [str(w.message) for w in caught if "by a fallback" in str(w.message)]


def test_one_line_names_the_fallbacks_and_only_them() -> None:
    (line,) = _fallback_warnings(_Block())
    assert "\n" not in line and "qkv.weight" in line and "table: N-D tensor of no known layout" in line, line
    assert "conv" not in line and "token" not in line and "register_fused_layout" in line, line
    assert _fallback_warnings(_Block(qkv_name="proj")) != []  # the table alone
    plain = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Conv2d(3, 4, 3))
    assert _fallback_warnings(plain) == []


def test_strict_layouts_refuses_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"muon_strict_layouts=True: 2 parameter\(s\)") as raised:
        get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, muon_strict_layouts=True), [_Block()])
    assert "qkv.weight" in str(raised.value) and "table" in str(raised.value) and "\n" not in str(raised.value)
    get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, muon_strict_layouts=True),
                           [torch.nn.Linear(6, 6)])  # nothing to refuse


def test_include_params_on_unknown_n_d_tensor_is_refused() -> None:
    refusal = r"'table' \(\(2, 5, 6\)\) is opted into muon by muon_include_params"
    with pytest.raises(ValueError, match=refusal) as raised:
        get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, muon_include_params="table"),
                               [_Block(qkv_name="proj")])
    assert "register_experts_container" in str(raised.value)


class _Declared(torch.nn.Module):
    """A module whose layout function finds its facts missing (returns None)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Linear(6, 12)


def test_a_table_entry_without_its_facts_is_a_fallback_too() -> None:
    from megatron_eopt.params.fused_layouts import register_fused_layout

    register_fused_layout(_Declared, "fused", lambda weight: None)
    with pytest.raises(ValueError, match=r"_Declared.fused: its module lacks the facts its table entry reads"):
        get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, muon_strict_layouts=True), [_Declared()])
