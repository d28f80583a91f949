"""MoE experts stored as one N-D tensor, under torch FSDP2 on 2 gloo ranks, equal one process.

Two models, each with 3 experts, so FSDP2's Shard(0) of the experts dimension gives rank 0 two
whole experts and rank 1 one:
- `transformers`' Qwen3MoeForCausalLM from a tiny config (no download): `mlp.experts.gate_up_proj`
  [E, 2F, H] (gate = first F rows) and `down_proj` [E, H, F]; each decoder layer and the root
  `fully_shard`ed, as AReaL and verl shard it; a real forward and backward on each rank (the same
  batch, so FSDP2's averaged gradient is the one process's).
- torchtitan's `GroupedExperts` (w1 and w3 [E, F, D], w2 [E, D, F]) under a toy root whose forward
  uses them through einsum (its grouped-mm kernel is bf16 and CUDA-minded), the root sharded.
- torchtitan's whole Qwen3 MoE model (tests/routing_models.py, 3 experts, 2 layers), each layer
  and the root sharded; its attention runs no backward on CPU, so both copies take the same
  synthetic gradients (`routing_models.synthetic_gradients`) instead of a forward and backward.
Reference: the same model unsharded in the same process, stepped by our optimizer. Muon, fp32,
muon_fp32_matmul_prec='highest', no weight decay, one step. Checked:
- every parameter's full tensor after the step within 1e-5 of the reference;
- every expert's update (gate and up apart) equals lr * sqrt(max(m, n)) times emerging_optimizers'
  plain Newton-Schulz of that expert's own gradient block (fails without per-expert batches:
  cosine ~0.6 then, and without the gate/up split);
- each rank orthogonalizes the experts it holds, one batched call per shape (rank 0's 2 experts'
  gate and up blocks in one (4, F, H) call), nothing of them sent;
- torchtitan's `shard_placement_fn`, Shard(1) for the experts (each rank holds rows of every
  expert: gate_up_proj's gate rows on rank 0, its up rows on rank 1): both models' parameters after
  2 Muon steps equal one process's within fp32 rounding (fails without the exchange that sends
  each expert's rows to its owner: rank-local Newton-Schulz of half an expert); and GroupedExperts
  saved after one step through `get_optimizer_state_dict` (flattened) and `dcp.save`, loaded into
  a fresh model and optimizer, steps on bitwise (its momentum is saved as Shard(1), each rank's
  rows of every expert at their offsets);
- one family per kind of fused or stacked layout (tests/zoo_models.py: torchtitan's fused wqkv,
  MLA and GPT-OSS experts, DBRX, Qwen3-Next's gated delta net, Mamba-2, GPT-2's Conv1D c_attn
  [in, out], whose stored rows Shard(0) splits, and params/zoo_layouts.py's kinds), the root sharded, one
  step with synthetic gradients: every parameter within 1e-5 of one process (each component along
  its own Newton-Schulz is test_zoo_layouts.py's check);
- placements the row exchange does not take, on the placed path (ops/placed_matrices.py), against
  one process after 2 steps: Shard(1) of transposed experts (GPT-OSS, [E, in, out]: each expert's
  columns split), every weight sharded along its last dimension;
- the refusal of experts on a 2-D mesh of their own beside a 1-D dense one (an EP x FSDP layout
  without the expert groups), one ValueError naming the parameter.
"""

import copy
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from emerging_optimizers.orthogonalized_optimizers import muon_utils

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh
from tests import routing_models, zoo_models
from tests.newton_schulz_calls import recording_newton_schulz_calls
from tests.refusals import error_of

pytest.importorskip("transformers")
pytest.importorskip("torchtitan")

LR = 0.1
TOLERANCE = 1e-5
CONFIG = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.0, clip_grad=0.0, muon_fp32_matmul_prec="highest")
EXPERTS, HIDDEN, FFN = 3, 32, 24


def _qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=FFN,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=EXPERTS, num_experts_per_tok=2)
    return Qwen3MoeForCausalLM(config).float()


class _TitanMoE(torch.nn.Module):
    """A router and torchtitan's GroupedExperts, combined without its CUDA-minded grouped mm."""

    def __init__(self) -> None:
        from torchtitan.models.common.moe import GroupedExperts

        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.moe = torch.nn.Module()
        self.moe.experts = GroupedExperts(GroupedExperts.Config(dim=HIDDEN, hidden_dim=FFN, num_experts=EXPERTS))
        for param in self.moe.experts.parameters():
            torch.nn.init.normal_(param, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.moe.experts
        weights = torch.softmax(self.router(x), dim=-1)
        hidden = F.silu(torch.einsum("bd,efd->bef", x, experts.w1_EFD)) * torch.einsum("bd,efd->bef", x, experts.w3_EFD)
        out = torch.einsum("bef,edf->bed", hidden, experts.w2_EDF)
        return (weights.unsqueeze(-1) * out).sum(1).sin().square().mean()


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch, labels=batch).loss if batch.dtype == torch.long else model(batch)


