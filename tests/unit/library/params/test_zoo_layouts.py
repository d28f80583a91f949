"""Muon per component on the fused and stacked weights of more `transformers` and torchtitan
families, one Muon step each with synthetic gradients (torchtitan's attention has no CPU backward).

For each weight, the components are cut out here from the layout its own forward reads (the
comment at each case names it); each component's first update must equal lr * sqrt(max(m, n))
times emerging_optimizers' plain Newton-Schulz of that component's own gradient block. fp32,
muon_fp32_matmul_prec='highest', no weight decay, no clipping. Orthogonalizing a weight whole
gives another update (relative error ~0.4 to 1.2 per component, the issue's figures), so each case
fails without its table entry.
"""

import dataclasses
import warnings
from unittest import mock

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.params import fused_layouts
from megatron_eopt.runtime import once
from tests import routing_models, zoo_models

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchtitan")

LR = 0.1
TOLERANCE = 2e-5  # relative to the reference's largest entry: fp32 round-off of two Newton-Schulz orders
CONFIG = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.0, clip_grad=0.0, muon_fp32_matmul_prec="highest")


CASES = zoo_models.CASES


def reference_update(gradient_block: torch.Tensor) -> torch.Tensor:
    rows, cols = gradient_block.shape
    return LR * max(rows, cols) ** 0.5 * muon_utils.newton_schulz(gradient_block.float(), 5, "quintic")


def _drop_table_entries(model: torch.nn.Module, parts: dict) -> None:
    """Remove the table's entries for the parts' linear layers (`<owner>.<attribute>.weight`, or a
    list of them held as `<owner>.<attribute>.<i>...`), through each owner's MRO: the weights then go
    to Muon whole."""
    for name in parts:
        path = name.split(".")[:-1]
        for depth in range(len(path)):  # every module above it: a list of layers is keyed by its holder
            for cls in type(model.get_submodule(".".join(path[:depth]))).__mro__:
                fused_layouts._TABLE.pop((fused_layouts.qualified_name(cls), path[depth]), None)


def _one_step(case: str, config: OptimizerConfig, without_entries: bool = False):
    """(optimizer, the case's parts, the model's parameters by name, the parts' values before) after one
    step of the case's tiny model with synthetic gradients; `without_entries`: with the parts' table
    entries removed (call it under mock.patch.dict of the table)."""
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    model, parts = CASES[case]()
    model = model.float()
    if without_entries:
        _drop_table_entries(model, parts)
    optimizer = get_megatron_optimizer(config, [model])
    routing_models.synthetic_gradients(model, seed=1)
    params = dict(model.named_parameters())
    before = {name: params[name].detach().clone() for name in parts}
    optimizer.step()
    return optimizer, parts, params, before


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_component_along_newton_schulz_of_its_own_gradient(case: str) -> None:
    optimizer, parts, params, before = _one_step(case, CONFIG)
    routed = {fqn: group["optimizer"] for child in optimizer.chained_optimizers
              for group in child.param_groups for fqn in group["param_fqns"]}
    for name, components in parts.items():
        assert routed[name] == "muon", (case, name, routed[name])
        update = before[name] - params[name].detach()
        for index, component in enumerate(components):
            expected = reference_update(component(params[name].grad))
            error = ((component(update) - expected).abs().max() / expected.abs().max()).item()
            assert error <= TOLERANCE, (case, name, index, error)


# The cases of params/zoo_layouts.py's entries: each component far from its own Newton-Schulz without them.
ZOO_LAYOUTS_CASES = ("hf_vision_qkv", "titan_flux_blocks", "hf_gated_mlps", "hf_deberta_in_proj",
                     "hf_short_conv_in_proj", "hf_deepseek_v4_attention", "hf_fused_under_other_names")
FAR_OFF = 0.1  # relative error every component shows without its entry (measured 0.33 to 0.58)


@pytest.mark.parametrize("case", ZOO_LAYOUTS_CASES)
def test_without_its_table_entry_each_component_is_far_off(case: str) -> None:
    with mock.patch.dict(fused_layouts._TABLE), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the build names the weights named like fused ones it keeps whole
        _, parts, params, before = _one_step(case, CONFIG, without_entries=True)
    errors = {}
    for name, components in parts.items():
        update = before[name] - params[name].detach()
        for index, component in enumerate(components):
            expected = reference_update(component(params[name].grad))
            errors[name, index] = ((component(update) - expected).abs().max() / expected.abs().max()).item()
    assert min(errors.values()) > FAR_OFF, errors


PER_HEAD_CASES = ("hf_falcon_qkv", "hf_chunked_wqkv", "hf_gpt_bigcode_c_attn", "hf_codegen_qkv", "hf_deberta_in_proj",
                  "hf_gpt2_c_attn", "hf_openai_gpt_c_attn")
STORED_TRANSPOSED = ("hf_gpt2_c_attn", "hf_openai_gpt_c_attn")  # Conv1D [in, out]: heads are column blocks


