"""QK-clip on row-sharded models: torch FSDP2 (`fully_shard`) and Megatron-FSDP (ZeRO-3), FSDP=3.

Reference: our unsharded get_megatron_optimizer with the same QK-clip (tests/unit/library/ops/
test_qk_clip*.py check it against logits recomputed in float64) on an unsharded copy of the same
megatron-core GPT, in each rank's process, stepped with the mean of the three ranks' micro-batch
gradients, as the engines reduce them. Two attentions, one layer each: GQA (8 heads in 4 query
groups, a fused linear_qkv) and MLA (4 heads; linear_q_up_proj, linear_kv_up_proj), their q/k rows
boosted so that tau lies between the query groups' (MLA: heads') largest logits.

Muon (fp32 Newton-Schulz, matmuls at 'highest') takes 1 step at lr 0, which only clips, then 2 at
lr 0.02 (at least one of them clipping after its update). After them every parameter equals the
reference within 1e-5 (fp32 round-off: the gradients are summed in another order; measured up to
6e-7), and each step's largest logit (the optimizer's record, MAX-reduced over the mesh) within
1e-5 relative (measured 9e-8). After the lr-0 step, the logits recomputed here in float64 from
the q and k entering the core attention (an evaluation forward of the sharded model on each rank's
micro-batch; one layer, so its input did not change) are <= tau on every head: each clipped query
group's (MLA: head's) largest is tau to 1e-4 relative (the rule scales its logits by eta exactly;
measured 1e-7, the fp32 rounding of the weights), the others are as before to 1e-6.

The splits are the engines' own, checked here: torch.chunk's at 3 ranks, Megatron-FSDP's bucket
split (which also leaves a rank without rows of linear_qkv). Some rank's rows of each model's
clipped weights start inside a query group or head, so a scale that misses a rank's rows, or
lands on the wrong rows, fails both checks.
"""

import dataclasses
import time

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.runtime.process_groups import ParallelGroups
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)
from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh
from tests.fused_models import GPT as MLA_GPT
from tests.fused_models import HEADS as MLA_HEADS
from tests.fused_models import POS, QK, V
from tests.thresholds import MARGIN, threshold_between

WORLD_SIZE = 3
GROUPS, HEAD_DIM = 4, 4  # GQA: 8 heads of 4 in 4 query groups
GQA = GPTModelSettings(num_layers=1, hidden_size=32, num_attention_heads=8, num_query_groups=GROUPS,
                       ffn_hidden_size=48, vocab_size=64, seq_length=8)
# ffn_hidden_size 16: Megatron-FSDP's buckets then cut linear_q_up_proj inside a head.
MLA = dataclasses.replace(MLA_GPT, num_layers=1, num_moe_experts=None, moe_layer_freq=1, qk_layernorm=True,
                          ffn_hidden_size=16)
MODELS = {"gqa": GQA, "mla": MLA}
ENGINES = ("torch FSDP2", "Megatron-FSDP")
# Rows of one clip unit: a GQA query group (2 q heads, k, v), an MLA head of each projection.
UNIT_ROWS = {"linear_qkv.weight": (2 + 2) * HEAD_DIM, "linear_q_up_proj.weight": QK + POS,
             "linear_kv_up_proj.weight": QK + V}
BOOST = 6.0
LEARNING_RATES = (0.0, 0.02, 0.02)  # the first step only clips: its logits are checked against tau
TOLERANCE = 1e-5
SEED = 11


def _build(settings: GPTModelSettings) -> torch.nn.Module:
    """The GPT, the same on every call and rank, its q/k rows boosted (query group or head 0 most)."""
    initialize_model_parallel(1, seed=SEED)
    try:
        model = build_gpt_model(settings)
    finally:
        destroy_model_parallel()
    attention = model.decoder.layers[0].self_attention
    with torch.no_grad():
        if settings.multi_latent_attention:
            attention.linear_q_up_proj.weight.mul_(BOOST)
            attention.linear_q_up_proj.weight.view(MLA_HEADS, QK + POS, -1)[0].mul_(2.0)
            attention.linear_kv_up_proj.weight.view(MLA_HEADS, QK + V, -1)[:, :QK].mul_(BOOST)
        else:
            groups = attention.linear_qkv.weight.view(GROUPS, UNIT_ROWS["linear_qkv.weight"], -1)
            groups[:, :(2 + 1) * HEAD_DIM].mul_(BOOST)  # q and k rows of every group
            groups[0].mul_(2.0)
    return model


