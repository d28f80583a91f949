"""Megatron-LM's own example command lines (examples/llama/train_llama3_8b_h100_fp8.sh,
examples/mixtral/train_mixtral_8x7b_distributed.sh) run on scripts/pretrain_gpt.py unchanged
except for the sizes (scaled down to run on CPU) and paths; their flags do what Megatron-LM
does, or say in one line that they change nothing, or are refused with the reason (FP8).
examples/gpt3/train_gpt3_175b_distributed.sh is refused as Megatron-LM refuses it (a batch
ramp-up with --train-iters; --vocab-file without --tokenizer-type) and parses once fixed.

References are independent of the code under test: megatron's own torch norms for
--apply-layernorm-1p, one process for --kv-channels at TP 2, counted gc.collect calls for
--manual-gc.
"""

import contextlib
import dataclasses
import io

import re

import pytest

# The llama3 example's flags in its order, sizes scaled down, FP8 flags apart (FP8 below).
LLAMA3 = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32",
    "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-samples", "16", "--lr-decay-samples", "12",
    "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--tiktoken-pattern", "v2",
    "--split", "98,1,1", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "2", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
    "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
    # The logging flags of its bf16 sibling, examples/llama/train_llama3_8b_h200_bf16.sh.
    "--wandb-project", "megatron-lm-training", "--wandb-exp-name", "llama3x-8b-bf16-tp1", "--wandb-save-dir", "wandb",
    "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
]


def _gpt3(tmp_path, train_length: list[str]) -> list[str]:
    """The GPT-3 example's flags in its order, sizes scaled down; files that exist (parsing checks)."""
    for name in ("data.bin", "data.idx", "merges.txt"):
        (tmp_path / name).write_text("#version: 0.2\n" if name == "merges.txt" else "")
    (tmp_path / "vocab.json").write_text('{"<|endoftext|>": 0, "a": 1}')
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
        *train_length, "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--data-path", str(tmp_path / "data"), "--vocab-file", str(tmp_path / "vocab.json"),
        "--merge-file", str(tmp_path / "merges.txt"), "--split", "949,50,1",
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--eval-iters", "10",
        "--tensorboard-dir", str(tmp_path / "tb"),
    ]


def test_gpt3_example_is_refused_as_megatron_lm_refuses_it_and_parses_once_fixed(monkeypatch, capsys,
                                                                                  tmp_path) -> None:
    as_published = _gpt3(tmp_path, ["--train-iters", "500", "--lr-decay-iters", "430"])
    with pytest.raises(SystemExit):
        _parse(as_published, monkeypatch)
    assert "--rampup-batch-size needs --train-samples" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # with samples, the next refusal: the installed Megatron-LM's too
        _parse(_gpt3(tmp_path, ["--train-samples", "200", "--lr-decay-samples", "172"]), monkeypatch)
    assert "--vocab-file/--merge-file need --tokenizer-type GPT2BPETokenizer" in capsys.readouterr().err
    args, settings, _ = _parse(_gpt3(tmp_path, ["--train-samples", "200", "--lr-decay-samples", "172",
                                                "--tokenizer-type", "GPT2BPETokenizer"]), monkeypatch)
    # (16 - 4) / 4 = 3 steps over 24 samples: 8 from sample 8, 12 from 16, 16 from 24 on.
    assert [args.batch_schedule.size(i) for i in range(1, 8)] == [4, 4, 8, 12, 16, 16, 16]
    assert settings.fp16 and settings.vocab_size == 128  # GPT-2 files' vocabulary (2) padded to 128


def _llama3(checkpoints) -> list[str]:
    return LLAMA3 + ["--save", str(checkpoints), "--load", str(checkpoints)]

LLAMA3_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
              "--fp8-param-gather"]
# The mixtral example's flags, sizes scaled down (its commented-out flags left out as it does).
MIXTRAL = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "64",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "2",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
    "--rotary-base", "1000000",
    "--num-experts", "2", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "allgather", "--overlap-param-gather",
    "--overlap-grad-reduce",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data", "--split", "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "3", "--min-lr", "1.0e-5",
    "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "2",
    "--use-distributed-optimizer", "--sequence-parallel",
    "--eval-iters", "1", "--no-load-optim", "--no-load-rng", "--log-interval", "1",
]


def _parse(argv: list[str], monkeypatch, world_size: int = 1):
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return parse_args(argv)


def test_llama3_example_flags_reach_model_and_trainer(monkeypatch, tmp_path) -> None:
    args, settings, layout = _parse(_llama3(tmp_path), monkeypatch)
    assert (settings.kv_channels, settings.layernorm_zero_centered_gamma) == (32, True)
    assert settings.num_query_groups == 2 and settings.position_embedding_type == "rope"
    assert not args.accumulate_allreduce_grads_in_fp32  # --grad-reduce-in-bf16 wins over --bf16's default
    assert not args.mmap_bin_files and args.manual_gc and args.empty_unused_memory_level == 1
    assert args.train_iters == 4 and args.distributed_timeout_minutes == 60
    without = [flag for flag in _llama3(tmp_path) if flag != "--grad-reduce-in-bf16"]
    assert _parse(without, monkeypatch)[0].accumulate_allreduce_grads_in_fp32  # Megatron-LM's bf16 default


