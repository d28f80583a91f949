"""Muon routing of models megatron-core did not build, sharded with torch FSDP2 as AReaL, verl and
torchtitan shard them (`fully_shard` on each decoder layer, then the root), on 2 gloo ranks, in
one launch: `transformers`' LlamaForCausalLM untied and tied, torchtitan's Llama3Model and its
Qwen3 MoE (each GroupedExperts tensor, sharded on its experts dimension, to Muon per expert).

fully_shard replaces every parameter by a DTensor and drops its attributes, so the routes must
come from the modules: on every rank they equal the unsharded routes that
tests/unit/library/test_routing_other_models.py checks (tests/routing_models.py writes them out),
with the dump's reasons. Also: a `use_muon` set before fully_shard is gone after it (why
muon_include_params exists), the name field moves the head into Muon, and the untied Llama takes
a step from a real forward and backward.
"""

import json
import tempfile
import time

import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh
from tests import routing_models


def _shard(model: torch.nn.Module, layers) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = data_parallel_mesh(torch.distributed.group.WORLD, torch.device("cpu"))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _routes(model: torch.nn.Module, **config_fields) -> tuple[dict, object]:
    config = OptimizerConfig(optimizer="muon", lr=0.01, muon_fp32_matmul_prec="highest", **config_fields)
    with tempfile.TemporaryDirectory() as directory:
        optimizer = get_megatron_optimizer(config, [model], dump_param_to_param_group_map=directory)
        rank = torch.distributed.get_rank()
        with open(f"{directory}/rank_{rank:05d}.json") as handle:
            dump = json.load(handle)
    return {name: (entry["optimizer"], entry["routed_because"]) for name, entry in dump.items()}, optimizer


def _llama_step(model: torch.nn.Module, optimizer) -> dict:
    tokens = torch.randint(0, routing_models.VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    before = model.lm_head.weight.to_local().clone()
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    ok, grad_norm, _ = optimizer.step()
    return {"ok": ok, "grad_norm": grad_norm, "head_moved": not torch.equal(before, model.lm_head.weight.to_local())}


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    result = {}
    for tied in (False, True):
        model = routing_models.llama(tied)
        expected = routing_models.expected_llama_routes(model, tied)
        model.lm_head.weight.use_muon = True  # set before fully_shard: dropped with the plain parameter
        _shard(model, model.model.layers)
        assert isinstance(model.lm_head.weight, DTensor)
        result[f"llama tied={tied}"] = {"expected": expected, "dropped": not hasattr(model.lm_head.weight, "use_muon")}
        result[f"llama tied={tied}"]["routes"], optimizer = _routes(model)
        if not tied:
            result["step"] = _llama_step(model, optimizer)
            result["by name"] = _routes(model, muon_include_params="lm_head.weight")[0]["lm_head.weight"]
    model = routing_models.torchtitan_llama3()
    expected = routing_models.expected_torchtitan_routes(model)
    _shard(model, model.layers.values())
    result["torchtitan"] = {"expected": expected, "routes": _routes(model)[0], "dropped": True}
    started = time.perf_counter()
    model = routing_models.torchtitan_qwen3_moe()  # 4 experts: 2 whole ones per rank
    expected = routing_models.expected_torchtitan_moe_routes(model)
    _shard(model, model.layers.values())
    result["torchtitan moe"] = {"expected": expected, "routes": _routes(model)[0], "dropped": True,
                                "seconds": time.perf_counter() - started}
    return result


def test_heads_and_embeddings_of_fully_sharded_transformers_and_torchtitan_models(run_distributed) -> None:
    for rank, result in enumerate(run_distributed(_body, world_size=2, timeout=600)):
        print(f"rank {rank}: torchtitan Qwen3 MoE routing took {result['torchtitan moe']['seconds']:.2f} s")
        for label in ("llama tied=False", "llama tied=True", "torchtitan", "torchtitan moe"):
            case = result[label]
            assert case["routes"] == case["expected"], (rank, label, case["routes"])
            assert case["dropped"], (rank, label)  # fully_shard dropped the attribute set before it
        assert result["by name"] == ("muon", "muon_include_params ('lm_head.weight')"), (rank, result["by name"])
        step = result["step"]
        assert step["ok"] and step["grad_norm"] > 0 and step["head_moved"], (rank, step)