def _step(model: torch.nn.Module, batch: torch.Tensor, groups=None, config=CONFIG) -> tuple[dict, dict, list]:
    """(full gradients, full updates, Newton-Schulz call shapes) of one Muon step."""
    optimizer = get_megatron_optimizer(config, [model], pg_collection=groups)
    if batch is None:  # torchtitan's whole model: no backward on CPU through its attention
        routing_models.synthetic_gradients(model, seed=0)
    else:
        _loss(model, batch).backward()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    before = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
    gradients = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    with recording_newton_schulz_calls() as calls:
        optimizer.step()
    updates = {name: before[name] - full(p.detach()) for name, p in model.named_parameters()}
    return gradients, updates, calls


def _per_expert_errors(gradients: dict, updates: dict, blocks: dict) -> dict:
    """Largest relative error of each expert block's update against the plain Newton-Schulz of
    its own gradient block."""
    errors = {}
    for name, parts in blocks.items():
        for expert in range(EXPERTS):
            for index, rows in enumerate(parts):
                gradient = gradients[name][expert][rows]
                expected = LR * max(gradient.shape) ** 0.5 * muon_utils.newton_schulz(gradient, 5, "quintic")
                got = updates[name][expert][rows]
                errors[f"{name}[{expert}][{index}]"] = ((got - expected).abs().max() / expected.abs().max()).item()
    return errors


def _compare(build, batch: torch.Tensor, mesh, shard_layers, blocks: dict, experts_name: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = build()
    sharded = copy.deepcopy(reference)
    for module in shard_layers(sharded):
        fully_shard(module, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    _, expected, _ = _step(reference, batch, ParallelGroups.single_process())
    gradients, updates, calls = _step(sharded, batch)
    held = dict(sharded.named_parameters())[experts_name].to_local().shape[0]
    return {"errors": {name: (updates[name] - expected[name]).abs().max().item() for name in expected},
            "per_expert": _per_expert_errors(gradients, updates, blocks), "held": held, "calls": calls}


def _expert_rows(param: torch.Tensor):
    """torchtitan's shard_placement_fn when the FSDP degree exceeds the local experts."""
    from torch.distributed.tensor import Shard

    return Shard(1) if param.dim() == 3 else Shard(0)


def _two_steps(model: torch.nn.Module, batch: torch.Tensor, groups=None) -> dict:
    """Every parameter's full tensor after 2 Muon steps."""
    optimizer = get_megatron_optimizer(CONFIG, [model], pg_collection=groups)
    for _ in range(2):
        optimizer.zero_grad()
        _loss(model, batch).backward()
        optimizer.step()
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _compare_expert_rows(build, batch: torch.Tensor, mesh, shard_layers, experts_name: str,
                         placement_fn=_expert_rows) -> dict:
    """Experts placed Shard(1) (or as `placement_fn` says) against one process, after 2 steps."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = build()
    sharded = copy.deepcopy(reference)
    for module in [*shard_layers(sharded), sharded]:
        fully_shard(module, mesh=mesh, shard_placement_fn=placement_fn)
    expected = _two_steps(reference, batch, ParallelGroups.single_process())
    got = _two_steps(sharded, batch)
    held = dict(sharded.named_parameters())[experts_name]
    return {"errors": {name: (got[name] - expected[name]).abs().max().item() for name in expected},
            "held": tuple(held.to_local().shape), "placements": str(held.placements)}


def _last_dim(param: torch.Tensor):
    from torch.distributed.tensor import Shard

    return Shard(param.dim() - 1)


def _titan_expert_rows(mesh) -> tuple[torch.nn.Module, object]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _TitanMoE()
    fully_shard(model, mesh=mesh, shard_placement_fn=_expert_rows)
    return model, get_megatron_optimizer(CONFIG, [model])


def _resume_expert_rows(mesh, batch: torch.Tensor, directory: str) -> dict:
    """Save after one step (DCP, flattened optimizer state), load into a fresh pair, step both."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model, optimizer = _titan_expert_rows(mesh)

    def step(model, optimizer) -> dict:
        optimizer.zero_grad()
        _loss(model, batch).backward()
        optimizer.step()
        return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}

    step(model, optimizer)
    def state_of(model, optimizer) -> dict:
        return {"model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optimizer, options=flat)}

    dcp.save(state_of(model, optimizer), checkpoint_id=directory)
    straight = step(model, optimizer)
    model, optimizer = _titan_expert_rows(mesh)
    state = state_of(model, optimizer)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=flat)
    resumed = step(model, optimizer)
    return {"unequal": [name for name in straight if not torch.equal(straight[name], resumed[name])],
            "state": str(state["optimizer"]["state.moe.experts.w1_EFD.momentum_buffer"].placements)}


def _gpt_oss() -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
                          num_experts_per_tok=2, layer_types=["full_attention"])
    return GptOssForCausalLM(config).float()


