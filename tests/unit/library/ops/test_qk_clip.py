"""QK-clip (MuonClip) inside the optimizer step, on megatron-core's GPTModel (CPU, gloo).

Reference: attention logits recomputed here with plain torch (float64) from each layer's
captured linear_qkv input and the weights after the step, never through the model's attention.
- exactness (lr=0, so only the clip changes weights): every clipped head's (GQA: group's) largest
  logit becomes tau to 1e-4 relative (measured 1.5e-7: eta^alpha * eta^(1-alpha) in fp32);
  unclipped heads, every v row and every other parameter are bitwise unchanged.
- TP=2 == TP=1 and layer-wise DP=2 == DP=1 with the clip active in every step (Muon, 4 steps),
  to 1e-6 absolute (measured 3.0e-7 and 2.4e-7; only reduction order differs: TP splits the
  matmuls, DP reduces the gradients and maxima).
- bf16 with fp32 main copies: the clipped main copy survives the next step.
"""

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.ops.qk_clip import QKVRows, clip_scales, group_max_logits, qkv_clip_rows, scale_clip_rows
from megatron_eopt.ops.row_shards import held_rows
from megatron_eopt.wrappers.qk_clip import QKClipSettings, find_attention_layers, resolve_qk_clip_settings
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)
from tests.gpt_training import local_shard, model_parallel, snapshot, token_batch, train_steps
from tests.thresholds import MARGIN, threshold_between

MHA = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=None,
                       ffn_hidden_size=48, vocab_size=64, seq_length=8, add_bias_linear=True)
GQA = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=64, seq_length=8)
SEED = 3
BOOST = 12.0  # q/k rows scaled up so that logits reach tens


def tokens(settings: GPTModelSettings, batch: int = 4, seed: int = 7) -> torch.Tensor:
    return token_batch(settings, batch, seed)


def qkv_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m.linear_qkv for m in model.modules() if hasattr(m, "linear_qkv")]


def boost_qk(model: torch.nn.Module, settings: GPTModelSettings, tp: int = 1) -> None:
    """Scale each head's q rows (and k rows) by a different factor so the heads' logits spread."""
    from megatron.core import parallel_state

    rows = rows_of(settings, tp)
    with torch.no_grad():
        for linear in qkv_modules(model):
            grouped = linear.weight.view(rows.groups, (rows.heads_per_group + 2) * rows.head_dim, -1)
            grouped[:, : (rows.heads_per_group + 1) * rows.head_dim] *= BOOST
            if parallel_state.get_tensor_model_parallel_rank() == 0:
                grouped[0] *= 2.0  # query group 0 of the whole model: larger logits


def rows_of(settings: GPTModelSettings, tp: int = 1) -> QKVRows:
    groups = settings.query_groups
    heads = settings.num_attention_heads
    return QKVRows("qkv", groups // tp, heads // groups, settings.hidden_size // heads)


def capture_qkv_inputs(model: torch.nn.Module) -> tuple[list[list[torch.Tensor]], list]:
    """Forward pre-hooks storing every linear_qkv input ([s, b, hidden]) per layer."""
    inputs: list[list[torch.Tensor]] = [[] for _ in qkv_modules(model)]
    handles = [m.register_forward_pre_hook(lambda _m, args, i=i: inputs[i].append(args[0].detach().clone()))
               for i, m in enumerate(qkv_modules(model))]
    return inputs, handles


def reference_head_max(x: torch.Tensor, weight: torch.Tensor, bias, rows: QKVRows) -> torch.Tensor:
    """Per-head max of causal q.k/sqrt(d), float64, from the linear_qkv input and weights."""
    x, weight = x.double(), weight.double()
    qkv = x @ weight.T + (0.0 if bias is None else bias.double())
    s, b = qkv.shape[:2]
    qkv = qkv.view(s, b, rows.groups, rows.heads_per_group + 2, rows.head_dim)
    q = qkv[:, :, :, : rows.heads_per_group]  # [s, b, g, hpg, d]
    k = qkv[:, :, :, rows.heads_per_group]  # [s, b, g, d]
    logits = torch.einsum("ibghd,jbgd->bghij", q, k) / math.sqrt(rows.head_dim)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal, -math.inf)
    return logits.amax(dim=(0, 3, 4)).reshape(rows.heads)


