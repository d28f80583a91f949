"""Activation recompute in scripts/pretrain_gpt.py (Megatron-LM's --recompute-* flags), on CPU.

Recompute changes when activations are computed, not what: with dropout on (hidden and
attention 0.1, so the recomputed forward must draw the same masks: megatron's checkpoint
restores the RNG states, megatron_eopt/training/parallel/cpu_rng.py makes that work without CUDA) every run logs the
losses and gradient norms of the run without recompute, bit for bit. That the recompute happens
is counted: the forward calls of each transformer layer (full) or each core attention
(selective) per micro-batch.
"""

import pytest

from tests.pretrain_gpt_in_process import run_pretrain_gpt
from tests.unit.training.parallel.test_pretrain_gpt_pipeline import ARGV, OPTIMIZERS

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-iters", "0", "--train-iters", "4"]
LAYERS, MICRO_BATCHES, ITERATIONS = 4, 4, 4  # ARGV: 4 layers, global batch 8 of micro-batches of 2
RECOMPUTE = {  # flags: (forward calls of the layers, core attentions, MLPs, norms) per micro-batch
    "none": ([], (LAYERS, LAYERS, LAYERS, 2 * LAYERS + 1)),
    "selective": (["--recompute-activations"], (LAYERS, 2 * LAYERS, LAYERS, 2 * LAYERS + 1)),
    "full, uniform 2": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "2"], (2 * LAYERS, 2 * LAYERS, 2 * LAYERS, 4 * LAYERS + 1)),
    "full, block 1": (["--recompute-granularity", "full", "--recompute-method", "block",
                       "--recompute-num-layers", "1"], (LAYERS + 1, LAYERS + 1, LAYERS + 1, 2 * LAYERS + 3)),
}


def run_counting_forwards(rank: int, world_size: int, argv: list[str]) -> tuple[list[dict], tuple[int, ...]]:
    """`run_pretrain_gpt`, also counting the forward calls of the transformer layers, core
    attentions, MLPs and layer norms (torch's) on this rank."""
    import torch
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_eopt.training.model.sdpa_attention import SDPACoreAttention

    counts = {TransformerLayer: 0, SDPACoreAttention: 0, MLP: 0, torch.nn.LayerNorm: 0}
    originals = {cls: cls.forward for cls in counts}

    def counting(cls):
        def forward(self, *args, **kwargs):
            counts[cls] += 1
            return originals[cls](self, *args, **kwargs)
        return forward

    for cls in counts:
        cls.forward = counting(cls)
    try:
        records = run_pretrain_gpt(rank, world_size, argv)
    finally:
        for cls, original in originals.items():
            cls.forward = original
    return records, tuple(counts.values())


def _curves(records: list[dict]) -> tuple[list[float], list[float]]:
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def test_recompute_gives_the_same_run_and_recomputes(run_distributed) -> None:
    argv = ARGV + OPTIMIZERS["muon"] + DROPOUT
    runs = {name: run_distributed(run_counting_forwards, 1, args=(argv + flags,))[0]
            for name, (flags, _) in RECOMPUTE.items()}
    reference = _curves(runs["none"][0])
    assert len(reference[0]) == ITERATIONS
    for name, (records, calls) in runs.items():
        assert _curves(records) == reference, name
        per_micro_batch = RECOMPUTE[name][1]
        assert calls == tuple(n * MICRO_BATCHES * ITERATIONS for n in per_micro_batch), (name, calls)


