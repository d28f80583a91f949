"""--multi-latent-attention (megatron-core's MLA, megatron_eopt/training/model/mla.py) in scripts/pretrain_gpt.py.

References, none produced by the code under test:
- Layouts against one process: TP=2 (Muon), TP=2 with --sequence-parallel (Adam) and DP=2 with
  the layer-wise distributed optimizer (Muon) train as the one-process run does (losses,
  gradient and parameter norms, validation; the pipeline tests' tolerances, 1e-5 on losses).
  (While this was built, one backward's TP=2 gradients differed from TP=1's, from layer 0 on,
  without megatron_eopt/training/model/mla.py's RoPE-key gradient sum, and MLA's q_layernorm gradient was doubled when
  summed over TP by name, as megatron-core's local path does.)
- The built weights' shapes at TP=2, written out from the flags by hand.
- Muon's Newton-Schulz calls at TP=2 (default duplicated mode): every MLA component at its
  global shape (params/fused_layouts.py; megatron-core's Muon splits only `linear_qkv`).
- YaRN: the angles and concentration factor of the model's rotary embedding, and MLA's softmax
  scale, against the formulas written out here.
- FLOPs: megatron's count grows by 6 * tokens * (the parameters a wider query latent adds).
- Bad values and combinations: one line naming the flags.
"""

import math
import os

import pytest

from tests.unit.training.test_pretrain_gpt_flags import ADAM, _our_lines, _parse
from tests.unit.training.parallel.test_pretrain_gpt_pipeline import ARGV, OPTIMIZERS, _assert_same_training, run_training