def test_llama3_example_fp8_flags_are_refused_with_the_reason(monkeypatch, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(_llama3(tmp_path) + LLAMA3_FP8, monkeypatch)
    assert exit_info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "CUDA runtime" not in line]
    assert line.startswith("pretrain_gpt.py: error: --fp8-format: FP8 training is not offered"), line


def test_mixtral_example_parses_to_a_moe_model(monkeypatch) -> None:
    args, settings, layout = _parse(MIXTRAL, monkeypatch, world_size=2)
    assert (settings.num_moe_experts, layout.ep, settings.normalization) == (2, 2, "RMSNorm")
    assert not settings.sequence_parallel  # TP 1: off, as in Megatron-LM


def _run_counting_gc(rank: int, world_size: int, argv: list[str]) -> dict:
    """pretrain_gpt's records, printed lines, gc.collect calls and whether the collector was on
    during each training step and after the run."""
    import gc

    from megatron_eopt.training import pretrain
    from megatron_eopt.training.loop import train as train_loop

    collects, enabled_in_steps = [], []
    real_collect, real_step = gc.collect, train_loop.train_step

    def collect(*args, **kwargs):
        collects.append(1)
        return real_collect(*args, **kwargs)

    def train_step(*args, **kwargs):
        enabled_in_steps.append(gc.isenabled())
        return real_step(*args, **kwargs)

    out = io.StringIO()
    gc.collect, train_loop.train_step = collect, train_step
    try:
        with contextlib.redirect_stdout(out):
            records = pretrain.main(list(argv))
    finally:
        gc.collect, train_loop.train_step = real_collect, real_step
    return {"records": records, "printed": out.getvalue(), "collects": len(collects),
            "enabled_in_steps": enabled_in_steps, "enabled_after": gc.isenabled()}


def test_llama3_example_runs_and_collects_garbage_at_fixed_points(run_distributed, tmp_path) -> None:
    """--manual-gc: the collector is off for the run (on again after), and gc.collect runs once at
    the start, every --manual-gc-interval iterations and before and after each evaluation
    (without --no-manual-gc-eval), beyond the one collection of initialize_model_parallel. The flags without effect say so in one line each."""
    (run,) = run_distributed(_run_counting_gc, 1, args=(_llama3(tmp_path / "a") + ["--manual-gc-interval", "2"],))
    printed, records = run["printed"], run["records"]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in records)
    assert all(r["params_norm"] > 0 and r["num_zeros"] >= 0 for r in records)
    evaluations = printed.count("validation loss at iteration")
    assert evaluations == 2 + 2  # at iterations 2 and 4, then the final validation and test
    # initialize_model_parallel collects once before it makes its groups (model_parallel.py says why).
    assert run["collects"] == 1 + 1 + 4 // 2 + 2 * evaluations
    assert run["enabled_in_steps"] == [False] * 4 and run["enabled_after"]
    for flag in ("--cross-entropy-loss-fusion", "--ckpt-format torch_dist",
                 "--tiktoken-pattern v2", "--no-create-attention-mask-in-dataloader", "--log-timers-to-tensorboard",
                 "--wandb-project megatron-lm-training"):
        assert f"> {flag}: no effect, " in printed, flag
    assert "--empty-unused-memory-level 1: no effect on CPU" in printed
    assert "--profile: no effect here, the CUDA profiler capture range needs CUDA" in printed
    assert printed.count("throughput per GPU (TFLOP/s/GPU): ") == 4, printed  # --log-throughput, every line

    (quiet,) = run_distributed(_run_counting_gc, 1, args=(_llama3(tmp_path / "b") + [
        "--manual-gc-interval", "2", "--no-manual-gc-eval"],))
    assert quiet["collects"] == 1 + 1 + 4 // 2
    assert [r["loss"] for r in quiet["records"]] == [r["loss"] for r in records]  # collection changes nothing


def test_mixtral_example_runs_at_expert_parallel_two(run_distributed) -> None:
    (run, _) = run_distributed(_run_counting_gc, 2, args=(MIXTRAL,))
    assert [r["iteration"] for r in run["records"]] == [1, 2, 3]
    printed = run["printed"]
    assert re.search(r"MoE: 2 experts in (\d+) of \1 layers, top-2 \(softmax\), EP 2", printed), printed
    assert "> --no-position-embedding: no effect, " in printed and "> --no-masked-softmax-fusion: no effect" in printed
    assert all(run["enabled_in_steps"])  # no --manual-gc: Python's own collector stays on