def _refusals(mesh_1d) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    two_d = _TitanMoE()  # torchtitan's EP x FSDP: the experts on a 2-D mesh, the rest on the 1-D one
    fully_shard(two_d.moe.experts, mesh=init_device_mesh("cpu", (1, dist.get_world_size()),
                                                         mesh_dim_names=("ep", "efsdp")))
    fully_shard(two_d, mesh=mesh_1d)
    return {"2-D mesh": error_of(lambda: get_megatron_optimizer(CONFIG, [two_d]))}


# One family per kind of fused or stacked layout (tests/zoo_models.py): torchtitan's fused wqkv,
# its MLA (with GroupedExperts) and GPT-OSS's interleaved experts, DBRX's 2-D stacked experts and
# Wqkv, Qwen3-Next's gated delta net, Mamba-2's in_proj, GPT-2's Conv1D c_attn (stored [in, out]:
# Shard(0) splits the view's columns, so its owner gathers it whole before transposing), and
# params/zoo_layouts.py's kinds: vision qkv thirds and sizes, Flux's q/k/v/MLP linear1, gate/up
# halves, DeBERTa's per-head interleaved q/k/v, short-conv B/C/x thirds, DeepSeek-V4's per-head
# q_b_proj and per-group o_a_proj, fused weights under other names.
ZOO_KINDS = ("titan_llama3_fused_qkv", "titan_deepseek_v3_mla", "titan_gpt_oss_experts", "hf_dbrx_experts",
             "hf_qwen3_next_gated_delta_net", "hf_mamba2_in_proj", "hf_gpt2_c_attn", "hf_vision_qkv",
             "titan_flux_blocks", "hf_gated_mlps", "hf_deberta_in_proj", "hf_short_conv_in_proj",
             "hf_deepseek_v4_attention", "hf_fused_under_other_names")