HIDDEN, HEADS, Q_LORA, KV_LORA, QK, POS, V = 32, 4, 8, 12, 8, 4, 6
SCALING, MSCALE_ALL_DIM = 4.0, 1.0
MLA = ["--multi-latent-attention", "--q-lora-rank", str(Q_LORA), "--kv-lora-rank", str(KV_LORA),
       "--qk-head-dim", str(QK), "--qk-pos-emb-head-dim", str(POS), "--v-head-dim", str(V), "--qk-layernorm",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--rotary-scaling-factor", str(SCALING), "--mscale-all-dim", str(MSCALE_ALL_DIM)]
LAYOUTS = {  # name: (world size, optimizer, flags)
    "TP=2": (2, "muon", ["--tensor-model-parallel-size", "2"]),
    "TP=2 + sequence parallel": (2, "adam", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "DP=2 layer-wise": (2, "muon layer-wise", []),
}


def test_mla_layouts_train_as_one_process(run_distributed) -> None:
    references = {name: run_distributed(run_training, 1, args=(ARGV + MLA + OPTIMIZERS[name],))[0]
                  for name in ("muon", "adam", "muon layer-wise")}
    for name, (world_size, optimizer, flags) in LAYOUTS.items():
        curves = run_distributed(run_training, world_size, args=(ARGV + MLA + OPTIMIZERS[optimizer] + flags,))
        _assert_same_training(curves, references[optimizer])


def _shapes_and_muon_calls(rank: int, world_size: int, argv: list[str]) -> dict:
    """The TP=2 model's MLA weight shapes and the Newton-Schulz input shapes of one Muon step."""
    import torch

    from megatron_eopt.training import pretrain
    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.model.gpt import build_gpt_model, destroy_model_parallel, initialize_model_parallel
    from tests.newton_schulz_calls import recording_newton_schulz_calls

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    args, settings, layout = parse_args(list(argv))
    initialize_model_parallel(layout.tp, args.seed)
    try:
        model = build_gpt_model(settings, torch.device("cpu"))
        attention = model.decoder.layers[0].self_attention
        shapes = {name: tuple(p.shape) for name, p in attention.named_parameters()}
        emb, mscale = attention.rotary_pos_emb(6)
        rope = {"emb": emb.flatten(1), "mscale": mscale, "softmax_scale": attention.core_attention.softmax_scale}
    finally:
        destroy_model_parallel()
    with recording_newton_schulz_calls() as calls:
        pretrain.main(list(argv))
    return {"shapes": shapes, "rope": rope, "calls": list(calls)}


def _matrices(calls: list[tuple]) -> list[tuple]:
    """Each orthogonalized matrix's dimensions (smaller first), batched calls counted per matrix."""
    matrices = []
    for shape in calls:
        count = math.prod(shape[:-2])
        matrices += [tuple(sorted(shape[-2:]))] * count
    return sorted(matrices)


@pytest.fixture(scope="module")
def tp2_model(run_distributed) -> dict:
    argv = ARGV + MLA + OPTIMIZERS["muon"] + ["--tensor-model-parallel-size", "2", "--num-layers", "2",
                                               "--train-iters", "1", "--eval-interval", "100"]
    return run_distributed(_shapes_and_muon_calls, 2, args=(argv,))[0]


def test_mla_weights_have_the_shapes_the_flags_give(tp2_model) -> None:
    tp = 2
    assert tp2_model["shapes"] == {  # column-parallel rows split over TP, row-parallel columns
        "linear_q_down_proj.weight": (Q_LORA // tp, HIDDEN),
        "linear_q_up_proj.weight": (HEADS * (QK + POS) // tp, Q_LORA),
        "q_layernorm.weight": (Q_LORA,),
        "linear_kv_down_proj.weight": ((KV_LORA + POS) // tp, HIDDEN),
        "linear_kv_up_proj.weight": (HEADS * (QK + V) // tp, KV_LORA),
        "kv_layernorm.weight": (KV_LORA,),
        "linear_proj.weight": (HIDDEN, HEADS * V // tp),
        "linear_proj.bias": (HIDDEN,),  # linear biases are on by default; megatron's MLA projections have none
    }


def test_muon_orthogonalizes_each_mla_component_at_its_global_shape(tp2_model) -> None:
    """Issue 39: each query head; the latent and the shared rotary key of linear_kv_down_proj
    (which TP=2 shards through the latent); per head the key and the value of linear_kv_up_proj.
    Rank 0 records its own calls: the heads are whole on their rank, so it runs its 2 of 4."""
    ffn, local_heads = 64, HEADS // 2  # ARGV's --ffn-hidden-size; --swiglu: gate and up halves separately
    per_layer = ([(Q_LORA, HIDDEN)] + [(QK + POS, Q_LORA)] * local_heads + [(KV_LORA, HIDDEN), (POS, HIDDEN)]
                 + [(QK, KV_LORA)] * local_heads + [(V, KV_LORA)] * local_heads
                 + [(HEADS * V, HIDDEN), (HIDDEN, ffn), (HIDDEN, ffn), (HIDDEN, ffn)])
    expected = sorted(tuple(sorted(shape)) for shape in per_layer * 2)  # 2 layers, one step
    assert _matrices(tp2_model["calls"]) == expected


def test_yarn_angles_mscale_and_softmax_scale_follow_the_formulas(tp2_model) -> None:
    import torch

    base, original_positions, beta_fast, beta_slow = 10000.0, 4096, 32.0, 1.0  # megatron's MLA defaults

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return POS * math.log(original_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), POS - 1)
    pairs = torch.arange(POS // 2, dtype=torch.float32)
    original = base ** (-2 * pairs / POS)
    keep_original = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
    inv_freq = original / SCALING * (1 - keep_original) + original * keep_original
    angles = torch.outer(torch.arange(6, dtype=torch.float32), inv_freq)
    rope = tp2_model["rope"]
    torch.testing.assert_close(rope["emb"], torch.cat([angles, angles], dim=-1), rtol=1e-6, atol=1e-6)

    def yarn_mscale(scale: float, m: float) -> float:
        return 0.1 * m * math.log(scale) + 1.0

    assert rope["mscale"] == pytest.approx(yarn_mscale(SCALING, 1.0) / yarn_mscale(SCALING, MSCALE_ALL_DIM))
    assert rope["softmax_scale"] == pytest.approx(yarn_mscale(SCALING, MSCALE_ALL_DIM) ** 2 / math.sqrt(QK + POS))


def test_flops_count_the_query_latent(monkeypatch) -> None:
    from megatron_eopt.training.logging.performance import flops_per_iteration

    _, settings, _ = _parse(MLA, monkeypatch)
    _, wider, _ = _parse(MLA + ["--q-lora-rank", str(Q_LORA + 1)], monkeypatch)
    tokens = 8 * settings.seq_length
    # One more latent row: a row of the down-projection, a column of the up-projection, a norm weight.
    added_params = settings.num_layers * (settings.hidden_size + settings.num_attention_heads * (QK + POS) + 1)
    assert flops_per_iteration(wider, 8) - flops_per_iteration(settings, 8) == pytest.approx(6 * tokens * added_params)


@pytest.mark.parametrize("argv,message", [
    (["--q-lora-rank", "8"], "--q-lora-rank only applies with --multi-latent-attention"),
    (["--kv-lora-rank", "8", "--mscale", "2"], "--kv-lora-rank and --mscale only apply with --multi-latent-attention"),
    (["--rope-type", "yarn"], "--rope-type yarn only applies with --multi-latent-attention"),
    (MLA + ["--group-query-attention"], "--group-query-attention and --multi-latent-attention exclude each other"),
    (["--multi-latent-attention", "--qk-layernorm"], "--qk-layernorm with --multi-latent-attention needs --q-lora-rank"),
    (MLA + ["--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim 3 must be even"),
    (MLA + ["--kv-lora-rank", "0"], "--kv-lora-rank 0 must be positive"),
    (MLA + ["--rotary-interleaved"], "--rotary-interleaved do not apply with --multi-latent-attention"),
    (MLA + ["--rotary-percent", "0.5"], "--rotary-percent with --multi-latent-attention only applies with --rope-type rope"),
    (MLA + ["--rotary-scaling-factor", "0"], "--rotary-scaling-factor 0.0 must be a finite number > 0"),
    (MLA + ["--tensor-model-parallel-size", "2", "--kv-lora-rank", "13"],
     "--kv-lora-rank 13 + --qk-pos-emb-head-dim 4 must be divisible by --tensor-model-parallel-size 2"),
])
def test_bad_mla_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, monkeypatch, world_size=2 if "--tensor-model-parallel-size" in argv else 1)
    assert exit_info.value.code == 2
    lines = _our_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines


def _logits_around_each_step(rank: int, world_size: int, argv: list[str]) -> list[tuple]:
    """The run's steps, each as (this rank's largest logit per layer and head on the step's
    micro-batches before the step, the same after it): the trainer's `train_step` with a forward of
    the model as it is (no gradient) before and after. The attentions record these forwards, and
    their records are dropped again: the step clips with its own forward's maxima."""
    import torch

    from megatron_eopt.training.loop import train as train_loop
    from megatron_eopt.training.model.gpt import gpt_token_losses
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    def largest_logits(model: torch.nn.Module, micro_batches: list) -> torch.Tensor:
        attentions = [m for m in model.modules() if hasattr(m, "current_max_attn_logits")]
        recorded = [attention.current_max_attn_logits for attention in attentions]
        with torch.no_grad():
            for tokens in micro_batches:
                gpt_token_losses(model, tokens)
        maxima = torch.stack([attention.current_max_attn_logits for attention in attentions])
        for attention, before in zip(attentions, recorded):
            attention.current_max_attn_logits = before
        return maxima

    original, records = train_loop.train_step, []

    def train_step(model, optimizer, micro_batches, *args, **kwargs):
        before = largest_logits(model, micro_batches)
        result = original(model, optimizer, micro_batches, *args, **kwargs)
        records.append((before, largest_logits(model, micro_batches)))
        return result

    train_loop.train_step = train_step
    try:
        logged = [record["max_attention_logit"] for record in run_pretrain_gpt(rank, world_size, argv)]
    finally:
        train_loop.train_step = original
    return [(before, after, value) for (before, after), value in zip(records, logged)]


def test_mla_qk_clip_at_tp2_scales_each_clipped_heads_logits_by_tau_over_its_maximum(run_distributed) -> None:
    """What QK-clip guarantees, exactly (issue 84: a bound on the clipped run's logits measured on
    one CPU failed on another). Muon at lr 0.05 (constant) on a one-layer MLA model at TP=2, tau = 1
    (the logits of this tiny model grow past it within a few steps). At the first step whose
    forward exceeds tau, the clipped run and a run that only logs the logits have taken the same
    steps; after that step, each head's largest logit on the step's micro-batches is the logging
    run's times eta = min(1, tau / S), with S the head's maximum in the step's forward: bitwise for
    the heads under tau, within fp32 rounding of the scaled weights for the others. One layer: a
    later layer's input would depend on the earlier layers' clip. The logged value is the
    largest logit of the step's own forward, over the TP ranks."""
    import torch

    tau = 1.0
    argv = (ARGV + MLA + ["--optimizer", "muon", "--tensor-model-parallel-size", "2", "--lr", "0.05",
                          "--lr-decay-style", "constant", "--train-iters", "12", "--eval-iters", "0",
                          "--global-batch-size", "4", "--num-layers", "1"])
    clipped = run_distributed(_logits_around_each_step, 2, args=(argv + ["--qk-clip", "--qk-clip-threshold", str(tau)],))
    largest = [max(rank[step][0].max().item() for rank in clipped) for step in range(12)]
    assert [step[2] for step in clipped[0]] == largest  # logged: the step's own forward, over TP
    first = next((step for step, value in enumerate(largest) if value > tau), None)
    assert first is not None, largest  # the logits do pass tau: the clip has work to do
    free = run_distributed(_logits_around_each_step, 2,
                           args=(argv + ["--log-max-attention-logit", "--exit-interval", str(first + 1)],))
    clipped_heads = 0
    for rank_clipped, rank_free in zip(clipped, free):
        assert len(rank_free) == first + 1
        for step in range(first):  # under tau everywhere: both runs take the same steps
            assert torch.equal(rank_clipped[step][0], rank_free[step][0]), step
            assert torch.equal(rank_clipped[step][1], rank_free[step][1]), step
        before, after, _ = rank_clipped[first]
        assert torch.equal(before, rank_free[first][0])
        eta = (tau / before).clamp(max=1.0)
        expected = rank_free[first][1] * eta
        assert torch.equal(after[eta == 1], expected[eta == 1])
        torch.testing.assert_close(after, expected, rtol=1e-5, atol=0)
        clipped_heads += int((eta < 1).sum())
        print(f"rank's first clip at step {first + 1}: eta {eta.flatten().tolist()}, after / (logging run's x eta) - 1: "
              f"{((after - expected) / expected).abs().max().item():.1e}")
    assert clipped_heads > 0
