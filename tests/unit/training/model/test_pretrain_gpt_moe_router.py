"""Megatron-LM's MoE router and expert flags in scripts/pretrain_gpt.py (megatron_eopt/training/arguments/moe.py).

References, none produced by the code under test:
- the routing of a model our builder made, recomputed by hand in plain torch from the router's
  logits: sigmoid scores plus the expert bias, group-limited top-k, the top-k scaling factor,
  the z-loss (coeff x mean logsumexp(logits)^2, its value and its gradient on the router's
  weight), the switch load-balancing loss, the expert-bias update (sign and size) and token
  dropping by capacity;
- layouts against each other: one command line with most of the new flags (dense and MoE layers
  by --moe-layer-freq, shared experts with a gate, sigmoid group-limited routing, z-loss,
  aux_loss + seq_aux_loss, expert bias, capacity) at 1 process against EP=2, PP=2 (a stage whose
  layers start at global number 3) and TP=2 with sequence parallelism, losses and logged MoE
  losses to 1e-5 relative, grad norms to 1e-4;
- the flags against megatron-core's TransformerConfig fields of the built model;
- the --moe-layer-freq parser against the lists Megatron-LM's documented expressions mean.
"""

import math

import pytest
import torch

from tests.pretrain_gpt_in_process import run_pretrain_gpt

# Hand computations -------------------------------------------------------------------------------

HIDDEN, EXPERTS, TOPK, GROUPS, SCALE, Z_COEFF, AUX_COEFF, RATE = 32, 4, 2, 2, 2.5, 1e-3, 0.1, 0.01