# adaptive_muon's normuon on GPT-2's c_attn: its per-row mean of the [out, in] view is over the
# stored rows, which FSDP2 splits (a sum over the mesh).
NORMUON = dataclasses.replace(CONFIG, optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon")


def _zoo_errors(mesh) -> dict:
    """max |FSDP=2 - one process| over every parameter after one Muon step with synthetic
    gradients, the root sharded (each weight's rows split over the ranks, cutting its components)."""
    from torch.distributed.fsdp import fully_shard

    errors = {}
    for case, config in (*((case, CONFIG) for case in ZOO_KINDS), ("hf_gpt2_c_attn", NORMUON)):
        torch.manual_seed(0)
        reference = zoo_models.CASES[case]()[0].float()
        sharded = fully_shard(copy.deepcopy(reference), mesh=mesh)
        _, expected, _ = _step(reference, None, ParallelGroups.single_process(), config)
        _, got, _ = _step(sharded, None, config=config)
        errors[f"{case} {config.optimizer}"] = max((got[name] - expected[name]).abs().max().item() for name in expected)
    return errors


def _body(rank: int, world_size: int, directory: str) -> dict:
    torch.set_float32_matmul_precision("highest")
    mesh = data_parallel_mesh(dist.group.WORLD, torch.device("cpu"))
    torch.manual_seed(1)
    tokens, features = torch.randint(0, 64, (4, 8)), torch.randn(8, HIDDEN)
    qwen = _compare(_qwen3_moe, tokens, mesh, lambda m: list(m.model.layers),
                    {"model.layers.0.mlp.experts.gate_up_proj": [slice(0, FFN), slice(FFN, 2 * FFN)],
                     "model.layers.0.mlp.experts.down_proj": [slice(0, HIDDEN)]},
                    "model.layers.0.mlp.experts.gate_up_proj")
    titan = _compare(_TitanMoE, features, mesh, lambda m: [],
                     {f"moe.experts.{name}": [slice(None)] for name in ("w1_EFD", "w2_EDF", "w3_EFD")},
                     "moe.experts.w1_EFD")
    started = time.perf_counter()
    experts = "layers.{}.moe.routed_experts.inner_experts.{}"
    titan_model = _compare(lambda: routing_models.torchtitan_qwen3_moe(experts=EXPERTS), None, mesh,
                           lambda m: list(m.layers.values()),
                           {experts.format(layer, name): [slice(None)]
                            for layer in range(routing_models.LAYERS) for name in ("w1_EFD", "w2_EDF", "w3_EFD")},
                           experts.format(0, "w1_EFD"))
    titan_model["seconds"] = time.perf_counter() - started
    rows = {"qwen3_moe": _compare_expert_rows(_qwen3_moe, tokens, mesh, lambda m: list(m.model.layers),
                                              "model.layers.0.mlp.experts.gate_up_proj"),
            "torchtitan": _compare_expert_rows(_TitanMoE, features, mesh, lambda m: [],
                                               "moe.experts.w1_EFD"),
            # Placements the row exchange does not take, stepped on the placed path: Shard(1) of
            # experts stored [E, in, out] (each expert's columns), Shard of every weight's last dim.
            "transposed": _compare_expert_rows(_gpt_oss, tokens, mesh, lambda m: list(m.model.layers),
                                               "model.layers.0.mlp.experts.gate_up_proj"),
            "last_dim": _compare_expert_rows(_TitanMoE, features, mesh, lambda m: [], "router.weight",
                                             placement_fn=_last_dim)}
    rows["resumed"] = _resume_expert_rows(mesh, features, directory)
    return {"qwen3_moe": qwen, "torchtitan": titan, "torchtitan_qwen3_moe": titan_model, "expert_rows": rows,
            "refusals": _refusals(mesh), "zoo": _zoo_errors(mesh)}


def test_fsdp2_nd_experts_equal_one_process(run_distributed, tmp_path) -> None:
    per_rank = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout=600)
    for rank, results in enumerate(per_rank):
        print(f"rank {rank}: torchtitan Qwen3 MoE took {results['torchtitan_qwen3_moe']['seconds']:.2f} s")
        for model in ("qwen3_moe", "torchtitan", "torchtitan_qwen3_moe"):
            result = results[model]
            worst = max(result["errors"].values())
            print(f"{model} rank {rank}: max |FSDP=2 - one process| = {worst:.2e}")
            assert worst <= TOLERANCE, (model, rank, {n: e for n, e in result["errors"].items() if e > TOLERANCE})
            assert max(result["per_expert"].values()) <= 2e-5, (model, rank, result["per_expert"])
            assert result["held"] == (2, 1)[rank], (model, rank, result["held"])
        # Each rank its own experts, one batched call per shape: gate and up blocks [F, H] together.
        qwen_calls = results["qwen3_moe"]["calls"]
        assert ((2, 1)[rank] * 2, FFN, HIDDEN) in qwen_calls and ((2, 1)[rank], HIDDEN, FFN) in qwen_calls, \
            (rank, qwen_calls)
        # Shard(1): rows of every expert on each rank (gate_up_proj: 2F rows over 2 ranks).
        for model, held in (("qwen3_moe", (EXPERTS, FFN, HIDDEN)), ("torchtitan", (EXPERTS, FFN // 2, HIDDEN)),
                            ("transposed", (EXPERTS, HIDDEN // 2, 2 * FFN)), ("last_dim", (EXPERTS, HIDDEN // 2))):
            result = results["expert_rows"][model]
            worst = max(result["errors"].values())
            print(f"{model} Shard(1) experts rank {rank}: max |FSDP=2 - one process| after 2 steps = {worst:.2e}")
            assert result["held"] == held and "Shard(dim=1)" in result["placements"], (model, rank, result)
            assert worst <= TOLERANCE, (model, rank, {n: e for n, e in result["errors"].items() if e > TOLERANCE})
        resumed = results["expert_rows"]["resumed"]
        assert not resumed["unequal"] and "Shard(dim=1)" in resumed["state"], (rank, resumed)
        print(f"rank {rank}: fused and stacked layouts, max |FSDP=2 - one process| = {results['zoo']}")
        assert all(error <= TOLERANCE for error in results["zoo"].values()), (rank, {k: e for k, e in results["zoo"].items() if e > TOLERANCE})
        refusals = results["refusals"]
        kind, message = refusals["2-D mesh"]
        assert kind == "ValueError" and "moe.experts.w" in message and "expert process groups" in message, message