def _zero_centred_vs_plain(rank: int, world_size: int) -> list[dict]:
    """For LayerNorm and RMSNorm: a model with zero-centred norms (--apply-layernorm-1p) and one
    with megatron's plain torch norms, given the same weights (gamma = stored weight + 1): their
    losses and gradients; at TP = world_size with sequence parallelism when > 1."""
    import torch

    from megatron_eopt.training.model.gpt import (GPTModelSettings, build_gpt_model, destroy_model_parallel, gpt_loss,
                                   initialize_model_parallel)
    from megatron_eopt.training.model.norms import ZeroCenteredLayerNorm, ZeroCenteredRMSNorm

    initialize_model_parallel(world_size, 1234)
    results = []
    try:
        for normalization in ("LayerNorm", "RMSNorm"):
            base = GPTModelSettings(normalization=normalization, sequence_parallel=world_size > 1, seq_length=16)
            centred = build_gpt_model(dataclasses.replace(base, layernorm_zero_centered_gamma=True))
            plain = build_gpt_model(base)
            norms = [name for name, module in centred.named_modules()
                     if isinstance(module, (ZeroCenteredLayerNorm, ZeroCenteredRMSNorm))]
            weights = {f"{name}.weight" for name in norms}
            plain_params = dict(plain.named_parameters())
            initial = {name: float(p.abs().max()) for name, p in centred.named_parameters() if name in weights}
            generator = torch.Generator().manual_seed(rank)
            with torch.no_grad():
                for name, param in centred.named_parameters():
                    if name in weights:
                        param.copy_(0.1 * torch.randn(param.shape, generator=generator))
                        plain_params[name].copy_(param + 1)
                    else:
                        plain_params[name].copy_(param)
            tokens = torch.randint(0, base.vocab_size, (4, base.seq_length + 1), generator=torch.Generator().manual_seed(7))
            losses = []
            for model in (centred, plain):
                loss = gpt_loss(model, tokens)
                loss.backward()
                losses.append(float(loss))
            grad_diff = max(float((p.grad - plain_params[name].grad).abs().max())
                            for name, p in centred.named_parameters())
            results.append({"norms": len(norms), "initial": initial, "losses": losses, "grad_diff": grad_diff,
                            "sp_tags": all(getattr(p, "sequence_parallel", False) == (world_size > 1)
                                           for name, p in centred.named_parameters() if name in weights)})
    finally:
        destroy_model_parallel()
    return results


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "tp2-sequence-parallel"])
def test_zero_centred_norms_equal_plain_norms_with_gamma_plus_one(run_distributed, world_size: int) -> None:
    """fp32, tolerance 1e-6: the same function and gradients as megatron's torch norms."""
    for results in run_distributed(_zero_centred_vs_plain, world_size):
        for result in results:
            assert result["norms"] == 2 * 2 + 1, result  # two per layer and the final norm
            assert all(v == 0.0 for v in result["initial"].values()), result["initial"]  # gamma starts at 1
            assert abs(result["losses"][0] - result["losses"][1]) <= 1e-6, result["losses"]
            assert result["grad_diff"] <= 1e-6 and result["sp_tags"], result


def _attention_shapes(rank: int, world_size: int, kv_channels: int) -> dict:
    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(1, 1234)
    try:
        model = build_gpt_model(GPTModelSettings(hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                                 kv_channels=kv_channels))
        attention = model.decoder.layers[0].self_attention
        return {"qkv": tuple(attention.linear_qkv.weight.shape), "proj": tuple(attention.linear_proj.weight.shape),
                "scale": attention.core_attention.softmax_scale}
    finally:
        destroy_model_parallel()


def test_kv_channels_at_tensor_parallel_two_equal_one_process(run_distributed) -> None:
    """--kv-channels 32 with hidden 64 / 4 heads (16 by default): the attention is wider than the
    hidden size; Muon's per-head split of the QKV weight at TP 2 follows it (losses and grad norms
    equal to one process, fp32, 1e-5)."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    (shapes,) = run_distributed(_attention_shapes, 1, args=(32,))
    assert (shapes["qkv"], shapes["proj"]) == (((4 + 2 * 2) * 32, 64), (64, 4 * 32)), shapes
    assert shapes["scale"] == pytest.approx(32 ** -0.5, rel=1e-12), shapes
    argv = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--lr", "0.01", "--train-iters", "4",
            "--log-interval", "1",
            "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "32",
            "--group-query-attention", "--num-query-groups", "2", "--global-batch-size", "4", "--micro-batch-size", "2"]
    (single,) = run_distributed(run_pretrain_gpt, 1, args=(argv,))
    split = run_distributed(run_pretrain_gpt, 2, args=(argv + ["--tensor-model-parallel-size", "2"],))[0]
    for one, two in zip(single, split, strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5, (one, two)