def model_head_max(model, inputs, rows: QKVRows) -> list[torch.Tensor]:
    """Per layer, the per-head maximum over every captured micro-batch."""
    result = []
    for linear, xs in zip(qkv_modules(model), inputs):
        bias = linear.bias if isinstance(linear.bias, torch.nn.Parameter) else None
        result.append(torch.stack([reference_head_max(x, linear.weight, bias, rows) for x in xs]).amax(0))
    return result


def qkv_parts(weight: torch.Tensor, rows: QKVRows) -> dict[str, torch.Tensor]:
    grouped = weight.detach().view(rows.groups, (rows.heads_per_group + 2) * rows.head_dim, -1)
    q_rows = rows.heads_per_group * rows.head_dim
    return {"q": grouped[:, :q_rows].clone(), "k": grouped[:, q_rows:q_rows + rows.head_dim].clone(),
            "v": grouped[:, q_rows + rows.head_dim:].clone()}


# ------------------------------------------------------------------------------------------------
# Pure math
# ------------------------------------------------------------------------------------------------


def test_clip_scales_follow_the_rule() -> None:
    group_max = torch.tensor([50.0, 200.0, -math.inf, float("nan"), 100.0])
    q, k = clip_scales(group_max, threshold=100.0, alpha=0.3)
    assert q.tolist()[0] == 1.0 and k.tolist()[0] == 1.0
    assert q[1].item() == pytest.approx(0.5 ** 0.3) and k[1].item() == pytest.approx(0.5 ** 0.7)
    assert q[2:].tolist() == [1.0, 1.0, 1.0] and k[2:].tolist() == [1.0, 1.0, 1.0]


def test_scale_qk_rows_touches_only_q_and_k_of_each_group() -> None:
    rows = QKVRows("w", groups=2, heads_per_group=2, head_dim=3)
    weight = torch.randn(rows.rows, 5)
    before = qkv_parts(weight, rows)
    scale_clip_rows(weight, qkv_clip_rows(rows), torch.tensor([0.5, 1.0]), torch.tensor([0.25, 1.0]))
    after = qkv_parts(weight, rows)
    assert torch.equal(after["q"][0], before["q"][0] * 0.5) and torch.equal(after["k"][0], before["k"][0] * 0.25)
    assert torch.equal(after["q"][1], before["q"][1]) and torch.equal(after["k"][1], before["k"][1])
    assert torch.equal(after["v"], before["v"])
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        group_max_logits(torch.zeros(3), rows)
    with pytest.raises(ValueError, match="rows on this tensor-parallel rank"):
        scale_clip_rows(torch.zeros(7, 5), qkv_clip_rows(rows), torch.ones(2), torch.ones(2))


def test_row_shards_scale_as_the_whole_weight() -> None:
    """Each rank scaling the rows it holds (cut inside query groups, one rank with none) gives
    the whole weight's result bitwise; a shard that does not match its rows is refused."""
    rows = qkv_clip_rows(QKVRows("w", groups=2, heads_per_group=2, head_dim=3))
    q_scale, k_scale = torch.tensor([0.5, 1.0], dtype=torch.float64), torch.tensor([0.3, 1.0], dtype=torch.float64)
    weight = torch.randn(rows.rows, 5)
    whole = weight.clone()
    scale_clip_rows(whole, rows, q_scale, k_scale)
    split = (7, 0, 10, 7)
    shards = [s.clone() for s in weight.split(split)]
    for rank, shard in enumerate(shards):
        scale_clip_rows(shard, rows, q_scale, k_scale, held=held_rows(split, rank))
    assert torch.equal(torch.cat(shards), whole)
    with pytest.raises(ValueError, match="its row shard: rows \\[7, 17\\) of the whole"):
        scale_clip_rows(torch.zeros(7, 5), rows, q_scale, k_scale, held=(7, 17))


