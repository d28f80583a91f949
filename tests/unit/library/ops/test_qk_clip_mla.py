"""QK-clip on multi-latent attention (Kimi K2's MuonClip), at TP=2 on megatron-core's MLA.

Reference: each head's logits recomputed here in float64 from the query and key that enter the
core attention (captured by a forward hook), times MLA's softmax scale, causal: never the
attention's own record. With lr 0 only the clip changes weights. After one step every head's
largest logit is at most tau; a clipped head's is tau to 1e-4 relative, because Kimi K2's rule
multiplies every part of its logits by eta (query and key rows by eta^alpha and eta^(1 - alpha),
the rotary query by eta, the shared rotary key not at all); the value rows, linear_kv_down_proj
and the unclipped heads are bitwise unchanged. MLA's latent norms (--qk-layernorm) come before the
up-projections and do not undo the clip.
"""

import dataclasses

import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from tests.fused_models import GPT, HEADS, POS, QK, V
from tests.thresholds import MARGIN, threshold_between

# One layer: its attention's input (the embeddings) does not change with the clip, so the logits
# after the step come from the same input as the maxima the clip used.
SETTINGS = dataclasses.replace(GPT, num_layers=1, num_moe_experts=None, moe_layer_freq=1, qk_layernorm=True)
BOOST = 6.0
SEEDS = (5, 6)  # model seeds; the tokens' seed is the model's + 4


def _head_max_logits(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, each local head's largest causal logit, float64, from the captured q and k."""
    from megatron_eopt.training.model.gpt import gpt_loss

    captured, handles = [], []
    for layer in model.decoder.layers:
        attention = layer.self_attention

        def hook(module, args, scale=attention.softmax_scale):
            query, key = args[0].double(), args[1].double()  # [s, b, heads, d]
            scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
            allowed = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            captured.append(scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))

        handles.append(attention.core_attention.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            gpt_loss(model, tokens)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _mla_clip_body(rank: int, world_size: int) -> list[dict]:
    return [_mla_clip_run(seed) for seed in SEEDS]


def _mla_clip_run(seed: int) -> dict:
    from megatron.core import parallel_state

    from megatron_eopt.training.model.gpt import build_gpt_model, destroy_model_parallel, gpt_loss, initialize_model_parallel

    initialize_model_parallel(2, seed=seed)
    try:
        torch.set_float32_matmul_precision("highest")
        model = build_gpt_model(SETTINGS)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():  # spread the heads' logits: this rank's first head larger on rank 0
            for layer in model.decoder.layers:
                attention = layer.self_attention
                attention.linear_q_up_proj.weight.mul_(BOOST)
                attention.linear_kv_up_proj.weight.view(HEADS // 2, QK + V, -1)[:, :QK].mul_(BOOST)
                if tp_rank == 0:
                    attention.linear_q_up_proj.weight.view(HEADS // 2, QK + POS, -1)[0].mul_(2.0)
        tokens = torch.randint(0, SETTINGS.vocab_size, (2, SETTINGS.seq_length + 1),
                               generator=torch.Generator().manual_seed(seed + 4))
        before = _head_max_logits(model, tokens)
        # tau from all heads' maxima over both ranks, the same on both, between two of them
        local = torch.cat(before)
        gathered = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(gathered, local)
        tau, margin = threshold_between(torch.cat(gathered))  # some heads clipped, some not
        config = OptimizerConfig(optimizer="muon", lr=0.0, min_lr=0.0, weight_decay=0.0, qk_clip=True,
                                 qk_clip_threshold=tau, qk_clip_alpha=0.5, muon_fp32_matmul_prec="highest")
        optimizer = get_megatron_optimizer(config, [model])
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.train()
        optimizer.zero_grad()
        gpt_loss(model, tokens).backward()
        ok, _, _ = optimizer.step()
        after = _head_max_logits(model, tokens)
        changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach(), weights[n]))
        values_kept = all(torch.equal(layer.self_attention.linear_kv_up_proj.weight.view(HEADS // 2, QK + V, -1)[:, QK:],
                                      weights[f"decoder.layers.{i}.self_attention.linear_kv_up_proj.weight"]
                                      .view(HEADS // 2, QK + V, -1)[:, QK:])
                          for i, layer in enumerate(model.decoder.layers))
        return {"seed": seed, "ok": ok, "tau": tau, "margin": margin, "before": before, "after": after, "changed": changed,
                "values_kept": values_kept}
    finally:
        destroy_model_parallel()


def test_mla_qk_clip_keeps_every_head_at_or_below_tau_at_tp2(run_distributed) -> None:
    clipped_heads = {seed: 0 for seed in SEEDS}
    kept_heads = {seed: 0 for seed in SEEDS}
    for result in (run for rank in run_distributed(_mla_clip_body, world_size=2, timeout=600) for run in rank):
        assert result["ok"]
        assert result["margin"] > MARGIN, result  # no head's maximum sits at tau
        tau, seed, clipped_here = result["tau"], result["seed"], 0
        for before, after in zip(result["before"], result["after"]):
            for old, new in zip(before.tolist(), after.tolist()):
                if old > tau:
                    clipped_heads[seed] += 1
                    clipped_here += 1
                    assert abs(new - tau) <= 1e-4 * tau, (old, new, tau)
                else:
                    kept_heads[seed] += 1
                    assert new == old, (old, new, tau)  # an unclipped head: its weights bitwise unchanged
        assert result["values_kept"]
        assert bool(result["changed"]) == (clipped_here > 0), (result["changed"], clipped_here)  # a rank clips its own heads
        assert all("linear_q_up_proj" in n or "linear_kv_up_proj" in n for n in result["changed"])
    assert min(clipped_heads.values()) >= 1 and min(kept_heads.values()) >= 1, (clipped_heads, kept_heads)
