"""muon_tp_mode='auto' and muon_expert_tp_mode through get_megatron_optimizer (CPU, gloo, 2 ranks).

A MoE GPT (4 experts, expert TP = TP) at TP=2 with the dense matrices on 'auto' ('h100' profile)
and the expert matrices on 'distributed' takes the same first step as TP=1 (DP=2) on every
tensor-parallel Muon matrix: each rank's shard within 1e-5 (fp32 'highest'; the matrices split
differently, so the round-off differs). One step without clipping: MoE at TP > 1 needs sequence
parallelism, whose norm and router gradients are partial until megatron-core's DDP finalizes
them (not used here), so later steps and a clipped norm would differ for that reason alone.
The param-group map dump names each Muon matrix's mode, equal to what the optimizer runs
(`muon_tp_modes`): the expert mode on expert matrices, exact modes elsewhere.
"""

import json
import os
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.factory import muon_tp_modes
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model
from tests.gpt_training import local_shard, model_parallel, snapshot, token_batch, train_steps

MOE = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       swiglu=True, vocab_size=64, seq_length=8, num_moe_experts=4, moe_router_topk=2)
CONFIG = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.05, muon_momentum=0.9, clip_grad=0.0,
                         muon_fp32_matmul_prec="highest", muon_tp_mode="auto", muon_expert_tp_mode="distributed",
                         muon_tp_hardware_profile="h100")
STEPS = 1


def _train(tp: int, dump: str) -> dict:
    from megatron.core import parallel_state

    with model_parallel(tp, seed=3):
        model = build_gpt_model(replace(MOE, sequence_parallel=tp > 1))  # MoE at TP > 1 needs it
        optimizer = get_megatron_optimizer(replace(CONFIG), [model], dump_param_to_param_group_map=dump)
        train_steps(model, optimizer, token_batch(MOE, batch=4, seed=9), STEPS)
        with open(os.path.join(dump, f"rank_{dist.get_rank():05d}.json")) as handle:
            dumped = json.load(handle)
        return {"params": snapshot(model), "modes": muon_tp_modes(optimizer), "dumped": dumped,
                "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


def _body(rank: int, world_size: int) -> dict:
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        reference, run = _train(1, one), _train(2, two)
    errors = {name: (shard - local_shard(reference["params"][name][0], dim, stride, run["tp_rank"], 2)).abs().max().item()
              for name, (shard, dim, stride) in run["params"].items() if name in run["modes"] and dim >= 0}
    return {"errors": errors, "modes": run["modes"], "dumped": run["dumped"]}


def test_auto_and_expert_modes_equal_tp1_and_are_dumped(run_distributed) -> None:
    results = run_distributed(_body, world_size=2, timeout=600)
    for result in results:
        bad = {name: e for name, e in result["errors"].items() if e > 1e-5}
        assert not bad, bad
        assert any(".experts." in name for name in result["errors"]), sorted(result["errors"])
        modes, dumped = result["modes"], result["dumped"]
        assert modes and modes == {name: entry["tp_mode"] for name, entry in dumped.items() if "tp_mode" in entry}
        experts = {name for name in modes if ".experts." in name}
        assert experts and all(modes[name] == "distributed" for name in experts)
        assert {modes[name] for name in set(modes) - experts} <= {"duplicated", "distributed", "sharded"}
        assert all(entry["optimizer"] == "muon" for name, entry in dumped.items() if name in modes)
    assert results[0]["modes"] == results[1]["modes"]


# Counted step against the model: a fused qkv (q/k/v per query group), a gated fc1, a
# row-parallel proj, a replicated matrix; every mode, and a mix. 'highest': fp32 on the wire.
def _layouts(size: int) -> dict:
    from megatron_eopt.ops.splits import MatrixLayout

    return {"qkv": MatrixLayout("qkv", (4 * 8 // size, 16), 0, size, 4 // size, (4, 2, 2)),
            "fc1": MatrixLayout("fc1", (2 * 24 // size, 16), 0, size, 1, (24 // size, 24 // size)),
            "proj": MatrixLayout("proj", (16, 32 // size), 1, size),
            "whole": MatrixLayout("whole", (12, 20))}


def _counted_body(rank: int, size: int, plans: list, gram: bool) -> list:
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_eopt.ops.muon_cost import rank_costs
    from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
    from tests.collective_counts import counting_collectives

    layouts = _layouts(size)
    out = []
    for plan in plans:
        params = [torch.nn.Parameter(torch.randn(layout.local_shape)) for layout in layouts.values()]
        optimizer = TensorParallelMuon([{"params": params, "param_fqns": list(layouts)}], fp32_matmul_prec="highest",
                                       gram_newton_schulz=gram, tp_group=dist.group.WORLD, layouts=layouts)
        optimizer.tp_modes = dict(zip(layouts, plan))  # what 'auto' sets: one mode per matrix
        for param in params:
            param.grad = torch.randn_like(param)
        with counting_collectives(rank, size) as counts, FlopCounterMode(display=False) as flops:
            optimizer.step()
        model = rank_costs(list(layouts.values()), plan, size, rank, optimizer.settings, "highest")
        out.append(((flops.get_total_flops(), counts["bytes_sent"], counts["calls"]),
                    (model.flops, model.bytes_sent, model.collectives)))
    return out


def test_cost_model_equals_a_counted_step(run_distributed) -> None:
    plans = [[mode] * 4 for mode in ("duplicated", "distributed", "sharded")]
    plans.append(["distributed", "sharded", "duplicated", "sharded"])
    for size in (2, 4):
        for gram in (False, True):
            for per_plan in run_distributed(_counted_body, world_size=size, args=(plans, gram)):
                for plan, (counted, model) in zip(plans, per_plan):
                    assert counted[0] == model[0], (size, gram, plan, "flops", counted, model)
                    assert abs(counted[1] - model[1]) < 1e-6, (size, gram, plan, "bytes", counted, model)
                    assert counted[2] == model[2], (size, gram, plan, "collectives", counted, model)