def test_recompute_modules_core_attention_and_mlp(run_distributed) -> None:
    """--recompute-modules core_attn mlp (without linear biases, which megatron's MLP checkpoint
    cannot take): the same run bit for bit, with both recomputed."""
    argv = ARGV + OPTIMIZERS["adam"] + DROPOUT + ["--disable-bias-linear"]
    plain = run_distributed(run_counting_forwards, 1, args=(argv,))[0]
    recomputed = run_distributed(run_counting_forwards, 1, args=(argv + [
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"],))[0]
    assert _curves(recomputed[0]) == _curves(plain[0])
    per_micro_batch = (LAYERS, 2 * LAYERS, 2 * LAYERS, 2 * LAYERS + 1)
    assert recomputed[1] == tuple(n * MICRO_BATCHES * ITERATIONS for n in per_micro_batch), recomputed[1]


def test_recompute_modules_moe(run_distributed) -> None:
    """--recompute-modules moe: the MoE layers recomputed (router, dispatch, experts) give the run
    without it bit for bit, its logged load-balancing loss included (counted once)."""
    argv = ARGV + OPTIMIZERS["adam"] + DROPOUT + ["--disable-bias-linear", "--num-experts", "4",
                                                   "--moe-aux-loss-coeff", "0.1"]
    plain, plain_calls = run_distributed(_run_counting_moe_layers, 1, args=(argv,))[0]
    recomputed, calls = run_distributed(_run_counting_moe_layers, 1, args=(argv + [
        "--recompute-granularity", "selective", "--recompute-modules", "moe"],))[0]
    assert [(r["loss"], r["grad_norm"], r["load_balancing_loss"]) for r in recomputed] == [
        (r["loss"], r["grad_norm"], r["load_balancing_loss"]) for r in plain]
    assert (plain_calls, calls) == (LAYERS * MICRO_BATCHES * ITERATIONS, 2 * LAYERS * MICRO_BATCHES * ITERATIONS)


def _run_counting_moe_layers(rank: int, world_size: int, argv: list[str]) -> tuple[list[dict], int]:
    """`run_pretrain_gpt` and the calls of the routers' forward (MoELayer recomputes its body,
    router included, inside its own forward)."""
    from megatron.core.transformer.moe.router import TopKRouter

    calls, original = [0], TopKRouter.forward

    def forward(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    TopKRouter.forward = forward
    try:
        return run_pretrain_gpt(rank, world_size, argv), calls[0]
    finally:
        TopKRouter.forward = original


def test_recompute_with_tensor_and_sequence_parallel_dropout(run_distributed) -> None:
    """At TP=2 with sequence parallelism the dropout masks come from the tracker's per-rank stream
    (forked inside the recomputed region): full recompute logs the run without it."""
    argv = ARGV + OPTIMIZERS["adam"] + DROPOUT + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    plain = run_distributed(run_pretrain_gpt, 2, args=(argv,))
    recomputed = run_distributed(run_pretrain_gpt, 2, args=(argv + RECOMPUTE["full, uniform 2"][0],))
    assert _curves(recomputed[0]) == _curves(plain[0])


@pytest.mark.parametrize("argv,message", [
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method (uniform or block) "
                                          "and --recompute-num-layers."),
    (["--recompute-method", "block"], "--recompute-method only applies with --recompute-granularity full."),
    (["--recompute-activations", "--recompute-num-layers", "1"],
     "--recompute-num-layers only applies with --recompute-granularity full (got selective)."),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "9"],
     "--recompute-num-layers 9 must be in [1, --num-layers 2]."),
    (["--recompute-activations", "--recompute-granularity", "full"],
     "--recompute-activations (selective recompute) and --recompute-granularity full exclude each other"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--recompute-modules", "mlp"], "--recompute-modules only applies with selective recompute"),
    (["--recompute-activations", "--recompute-modules", "moe"], "--recompute-modules moe needs --num-experts"),
    (["--recompute-activations", "--recompute-modules", "moe_act"], "argument --recompute-modules: invalid choice"),
    (["--recompute-activations", "--recompute-modules", "mlp"], "--recompute-modules mlp needs --disable-bias-linear"),
    (["--recompute-activations", "--recompute-modules", "layernorm"],
     "--recompute-modules layernorm needs CUDA and Transformer Engine"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--distribute-saved-activations"], "--distribute-saved-activations needs --tensor-model-parallel-size > 1"),
    (["--recompute-activations", "--distribute-saved-activations"],
     "--distribute-saved-activations only applies with --recompute-granularity full (got selective)."),
], ids=["full-alone", "method-alone", "layers-with-selective", "too-many-layers", "both", "modules-with-full",
        "moe-module-dense", "grouped-gemm-module", "mlp-with-bias", "layernorm-without-te", "distribute-at-tp1", "distribute-with-selective"])
def test_bad_recompute_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse_args(["--lr", "1e-3"] + argv)
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
    assert message in lines[-1] and (len(lines) == 1 or "argument" in message), lines