def test_settings_from_either_config_and_disagreement_refused() -> None:
    class ModelConfig:  # megatron-core's TransformerConfig fields
        qk_clip, qk_clip_threshold, qk_clip_alpha, log_max_attention_logit = True, 30.0, 0.5, False

    merged = resolve_qk_clip_settings(OptimizerConfig(), [ModelConfig()])
    assert merged == QKClipSettings(qk_clip=True, qk_clip_threshold=30.0)
    assert resolve_qk_clip_settings(OptimizerConfig(qk_clip=True, qk_clip_threshold=30.0), [ModelConfig()]) == merged
    with pytest.raises(ValueError, match="qk_clip_threshold is 20.0 in the OptimizerConfig but 30.0"):
        resolve_qk_clip_settings(OptimizerConfig(qk_clip_threshold=20.0), [ModelConfig()])
    ModelConfig.qk_clip_alpha = 1.5
    with pytest.raises(ValueError, match="qk_clip_alpha must be in \\(0, 1\\)"):
        resolve_qk_clip_settings(OptimizerConfig(), [ModelConfig()])


class _FakeAttention(torch.nn.Module):
    """megatron-core's attribute names: core_attention, linear_qkv, config."""

    def __init__(self, core: torch.nn.Module, fused: bool = True, **config) -> None:
        super().__init__()
        self.config = type("Config", (), {"num_attention_heads": 2, "num_query_groups": 2, "kv_channels": 4,
                                          "hidden_size": 8, **config})()
        self.core_attention = core
        if fused:
            self.linear_qkv = torch.nn.Linear(8, 24, bias=False)
        else:
            self.linear_q_proj = torch.nn.Linear(8, 8, bias=False)


@pytest.mark.parametrize("attention, message", [
    (_FakeAttention(torch.nn.Identity()), "does not record the maximum attention logits"),
    (_FakeAttention(torch.nn.Identity(), fused=False), "no fused linear_qkv"),
    (_FakeAttention(torch.nn.Identity(), qk_layernorm=True), "qk_layernorm=True"),
], ids=["te-without-flags", "mla", "qk-layernorm"])
def test_unsupported_attention_is_refused_by_name(attention, message: str) -> None:
    model = torch.nn.ModuleDict({"attn": attention})
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message) as error:
        find_attention_layers([model], fqn_of, tp_size=1)
    assert "'attn'" in str(error.value)


def test_logging_alone_accepts_normalized_queries_and_keys() -> None:
    """Only the clip is undone by a query/key norm; the logits it records are still the logits."""
    core = torch.nn.Identity()
    core.record_max_attn_logits = False
    model = torch.nn.ModuleDict({"attn": _FakeAttention(core, qk_layernorm=True)})
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    (layer,) = find_attention_layers([model], fqn_of, tp_size=1, clips=False)
    assert layer.rows.heads == 2 and core.record_max_attn_logits


@pytest.mark.parametrize("field, bad", [("qk_clip_threshold", 0.0), ("qk_clip_threshold", math.inf),
                                        ("qk_clip_alpha", 0.0), ("qk_clip_alpha", 1.0)])
def test_config_rejects_bad_values(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=f"OptimizerConfig.{field}"):
        OptimizerConfig(**{field: bad})


# ------------------------------------------------------------------------------------------------
# On the GPT model (each body runs in the distributed harness's workers)
# ------------------------------------------------------------------------------------------------