def test_per_head_each_head_along_newton_schulz_of_its_own_gradient() -> None:
    """With muon_split_qkv_per_head, every head's query, key and value rows (8 rows: these cases'
    head_dim; of the [out, in] transpose of a Conv1D) are one matrix, in each q/k/v layout of
    params/qkv_layouts.py and params/conv1d_layouts.py; and the option does not say it does nothing."""
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.0, clip_grad=0.0,
                             muon_fp32_matmul_prec="highest", muon_split_qkv_per_head=True)
    for case in PER_HEAD_CASES:
        with mock.patch.object(once, "_GIVEN", set()), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, parts, params, before = _one_step(case, config)
        assert not [w for w in caught if "muon_split_qkv_per_head" in str(w.message)], (case, caught)
        rows = (lambda t: t.T) if case in STORED_TRANSPOSED else (lambda t: t)
        for name in parts:
            update, gradient = rows(before[name] - params[name].detach()), rows(params[name].grad)
            for head in range(update.shape[0] // 8):
                expected = reference_update(gradient[8 * head:8 * (head + 1)])
                error = ((update[8 * head:8 * (head + 1)] - expected).abs().max() / expected.abs().max()).item()
                assert error <= TOLERANCE, (case, name, head, error)


class _RowsQKV(torch.nn.Module):
    """GPT-2's attention with its weights stored [out, in] (nn.Linear): c_attn's q, k, v row blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = torch.nn.Linear(32, 96, bias=False), torch.nn.Linear(32, 32, bias=False)


@pytest.mark.parametrize("optimizer, moment2", [("muon", None), ("adaptive_muon", "normuon"),
                                                ("adaptive_muon", "adamuon")])
def test_conv1d_c_attn_steps_as_its_transpose_stored_as_rows(optimizer: str, moment2) -> None:
    """Two steps on GPT-2's c_attn (Conv1D [in, out]) equal, transposed, two steps on the same
    matrices stored [out, in] with a q/k/v row layout: the Muon scale and adaptive_muon's
    statistics (normuon's per-row mean of the [out, in] view) read the view, not the storage.
    (normuon reading the storage's rows instead: relative error 1.8e-2.)"""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    from megatron_eopt.params.fused_layouts import FusedBlocks, register_fused_layout

    register_fused_layout(_RowsQKV, "c_attn", lambda weight: FusedBlocks((32, 32, 32)))
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    conv, rows = torch.nn.Module(), torch.nn.Module()
    conv.attn, rows.attn = GPT2Attention(transformers.GPT2Config(n_embd=32, n_head=4)), _RowsQKV()
    conv.attn.requires_grad_(False)
    for name in ("c_attn", "c_proj"):
        getattr(conv.attn, name).weight.requires_grad_(True)
        getattr(rows.attn, name).weight.data.copy_(getattr(conv.attn, name).weight.T)
    moment2_field = {} if moment2 is None else {"adaptive_muon_moment2_method": moment2}
    config = OptimizerConfig(optimizer=optimizer, lr=LR, weight_decay=0.0, clip_grad=0.0,
                             muon_fp32_matmul_prec="highest", **moment2_field)
    optimizers = [get_megatron_optimizer(config, [model]) for model in (conv, rows)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for name, out in (("c_attn", 96), ("c_proj", 32)):
            gradient = torch.randn(out, 32, generator=generator)
            getattr(conv.attn, name).weight.grad, getattr(rows.attn, name).weight.grad = gradient.T.clone(), gradient
        for opt in optimizers:
            opt.step()
    expected = rows.attn.c_attn.weight.detach()
    error = ((conv.attn.c_attn.weight.detach().T - expected).abs().max() / expected.abs().max()).item()
    assert error <= TOLERANCE, (optimizer, moment2, error)


def test_conv1d_c_attn_layer_wise_and_resumed_state_equal_one_process() -> None:
    """GPT-2's c_attn through the other consumers of its layout: the layer-wise distributed
    optimizer (one rank, which owns every parameter: its own layouts, its own step) equals plain
    Muon after two steps; and the optimizer's state (momentum, stored [in, out] as the parameter)
    saved after two steps and loaded into a fresh optimizer steps on bitwise."""
    import copy

    from megatron_eopt import ParallelGroups

    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    model = zoo_models.hf_gpt2_c_attn()[0].float()
    layer_wise_model = copy.deepcopy(model)
    optimizer = get_megatron_optimizer(CONFIG, [model])
    layer_wise = get_megatron_optimizer(dataclasses.replace(CONFIG, use_layer_wise_distributed_optimizer=True),
                                        [layer_wise_model], pg_collection=ParallelGroups.single_process())
    for step in range(2):
        for target, opt in ((model, optimizer), (layer_wise_model, layer_wise)):
            routing_models.synthetic_gradients(target, seed=step)
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), layer_wise_model.parameters()))
    resumed_model = copy.deepcopy(model)
    resumed = get_megatron_optimizer(CONFIG, [resumed_model])
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for target, opt in ((model, optimizer), (resumed_model, resumed)):
        routing_models.synthetic_gradients(target, seed=2)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_conv1d_weights_in_megatron_cores_orientation_under_an_asymmetric_scale() -> None:
    """Every Conv1D weight (GPT-2's c_fc [32, 128], c_proj, c_attn's blocks) is stepped in its
    [out, in] view, the orientation of megatron-core's fc1/fc2, which `shape_scaling` reads:
    c_fc's update is lr * sqrt(max(1, out/in)) = 2 lr times Newton-Schulz of its transposed gradient,
    transposed back (stored as is, the scale would be 1: half the update; c_proj's the other way)."""
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    model = CASES["hf_gpt2_c_attn"]()[0].float()
    config = dataclasses.replace(CONFIG, muon_scale_mode="shape_scaling")
    optimizer = get_megatron_optimizer(config, [model])
    routing_models.synthetic_gradients(model, seed=1)
    params = {name: p for name, p in model.named_parameters() if name.endswith(("c_fc.weight", "mlp.c_proj.weight"))}
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer.step()
    assert len(params) == 2, sorted(params)
    for name, param in params.items():
        gradient = param.grad.T  # [out, in]
        expected = (LR * max(1.0, gradient.shape[0] / gradient.shape[1]) ** 0.5
                    * muon_utils.newton_schulz(gradient.float(), 5, "quintic")).T
        update = before[name] - param.detach()
        error = ((update - expected).abs().max() / expected.abs().max()).item()
        assert error <= TOLERANCE, (name, error)