def _sharded(settings: GPTModelSettings, engine: str) -> torch.nn.Module:
    model = _build(settings)
    if engine == "Megatron-FSDP":
        from megatron_eopt.training.parallel import megatron_fsdp

        return megatron_fsdp.megatron_fsdp_gpt(model, torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    mesh = data_parallel_mesh(dist.group.WORLD, torch.device("cpu"))
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(param: torch.Tensor, engine: str) -> torch.Tensor:
    """The whole tensor from the shards (test side only); Megatron-FSDP's by its uneven all_gather."""
    if engine == "torch FSDP2":
        return param.full_tensor().detach()
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    return uneven_dtensor_to_full_tensor(param).detach()


def _unit_max_logits(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    """Each clip unit's (query group's; MLA: head's) largest causal logit over `batches`, float64,
    from the query and key entering the core attention (a forward pre-hook), not its record."""
    captured = []

    def hook(module, args):
        query, key = args[0].double(), args[1].double()  # [s, b, heads | groups, d]
        key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)  # GQA: a group's key per head
        scores = torch.einsum("sbhd,tbhd->bhst", query, key)
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        per_head = (scores * module.softmax_scale).masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
        captured.append(per_head.view(args[1].shape[2], -1).amax(dim=1))

    core = next(m.core_attention for m in model.modules() if hasattr(m, "core_attention"))
    handle = core.register_forward_pre_hook(hook)
    model.eval()  # an evaluation forward: the core attention does not record it for the next step
    try:
        with torch.no_grad():
            for batch in batches:
                gpt_loss(model, batch)
    finally:
        handle.remove()
        model.train()
    return torch.stack(captured).amax(dim=0)


def _case(settings: GPTModelSettings, engine: str, rank: int) -> dict:
    """The steps of the sharded model and of the reference; what the test compares."""
    torch.set_float32_matmul_precision("highest")
    reference, sharded = _build(settings), _sharded(settings, engine)
    before = _unit_max_logits(reference, _micro_batches(0, settings))
    tau, margin = threshold_between(before, above=3, below=1)  # 3 of the 4 units clip, on every rank
    config = OptimizerConfig(optimizer="muon", lr=0.02, min_lr=0.0, weight_decay=0.05, muon_momentum=0.9,
                             muon_fp32_matmul_prec="highest", qk_clip=True, qk_clip_threshold=tau, qk_clip_alpha=0.5)
    reference_opt = get_megatron_optimizer(config, [reference], pg_collection=ParallelGroups.single_process())
    sharded_opt = get_megatron_optimizer(config, [sharded])  # the mesh's group from the parameters
    logged, after = [], None
    for step, lr in enumerate(LEARNING_RATES):
        batches = _micro_batches(step, settings)
        for optimizer in (reference_opt, sharded_opt):
            for group in optimizer.param_groups:
                group["lr"] = lr
        _step_both(reference, reference_opt, sharded, sharded_opt, batches[rank], batches, engine)
        logged.append((reference_opt.max_attention_logit, sharded_opt.max_attention_logit))
        if step == 0:  # lr 0: only the clip changed the weights
            after = _unit_max_logits(sharded, [batches[rank]])
            dist.all_reduce(after, op=dist.ReduceOp.MAX)  # the units' maxima over every rank's micro-batch
    full = dict(reference.named_parameters())
    errors = {n: (_full(p, engine) - full[n.removeprefix("module.")]).abs().max().item()
              for n, p in sharded.named_parameters()}
    local_rows = {n.removeprefix("module."): p.to_local().shape[0] for n, p in sharded.named_parameters()}
    return {"tau": tau, "margin": margin, "logged": logged, "before": before, "after": after, "errors": errors,
            "local_rows": local_rows}


def _micro_batches(step: int, settings: GPTModelSettings) -> list[torch.Tensor]:
    """Every rank's micro-batch of `step`."""
    return [torch.randint(0, settings.vocab_size, (2, settings.seq_length + 1),
                          generator=torch.Generator().manual_seed(100 * step + rank)) for rank in range(WORLD_SIZE)]


def _step_both(reference, reference_opt, sharded, sharded_opt, own_batch, batches, engine: str) -> None:
    """One step of each: the reference with the mean gradient of all micro-batches, the sharded
    model with its own, which the engine's reduce-scatter averages."""
    reference.zero_grad()
    for batch in batches:
        (gpt_loss(reference, batch) / len(batches)).backward()
    assert reference_opt.step()[0]
    gpt_loss(sharded, own_batch).backward()
    if engine == "Megatron-FSDP":
        sharded.finish_grad_sync()  # its protocol: attaches the .grad shards
    assert sharded_opt.step()[0]
    if engine == "Megatron-FSDP":
        sharded.install_optimized_model_weights()
        sharded.zero_grad_buffer()
    else:
        sharded.zero_grad()


def _body(rank: int, world_size: int) -> dict:
    return {(engine, name): _case(settings, engine, rank) for engine in ENGINES for name, settings in MODELS.items()}


def _cuts_inside_clipped_units(per_rank: list[dict]) -> list[str]:
    """The clipped weights whose row split starts a rank's rows inside a clipped query group or head."""
    clipped = (per_rank[0]["before"] > per_rank[0]["tau"]).tolist()
    cuts = []
    for name, unit_rows in ((n, u) for n in per_rank[0]["local_rows"] for suffix, u in UNIT_ROWS.items()
                            if n.endswith(suffix)):
        split = [run["local_rows"][name] for run in per_rank]
        firsts = [sum(split[:rank]) for rank in range(1, len(split)) if split[rank]]
        if any(first % unit_rows and clipped[first // unit_rows] for first in firsts):
            cuts.append(f"{name} {tuple(split)}")
    return cuts


def test_qk_clip_on_row_shards_equals_one_process_and_keeps_every_head_at_or_below_tau(run_distributed) -> None:
    start = time.perf_counter()
    replies = run_distributed(_body, world_size=WORLD_SIZE, timeout=600)
    print(f"QK-clip at FSDP={WORLD_SIZE}, 2 engines x (GQA, MLA): {time.perf_counter() - start:.1f} s")
    for case in replies[0]:
        per_rank = [reply[case] for reply in replies]
        cuts = _cuts_inside_clipped_units(per_rank)
        assert cuts, (case, per_rank[0]["local_rows"])
        for rank, run in enumerate(per_rank):
            _check_run(run, (case, rank))
            clipped = run["before"] > run["tau"]
            print(case, rank, cuts, "parameters:", max(run["errors"].values()), "logged maxima (relative):",
                  max(abs(got - expected) / expected for expected, got in run["logged"]), "clipped heads at tau "
                  "(relative):", (run["after"][clipped] / run["tau"] - 1).abs().max().item())


def _check_run(run: dict, label) -> None:
    tau, before, after = run["tau"], run["before"], run["after"]
    bad = {name: error for name, error in run["errors"].items() if not error <= TOLERANCE}
    assert not bad, (label, bad)
    for expected, got in run["logged"]:
        assert abs(got - expected) <= 1e-5 * expected, (label, run["logged"])
    assert run["logged"][0][0] > tau, (label, run["logged"], tau)  # the lr-0 step clipped
    assert any(expected > tau * (1 + MARGIN) for expected, _ in run["logged"][1:]), (label, run["logged"], tau)
    clipped = before > tau
    assert run["margin"] > MARGIN and clipped.any() and not clipped.all(), (label, before, tau)
    assert (after <= tau * (1 + 1e-4)).all(), (label, after, tau)
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-4, atol=0)
    torch.testing.assert_close(after[~clipped], before[~clipped], rtol=1e-6, atol=0)