def _exactness_body(rank: int, world_size: int, settings: GPTModelSettings, optimizer: str, alpha: float) -> dict:
    initialize_model_parallel(1, seed=SEED)
    try:
        model = build_gpt_model(settings)
        boost_qk(model, settings)
        rows = rows_of(settings)
        batch = tokens(settings)
        inputs, handles = capture_qkv_inputs(model)
        with torch.no_grad():
            gpt_loss(model, batch)  # captures the inputs, to choose tau
        before_max = model_head_max(model, inputs, rows)
        # between two query groups' maxima (a group clips as one): at least 2 clip, at least 1 does not
        group_max = torch.cat([m.view(rows.groups, -1).amax(1) for m in before_max])
        tau, margin = threshold_between(group_max, above=2, below=1)
        config = OptimizerConfig(optimizer=optimizer, lr=0.0, weight_decay=0.1, qk_clip=True,
                                 qk_clip_threshold=tau, qk_clip_alpha=alpha)
        opt = get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())
        model.eval()
        with torch.no_grad():  # an evaluation forward on another batch: must not be recorded
            gpt_loss(model, tokens(settings, batch=2, seed=99))
        model.train()
        for x in inputs:
            x.clear()
        before = snapshot(model)
        for micro in batch.chunk(2):  # two micro-batches: the maxima cover both
            gpt_loss(model, micro).backward()
        for handle in handles:
            handle.remove()
        before_max = model_head_max(model, inputs, rows)
        ok, _, _ = opt.step()
        after_max = model_head_max(model, inputs, rows)
        cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
        return {"ok": ok, "tau": tau, "margin": margin, "before_max": before_max, "after_max": after_max, "before": before,
                "after": snapshot(model), "logged": opt.max_attention_logit, "rows": rows,
                "reset": all(c.current_max_attn_logits is None for c in cores)}
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("settings, optimizer, alpha", [(MHA, "adam", 0.5), (GQA, "muon", 0.3)], ids=["mha-adam-bias", "gqa-muon"])
def test_clip_makes_largest_logit_tau_and_leaves_the_rest(run_distributed, settings, optimizer, alpha) -> None:
    result = run_distributed(_exactness_body, world_size=1, args=(settings, optimizer, alpha))[0]
    assert result["ok"] and result["reset"]
    assert result["margin"] > MARGIN, result["margin"]  # no group's maximum sits at tau
    tau, rows = result["tau"], result["rows"]
    all_before = torch.cat(result["before_max"])
    assert result["logged"] == pytest.approx(all_before.max().item(), rel=1e-5)  # our SDPA's maxima
    clipped_groups = 0
    for layer, (before_max, after_max) in enumerate(zip(result["before_max"], result["after_max"])):
        fqn = f"decoder.layers.{layer}.self_attention.linear_qkv"
        group_before = before_max.view(rows.groups, -1).amax(1)
        eta = torch.clamp(tau / group_before, max=1.0)
        for g in range(rows.groups):
            heads = slice(g * rows.heads_per_group, (g + 1) * rows.heads_per_group)
            if group_before[g] > tau:
                clipped_groups += 1
                group_after = after_max[heads].max().item()
                assert group_after == pytest.approx(tau, rel=1e-4), (layer, g)
                torch.testing.assert_close(after_max[heads], before_max[heads] * eta[g], rtol=1e-4, atol=0)
        w_before = qkv_parts(result["before"][f"{fqn}.weight"][0], rows)
        w_after = qkv_parts(result["after"][f"{fqn}.weight"][0], rows)
        assert torch.equal(w_before["v"], w_after["v"])
        unclipped = group_before <= tau
        assert torch.equal(w_before["q"][unclipped], w_after["q"][unclipped])
        assert torch.equal(w_before["k"][unclipped], w_after["k"][unclipped])
        assert not torch.equal(w_before["q"][~unclipped], w_after["q"][~unclipped])
    assert clipped_groups >= 2 and clipped_groups < len(torch.cat(result["before_max"])) // rows.heads_per_group
    for name, (value, _, _) in result["before"].items():
        if "linear_qkv" not in name:
            assert torch.equal(value, result["after"][name][0]), name