def _routing_checks(rank: int, world_size: int) -> dict:
    """Build a 2-layer model (layer 1 dense, layer 2 MoE), run its router once by hand and once
    for real; return what the test compares."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, initialize_model_parallel
    from megatron_eopt.training.model.moe import finish_router_step, start_step

    initialize_model_parallel(1, seed=5)
    try:
        model = build_gpt_model(GPTModelSettings(
            num_layers=2, hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_layer_freq=(0, 1),
            moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True,
            moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=SCALE, moe_router_num_groups=GROUPS,
            moe_router_group_topk=1, moe_z_loss_coeff=Z_COEFF, moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=RATE, moe_router_load_balancing_type=("aux_loss", "global_aux_loss"),
            moe_aux_loss_coeff=(AUX_COEFF, AUX_COEFF)))
        layers = model.decoder.layers
        result = {"mlp_types": [type(layer.mlp).__name__ for layer in layers]}
        moe = layers[1].mlp
        router = moe.router
        result["shapes"] = {"expert_fc1": tuple(moe.experts.local_experts[0].linear_fc1.weight.shape),
                            "shared_fc1": tuple(moe.shared_experts.linear_fc1.weight.shape),
                            "shared_gate": tuple(moe.shared_experts.gate_weight.shape)}
        router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
        x = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(1))
        weights = torch.randn(8 * 2, EXPERTS, generator=torch.Generator().manual_seed(2))
        start_step(torch.ones(()), num_micro_batches=1)
        probs, routing_map = router(x)
        (probs * weights).sum().backward()
        result.update(_by_hand(x, router.weight.detach(), router.expert_bias.clone(), weights))
        result.update(probs=probs.detach(), routing_map=routing_map, weight_grad=router.weight.grad.clone(),
                      tokens_per_expert=router.local_tokens_per_expert.clone(), bias_before=router.expert_bias.clone())
        metrics = get_moe_metrics_tracker().metrics
        result.update({name: metrics[name].values[1].item() for name in
                       ("z_loss", "load_balancing_loss", "global_load_balancing_loss")})
        finish_router_step([model])
        result.update(bias_after=router.expert_bias.clone(), tokens_after=router.local_tokens_per_expert.clone(),
                      ga_steps_after=router.ga_steps.item())
        return result
    finally:
        destroy_model_parallel()


def _by_hand(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor) -> dict:
    """DeepSeek-V3-style routing written out: sigmoid scores; experts chosen by score + bias,
    only within the best group (scored by its top TOPK // 1 biased scores); probabilities the
    chosen unbiased scores normalised and scaled; plus the z-loss and the aux losses. Gradient of
    the same objective as the real run (probs x weights, the losses with gradient scale 1)."""
    weight = weight.clone().requires_grad_(True)
    logits = x.reshape(-1, HIDDEN) @ weight.t()
    scores = torch.sigmoid(logits)
    biased = (scores + bias).detach()
    per_group = biased.view(-1, GROUPS, EXPERTS // GROUPS)
    best_group = per_group.topk(TOPK, dim=-1).values.sum(-1).argmax(-1)
    allowed = torch.zeros_like(biased, dtype=torch.bool).view(-1, GROUPS, EXPERTS // GROUPS)
    allowed[torch.arange(len(best_group)), best_group] = True
    chosen = biased.masked_fill(~allowed.view(-1, EXPERTS), -math.inf).topk(TOPK, dim=-1).indices
    routing_map = torch.zeros_like(biased, dtype=torch.bool).scatter(1, chosen, True)
    picked = scores * routing_map
    probs = picked / picked.sum(-1, keepdim=True) * SCALE
    z_loss = torch.logsumexp(logits, dim=-1).square().mean()
    # The switch loss megatron adds (and logs unscaled): over all-expert normalised sigmoid
    # scores, tokens counted by their unbiased, ungrouped top-k; the global aux loss of one
    # micro-batch in one process counts the same tokens, so it is the same loss again.
    aux_scores = scores / scores.sum(-1, keepdim=True)
    aux_map = torch.zeros_like(routing_map).scatter(1, aux_scores.detach().topk(TOPK, dim=-1).indices, True)
    switch = EXPERTS / (TOPK * logits.shape[0] ** 2) * (aux_scores.sum(0) * aux_map.sum(0)).sum()
    ((probs * weights).sum() + Z_COEFF * z_loss + 2 * AUX_COEFF * switch).backward()
    return dict(hand_probs=probs.detach(), hand_map=routing_map, hand_grad=weight.grad,
                hand_z_loss=z_loss.item(), hand_switch=switch.item())


def test_router_flags_route_as_computed_by_hand(run_distributed) -> None:
    ((result,),) = [run_distributed(_routing_checks, 1)]
    assert result["mlp_types"] == ["MLP", "CPUMoELayer"]  # --moe-layer-freq [0,1]
    # SwiGLU fc1 holds gate and up rows: 2 x --moe-ffn-hidden-size, 2 x the shared size.
    assert result["shapes"] == {"expert_fc1": (96, HIDDEN), "shared_fc1": (80, HIDDEN), "shared_gate": (1, HIDDEN)}
    assert torch.equal(result["routing_map"], result["hand_map"])
    torch.testing.assert_close(result["probs"], result["hand_probs"], rtol=1e-6, atol=1e-7)
    # The z-loss and aux losses reach the router's weight with the same gradient scale as the LM loss.
    torch.testing.assert_close(result["weight_grad"], result["hand_grad"], rtol=1e-5, atol=1e-8)
    assert result["z_loss"] == pytest.approx(result["hand_z_loss"], rel=1e-6)
    # One micro-batch in one process: the global aux loss sees the same tokens as the aux loss.
    assert result["load_balancing_loss"] == pytest.approx(result["hand_switch"], rel=1e-6)
    assert result["global_load_balancing_loss"] == pytest.approx(result["hand_switch"], rel=1e-6)
    # Expert bias: experts under the mean load move up by the rate, over it down; counts reset.
    counts = result["hand_map"].sum(0).float()
    assert torch.equal(result["tokens_per_expert"], counts)
    expected = result["bias_before"] + RATE * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(result["bias_after"], expected)
    assert not torch.equal(result["bias_after"], result["bias_before"])
    assert result["tokens_after"].abs().sum() == 0 and result["ga_steps_after"] == 0


def _capacity_checks(rank: int, world_size: int, policy: str, pad: bool) -> dict:
    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(1, seed=5)
    try:
        model = build_gpt_model(GPTModelSettings(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                                                 moe_router_topk=TOPK, moe_expert_capacity_factor=1.0,
                                                 moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad))
        router = model.decoder.layers[0].mlp.router
        x = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            probs, routing_map = router(x)
            logits = x.reshape(-1, HIDDEN) @ router.weight.t()
        return dict(probs=probs, routing_map=routing_map, logits=logits)
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("policy,pad", [("probs", False), ("probs", True)], ids=["drop", "pad"])
def test_capacity_drops_the_lowest_probabilities(policy, pad, run_distributed) -> None:
    """Capacity = ceil(tokens x topk / experts x factor) = 8 of 16 tokens; each expert keeps its
    8 highest routing probabilities (softmax over the top-2 logits), the others are dropped
    (padded: every expert takes exactly 8 rows, zero-weight ones included)."""
    ((result,),) = [run_distributed(_capacity_checks, 1, args=(policy, pad))]
    logits = result["logits"]
    top = logits.topk(TOPK, dim=-1)
    dense = torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(0, dense.topk(8, dim=0).indices, True)
    expected_map = keep if pad else keep & (dense > 0)
    assert torch.equal(result["routing_map"], expected_map)
    torch.testing.assert_close(result["probs"], dense * expected_map)
    assert int((dense > 0).sum()) > int((dense * keep > 0).sum())  # something was dropped


# Layouts -----------------------------------------------------------------------------------------

ITERATIONS = 6
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--lr", "1e-2",
        "--log-interval", "1", "--eval-iters", "0", "--disable-bias-linear", "--optimizer", "adam", "--swiglu",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([1]*1+[0]*1+[1]*2)",
        "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
        "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-dtype", "fp64",
        "--moe-z-loss-coeff", "1e-2", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
        "--moe-aux-loss-coeff", "0.1", "0.05", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs"]
LOGGED = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def _series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def _assert_same(records: list[dict], reference: list[dict], layout: str) -> None:
    assert len(records) == ITERATIONS, layout
    for key in ("loss", *LOGGED):
        assert _series(records, key) == pytest.approx(_series(reference, key), rel=1e-5), (layout, key)
    assert _series(records, "grad_norm") == pytest.approx(_series(reference, "grad_norm"), rel=1e-4), layout


def test_router_flags_train_the_same_in_every_layout(run_distributed, tmp_path) -> None:
    """EP=2 and PP=2 (2 ranks each; PP's second stage starts at global layer 3, MoE by the
    pattern), with token dropping: the one-process run. TP=2 with sequence parallelism without
    it (megatron's capacity counts the tokens each rank routes: half a sequence under SP). The
    EP=2 run's checkpoint of iteration 3, expert biases included, resumes in one process as the
    one-process run goes on."""
    with_capacity = run_distributed(run_pretrain_gpt, 1, args=(BASE + CAPACITY,))[0]
    without = run_distributed(run_pretrain_gpt, 1, args=(BASE,))[0]
    save = ["--save", str(tmp_path), "--save-interval", "3"]
    layouts = {"EP=2": (BASE + CAPACITY + ["--expert-model-parallel-size", "2"] + save, with_capacity),
               "PP=2": (BASE + CAPACITY + ["--pipeline-model-parallel-size", "2"], with_capacity),
               "TP=2": (BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], without)}
    for layout, (argv, reference) in layouts.items():
        for records in run_distributed(run_pretrain_gpt, 2, args=(argv,)):
            _assert_same(records, reference, layout)
    resumed = run_distributed(run_pretrain_gpt, 1, args=(BASE + CAPACITY + ["--load", str(tmp_path), "--ckpt-step", "3"],))[0]
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert _series(resumed, "loss") == pytest.approx(_series(with_capacity, "loss")[3:], rel=1e-5)
    # The runs train, and the options change training by far more than the tolerances.
    assert _series(without, "loss")[-1] < _series(without, "loss")[0]
    assert all(value > 0 for key in LOGGED for value in _series(without, key))
    assert max(abs(a / b - 1) for a, b in zip(_series(with_capacity, "loss"), _series(without, "loss"))) > 1e-3


# Flags -------------------------------------------------------------------------------------------

def test_router_flags_reach_the_transformer_config(run_distributed) -> None:
    """Each flag's value in megatron-core's TransformerConfig of the model the trainer builds."""
    from megatron_eopt.training.arguments.parser import parse_args

    argv = ["--optimizer", "adam", "--lr", "1.0", "--num-layers", "4", "--num-experts", "8", "--disable-bias-linear",
            "--moe-layer-freq", "[0,1,1,1]", "--moe-ffn-hidden-size", "96", "--moe-router-topk", "1",
            "--moe-router-pre-softmax", "--moe-router-dtype", "fp32", "--moe-input-jitter-eps", "0.01",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.001",
            "--moe-z-loss-coeff", "0.002", "--moe-shared-expert-intermediate-size", "64",
            "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
            "--moe-token-drop-policy", "position"]
    expected = dict(num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1], moe_ffn_hidden_size=96, moe_router_topk=1,
                    moe_router_pre_softmax=True, moe_router_dtype="fp32", moe_input_jitter_eps=0.01,
                    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.001, moe_z_loss_coeff=0.002,
                    moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=False,
                    moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
                    moe_token_drop_policy="position", moe_router_score_function="softmax",
                    moe_router_enable_expert_bias=False)
    ((config,),) = [run_distributed(_built_config, 1, args=(argv, list(expected)))]
    assert config == expected


def _built_config(rank: int, world_size: int, argv: list[str], names: list[str]) -> dict:
    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.model.gpt import build_gpt_model, destroy_model_parallel, initialize_model_parallel

    _, settings, _ = parse_args(argv)
    initialize_model_parallel(1, seed=1)
    try:
        config = build_gpt_model(settings).config
        return {name: getattr(config, name) for name in names}
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("text,expected", [
    ("3", 3), ("[0,1,1,1]", [0, 1, 1, 1]), ("([0]*1+[1]*3)", [0, 1, 1, 1]),
    ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0, 1, 1, 1, 0, 0]), (" ( [0] + [1]*2 ) ", [0, 1, 1]),
])
def test_moe_layer_freq_parses_megatron_lm_expressions(text, expected) -> None:
    from megatron_eopt.training.arguments.moe import parse_moe_layer_freq

    assert parse_moe_layer_freq(text) == expected


@pytest.mark.parametrize("text", ["__import__('os')", "[1]*-1", "[0,2]", "[1]+", "([1]*3", "1.5", "[]", "[1]*[2]"])
def test_moe_layer_freq_refuses_anything_else(text) -> None:
    from megatron_eopt.training.arguments.moe import parse_moe_layer_freq

    with pytest.raises(ValueError, match=r"^--moe-layer-freq .*\.$"):
        parse_moe_layer_freq(text)


MOE = ["--num-experts", "4", "--disable-bias-linear"]


@pytest.mark.parametrize("argv,message", [
    (MOE + ["--moe-layer-freq", "[0,1]"], "--moe-layer-freq lists 2 layers; --num-layers is 4."),
    (MOE + ["--moe-layer-freq", "[0,0,0,0]"], "--moe-layer-freq makes no layer MoE"),
    (MOE + ["--moe-layer-freq", "exec(1)"], "--moe-layer-freq 'exec(1)': expected an int N or a list"),
    (MOE + ["--moe-router-topk", "1", "--moe-router-score-function", "softmax"],
     "--moe-router-topk 1 with the softmax score needs --moe-router-pre-softmax"),
    (MOE + ["--moe-router-num-groups", "2"], "--moe-router-num-groups and --moe-router-group-topk go together"),
    (MOE + ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups must be >= 1 and divide --num-experts 4; got 3."),
    (MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], "--moe-router-group-topk must be in [1, min("),
    (MOE + ["--moe-router-topk-scaling-factor", "0"], "--moe-router-topk-scaling-factor must be a finite number > 0"),
    (MOE + ["--moe-input-jitter-eps", "1.5"], "--moe-input-jitter-eps must be in (0, 1); got 1.5."),
    (MOE + ["--moe-z-loss-coeff", "0"], "--moe-z-loss-coeff must be a finite number > 0"),
    (MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1"],
     "--moe-aux-loss-coeff gives 1 value(s) for 2 --moe-router-load-balancing-type(s)"),
    (MOE + ["--moe-router-load-balancing-type", "aux_loss", "aux_loss", "--moe-aux-loss-coeff", "0.1", "0.1"],
     "each type at most once"),
    (MOE + ["--moe-router-load-balancing-type", "quantile_balancing"],
     "--moe-router-load-balancing-type quantile_balancing is not offered"),
    (MOE + ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.1"],
     "--moe-router-load-balancing-type sinkhorn balances by itself"),
    (MOE + ["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias needs --moe-router-score-function"),
    (MOE + ["--moe-router-bias-update-rate", "0.1"],
     "--moe-router-bias-update-rate only applies with --moe-router-enable-expert-bias (aux-loss-free balancing)."),
    (MOE + ["--moe-shared-expert-gate"], "--moe-shared-expert-gate only applies with --moe-shared-expert-intermediate-size"),
    (MOE + ["--moe-shared-expert-intermediate-size", "30", "--tensor-model-parallel-size", "4", "--sequence-parallel"],
     "--moe-shared-expert-intermediate-size must be >= 1 and divisible by --tensor-model-parallel-size 4; got 30."),
    (MOE + ["--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be >= 1"),
    (MOE + ["--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity only applies with --moe-expert-capacity-factor (token dropping)."),
    (MOE + ["--moe-expert-capacity-factor", "-1"], "--moe-expert-capacity-factor must be a finite number > 0; got -1.0"),
    (MOE + ["--moe-expert-capacity-factor", "1", "--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-expert-capacity-factor works with the load-balancing types aux_loss"),
    (["--moe-z-loss-coeff", "0.1", "--moe-layer-freq", "2"],
     "--moe-layer-freq and --moe-z-loss-coeff only apply with --num-experts"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_router_flags_exit_with_one_line(argv, message, monkeypatch, capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--optimizer", "adam", "--lr", "1.0", "--num-layers", "4"] + argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; CUDA runs megatron-core's shared-expert streams")
def test_shared_expert_overlap_is_refused_on_cpu(monkeypatch, capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "adam", "--lr", "1.0", *MOE, "--moe-shared-expert-intermediate-size",
                    "64", "--moe-shared-expert-overlap", "--distributed-backend", "gloo"])  # on CPU, known before torch
    assert "--moe-shared-expert-overlap needs CUDA" in capsys.readouterr().err
