"""Muon routing of models megatron-core did not build (issue 82), in one process, unsharded:
`transformers`' LlamaForCausalLM (untied and tied), torchtitan's Llama3Model and its Qwen3 MoE
(each GroupedExperts tensor to Muon, one matrix per expert). Their token
embeddings and output heads go to the scalar optimizer by structure (params/heads.py), the hidden
matrices to Muon, and the param map dump says why. `use_muon` moves a parameter by attribute, and
OptimizerConfig.muon_include_params / muon_exclude_params by name.

tests/unit/library/distributed/test_fsdp2_other_models.py checks the same routes after fully_shard.
Expected routes are written out per kind of parameter (tests/routing_models.py), not computed
with the library's rule.
"""

import json

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.runtime.process_groups import ParallelGroups
from tests import routing_models
from tests.refusals import error_of


def routes_of(model: torch.nn.Module, tmp_path, **config_fields) -> dict[str, tuple[str, str]]:
    """(optimizer, routed_because) per parameter, from the param map dump."""
    config = OptimizerConfig(optimizer="muon", lr=0.01, **config_fields)
    get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process(),
                           dump_param_to_param_group_map=str(tmp_path))
    dump = json.loads((tmp_path / "rank_00000.json").read_text())
    return {name: (entry["optimizer"], entry["routed_because"]) for name, entry in dump.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_embeddings_and_head_go_to_adam(tmp_path, tied: bool) -> None:
    model = routing_models.llama(tied)
    assert routes_of(model, tmp_path) == routing_models.expected_llama_routes(model, tied)


def test_torchtitan_llama3_embedding_and_head_go_to_adam(tmp_path) -> None:
    model = routing_models.torchtitan_llama3()
    assert routes_of(model, tmp_path) == routing_models.expected_torchtitan_routes(model)


def test_torchtitan_qwen3_moe_experts_per_expert_embedding_and_head_to_adam(tmp_path) -> None:
    model = routing_models.torchtitan_qwen3_moe()
    assert routes_of(model, tmp_path) == routing_models.expected_torchtitan_moe_routes(model)


def test_use_muon_by_attribute_and_by_name(tmp_path) -> None:
    model = routing_models.llama(tied=False)
    model.lm_head.weight.use_muon = True
    model.model.layers[0].mlp.down_proj.weight.use_muon = False
    routes = routes_of(model, tmp_path / "attribute")
    assert routes["lm_head.weight"] == ("muon", "use_muon=True")
    assert routes["model.layers.0.mlp.down_proj.weight"] == ("adam", "use_muon=False")

    model = routing_models.llama(tied=False)
    routes = routes_of(model, tmp_path / "names", muon_include_params="lm_head.weight",
                       muon_exclude_params="*.mlp.down_proj.weight, model.norm.weight")
    assert routes["lm_head.weight"] == ("muon", "muon_include_params ('lm_head.weight')")
    for layer in range(routing_models.LAYERS):
        assert routes[f"model.layers.{layer}.mlp.down_proj.weight"] == (
            "adam", "muon_exclude_params ('*.mlp.down_proj.weight')")
    assert routes["model.norm.weight"] == routing_models.VECTOR  # not a matrix: never Muon
    assert routes["model.layers.0.mlp.up_proj.weight"] == routing_models.HIDDEN_MATRIX


def test_a_use_muon_glob_that_matches_nothing_warns_once_naming_close_names(tmp_path) -> None:
    """A misspelt glob moves nothing: said once per glob, with the closest parameter names; globs that
    match say nothing."""
    import warnings

    from megatron_eopt.runtime import once

    once._GIVEN.clear()  # a fresh process, for these warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for attempt in range(2):
            routes = routes_of(routing_models.llama(tied=False), tmp_path / str(attempt),
                               muon_include_params="lm_head.weights, lm_head.weight",
                               muon_exclude_params="*.mlp.down.weight")
    said = [str(w.message) for w in caught if "matches no trainable parameter" in str(w.message)]
    assert routes["lm_head.weight"] == ("muon", "muon_include_params ('lm_head.weight')")  # the other glob works
    assert len(said) == 2, said
    assert said[0].startswith("OptimizerConfig.muon_include_params glob 'lm_head.weights' matches no trainable "
                              "parameter on this rank, so it moves nothing into 'muon'"), said[0]
    assert "(closest: 'lm_head.weight'" in said[0], said[0]
    assert said[1].startswith("OptimizerConfig.muon_exclude_params glob '*.mlp.down.weight' matches no"), said[1]


def test_use_muon_conflicts_and_non_routing_optimizers_are_refused(tmp_path) -> None:
    model = routing_models.llama(tied=False)
    kind, both = error_of(lambda: routes_of(model, tmp_path, muon_include_params="lm_head.*",
                                            muon_exclude_params="*.weight"))
    assert kind == "ValueError" and "'lm_head.weight' matches OptimizerConfig.muon_include_params" in both, both
    model.lm_head.weight.use_muon = False
    kind, disagree = error_of(lambda: routes_of(model, tmp_path, muon_include_params="lm_head.weight"))
    assert kind == "ValueError" and "has use_muon=False but matches OptimizerConfig.muon_include_params" in disagree, disagree
    kind, adam = error_of(lambda: get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.01, muon_exclude_params="*"), [model],
        pg_collection=ParallelGroups.single_process()))
    assert kind == "ValueError" and "no effect with optimizer 'adam'" in adam, adam