def _train(settings: GPTModelSettings, config: OptimizerConfig, tp: int, steps: int, slices: int,
           dp_group=None, pg_collection=None) -> dict:
    """`steps` steps on one global batch; this rank takes its DP slice (dp_group) or all `slices`."""
    from megatron.core import parallel_state

    with model_parallel(tp, seed=SEED):
        model = build_gpt_model(settings)
        boost_qk(model, settings, tp)
        opt = get_megatron_optimizer(config, [model], pg_collection=pg_collection)
        batch = tokens(settings, batch=8).chunk(slices)
        if dp_group is not None:
            batch = [batch[dist.get_rank(dp_group)]]
        maxima = []
        train_steps(model, opt, list(batch), steps, after_step=lambda step: maxima.append(opt.max_attention_logit))
        return {"params": snapshot(model), "maxima": maxima, "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


def _max_error(run: dict, reference: dict, tp: int) -> dict:
    return {name: (shard - local_shard(reference["params"][name][0], dim, stride, run["tp_rank"], tp)).abs().max().item()
            for name, (shard, dim, stride) in run["params"].items()}


def _tp_body(rank: int, world_size: int, config: OptimizerConfig) -> dict:
    reference = _train(GQA, config, tp=1, steps=4, slices=1)
    sharded = _train(GQA, config, tp=2, steps=4, slices=1)
    return {"errors": _max_error(sharded, reference, 2), "maxima": (reference["maxima"], sharded["maxima"])}


def _layer_wise_body(rank: int, world_size: int, config: OptimizerConfig) -> dict:
    reference = _train(GQA, config, tp=1, steps=4, slices=2, pg_collection=ParallelGroups.single_process())
    layer_wise = OptimizerConfig(**{**config.__dict__, "use_layer_wise_distributed_optimizer": True,
                                    "layer_wise_reduce_grads": True})
    dp_group = dist.new_group(list(range(world_size)))  # at TP=1 every rank is data-parallel
    run = _train(GQA, layer_wise, tp=1, steps=4, slices=2, dp_group=dp_group)
    return {"errors": _max_error(run, reference, 1), "maxima": (reference["maxima"], run["maxima"])}


# fp32 Newton-Schulz: the layouts are compared at fp32 round-off ('medium' runs it in bf16 where the
# machine multiplies bf16 natively, and bf16 round-off depends on the layout).
CLIPPED_MUON = OptimizerConfig(optimizer="muon", lr=0.01, weight_decay=0.01, clip_grad=1.0, qk_clip=True,
                               qk_clip_threshold=4.0, qk_clip_alpha=0.5, muon_fp32_matmul_prec="highest")


CLIPPED_TURBO_MUON = dataclasses.replace(CLIPPED_MUON, muon_aol_preconditioner=True)


@pytest.mark.parametrize("body", [_tp_body, _layer_wise_body], ids=["tp2-vs-tp1", "layer-wise-dp2-vs-dp1"])
def test_clip_does_not_depend_on_the_layout(run_distributed, body) -> None:
    """Muon and Turbo-Muon (the AOL preconditioner), clipping every step."""
    for config in (CLIPPED_MUON, CLIPPED_TURBO_MUON):
        for result in run_distributed(body, world_size=2, args=(config,)):
            reference, other = result["maxima"]
            assert all(m > config.qk_clip_threshold for m in reference), reference  # clipping every step
            assert other == pytest.approx(reference, rel=1e-6)
            bad = {name: e for name, e in result["errors"].items() if e > 1e-6}
            assert not bad, (config.muon_aol_preconditioner, bad)


def _bf16_body(rank: int, world_size: int) -> dict:
    settings = GPTModelSettings(**{**GQA.__dict__, "bf16": True})
    with model_parallel(1, seed=SEED):
        model = build_gpt_model(settings)
        boost_qk(model, settings)
        rows = rows_of(settings)
        config = OptimizerConfig(optimizer="adam", lr=0.0, bf16=True, qk_clip=True, qk_clip_threshold=4.0)
        opt = get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())
        inputs, _ = capture_qkv_inputs(model)
        steps = []
        train_steps(model, opt, tokens(settings), 2, after_step=lambda step: steps.append({
            "logged": opt.max_attention_logit,
            # this step's layer-0 logits recomputed from the weights after the step
            "after": model_head_max(model, [x[-1:] for x in inputs], rows)[0].max().item(),
            "weight": qkv_modules(model)[0].weight.detach().float().clone(),
        }))
        return {"steps": steps}


def test_bf16_clipped_main_copy_survives_the_next_step(run_distributed) -> None:
    first, second = run_distributed(_bf16_body, world_size=1)[0]["steps"]
    tau = 4.0
    assert first["logged"] > 2 * tau  # the first step clipped, by a factor > 2
    # Layer 0's inputs do not depend on any clip: its largest logit is tau up to bf16 rounding of
    # the clipped fp32 weights (~1e-2 relative).
    assert first["after"] == pytest.approx(tau, rel=2e-2)
    # The second step (lr=0) copies the fp32 main copies into the model again. Were they not
    # clipped, the weights and logits would be back at their unclipped size (> 2x).
    torch.testing.assert_close(second["weight"], first["weight"], rtol=2e-2, atol=1e-3)
    assert second["after"] <= tau * 1.02, second["after"]


def _off_and_errors_body(rank: int, world_size: int) -> dict:
    initialize_model_parallel(1, seed=SEED)
    errors = {}
    try:
        model = build_gpt_model(GQA)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model], pg_collection=ParallelGroups.single_process())
        gpt_loss(model, tokens(GQA)).backward()
        opt.step()
        cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
        off = {"qk_clip": opt.qk_clip, "recording": [c.record_max_attn_logits for c in cores],
               "maxima": [c.current_max_attn_logits for c in cores], "logged": opt.max_attention_logit}
        for name, chunk, config in (
            ("no_attention", torch.nn.Linear(4, 4), OptimizerConfig(lr=1e-3, qk_clip=True)),
            ("disagree", build_gpt_model(GPTModelSettings(**{**GQA.__dict__, "qk_clip": True, "qk_clip_threshold": 30.0})),
             OptimizerConfig(lr=1e-3, qk_clip_threshold=20.0)),
        ):
            try:
                get_megatron_optimizer(config, [chunk], pg_collection=ParallelGroups.single_process())
            except ValueError as error:
                errors[name] = str(error)
        from_model = build_gpt_model(GPTModelSettings(**{**GQA.__dict__, "log_max_attention_logit": True}))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [from_model], pg_collection=ParallelGroups.single_process())
        gpt_loss(from_model, tokens(GQA)).backward()
        opt.step()
        return {"off": off, "errors": errors, "from_model": (opt.qk_clip.settings, opt.max_attention_logit)}
    finally:
        destroy_model_parallel()


def test_off_by_default_settings_from_the_model_and_clear_errors(run_distributed) -> None:
    result = run_distributed(_off_and_errors_body, world_size=1)[0]
    assert result["off"] == {"qk_clip": None, "recording": [False, False], "maxima": [None, None], "logged": None}
    assert "no attention layer" in result["errors"]["no_attention"]
    assert "qk_clip_threshold is 20.0 in the OptimizerConfig but 30.0 in the model's TransformerConfig" in result["errors"]["disagree"]
    settings, logged = result["from_model"]
    assert settings == QKClipSettings(log_max_attention_logit=True) and logged > 0.0


def _host_syncs_body(rank: int, world_size: int) -> dict:
    from tests.unit.library.test_host_syncs import counted_read_backs, host_step_counters

    initialize_model_parallel(1, seed=SEED)
    try:
        model = build_gpt_model(GQA)
        boost_qk(model, GQA)
        config = OptimizerConfig(optimizer="muon", lr=1e-3, qk_clip=True, qk_clip_threshold=4.0)
        opt = get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())
        counts = None
        for step in range(2):  # the first creates the optimizer state
            opt.zero_grad()
            gpt_loss(model, tokens(GQA)).backward()
            with counted_read_backs(host_step_counters(opt)) if step else contextlib.nullcontext() as counted:
                ok = opt.step()[0]
            counts = dict(counted) if step else counts
            assert ok
        return {"counts": counts, "logged": opt.max_attention_logit}
    finally:
        destroy_model_parallel()


def test_clipping_step_reads_back_at_most_twice(run_distributed) -> None:
    """With clipping active every step, the step still waits for the device at most twice
    (tests/unit/library/test_host_syncs.py): the scales stay on the device, the logged maximum is read
    only when asked for."""
    from tests.unit.library.test_host_syncs import MAX_SYNCS_PER_STEP

    result = run_distributed(_host_syncs_body, world_size=1)[0]
    assert result["logged"] > 4.0  # the step clipped
    assert sum(result["counts"].values()) <= MAX_SYNCS_PER_STEP, result["counts"]
