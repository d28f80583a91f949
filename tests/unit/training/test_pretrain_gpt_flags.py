"""scripts/pretrain_gpt.py's model and schedule flags with Megatron-LM's meaning (issue #14 item 7),
checked in-process (parse_args runs before any process group exists).

Expected values are written out here from Megatron-LM's definitions: the SwiGLU FFN default
int((4 * h * 2 / 3) / 64) * 64, GQA only with --group-query-attention, tied embeddings and linear
biases by default, and the lr of megatron-core's scheduler for warmup-fraction / warmup-init /
WSD, computed by hand from the formulas (not by the scheduler under test).
"""

import math
import os

import pytest

ADAM = ["--optimizer", "adam", "--lr", "1.0", "--min-lr", "0.1"]


def _parse(argv: list[str], monkeypatch, world_size: int = 1):
    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.arguments.training import scheduler_config
    from megatron_eopt.training.parallel import layout as parallel_layout

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return parse_args(ADAM + argv)


def test_defaults_follow_megatron_lm(monkeypatch) -> None:
    _, settings, _ = _parse([], monkeypatch)
    assert settings.share_embeddings_and_output_weights  # tied unless --untie-embeddings-and-output-weights
    assert settings.add_bias_linear  # biases unless --disable-bias-linear
    assert settings.normalization == "LayerNorm"
    assert settings.num_query_groups is None  # one key/value group per head
    assert settings.ffn_hidden_size == 4 * settings.hidden_size
    assert settings.init_method_std == 0.02


@pytest.mark.parametrize("hidden,expected", [(64, 128), (256, 640), (100, 256)])
def test_swiglu_default_ffn_size(hidden: int, expected: int, monkeypatch) -> None:
    # int((4 * h * 2 / 3) / 64) * 64: 64 -> 170.7 -> 128; 256 -> 682.7 -> 640; 100 -> 266.7 -> 256
    _, settings, _ = _parse(["--swiglu", "--hidden-size", str(hidden), "--num-attention-heads", "4"], monkeypatch)
    assert settings.ffn_hidden_size == expected
    _, explicit, _ = _parse(["--swiglu", "--hidden-size", str(hidden), "--num-attention-heads", "4",
                             "--ffn-hidden-size", "96"], monkeypatch)
    assert explicit.ffn_hidden_size == 96


def test_model_flags_reach_the_settings(monkeypatch) -> None:
    _, settings, _ = _parse(["--untie-embeddings-and-output-weights", "--disable-bias-linear", "--normalization",
                             "RMSNorm", "--hidden-dropout", "0.1", "--attention-dropout", "0.2", "--init-method-std",
                             "0.01", "--group-query-attention", "--num-query-groups", "2"], monkeypatch)
    assert not settings.share_embeddings_and_output_weights and not settings.add_bias_linear
    assert (settings.normalization, settings.hidden_dropout, settings.attention_dropout) == ("RMSNorm", 0.1, 0.2)
    assert (settings.init_method_std, settings.num_query_groups) == (0.01, 2)
    assert not settings.qk_layernorm and _parse(["--qk-layernorm"], monkeypatch)[1].qk_layernorm
    _, rope, _ = _parse(["--position-embedding-type", "rope", "--rotary-interleaved", "--use-rope-scaling",
                         "--rotary-seq-len-interpolation-factor", "4"], monkeypatch)
    assert (rope.rotary_interleaved, rope.rope_scaling, rope.rope_scaling_factor) == (True, True, 8.0)
    assert rope.rotary_seq_len_interpolation_factor == 4
    assert _parse(["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "32"],
                  monkeypatch)[1].rope_scaling_factor == 32.0
    assert settings.activation == "gelu" and _parse(["--squared-relu"], monkeypatch)[1].activation == "squared_relu"
    assert _parse(["--init-method-xavier-uniform"], monkeypatch)[1].init_method_xavier_uniform
    assert _parse(["--embedding-init-method-std", "0.5"], monkeypatch)[1].embedding_init_method_std == 0.5
    quick = _parse(["--quick-geglu"], monkeypatch)[1]
    assert (quick.activation, quick.gated, quick.ffn_hidden_size) == ("quick_geglu", True, 4 * quick.hidden_size)


def test_group_query_attention_alone_means_one_group(monkeypatch) -> None:
    _, settings, _ = _parse(["--group-query-attention"], monkeypatch)
    assert settings.num_query_groups == 1  # Megatron-LM's default for --num-query-groups


def _lrs(argv: list[str], iterations: int, monkeypatch, key: str = "lr") -> list[float]:
    """The lr (or another param-group `key`) megatron-core's scheduler gives after
    0..iterations steps, as the trainer builds it."""
    import torch

    from arguments import optimizer_config_from_args
    from megatron_eopt.integrations.megatron_bridge import get_scheduler
    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.arguments.training import scheduler_config
    from megatron_eopt.training.parallel import layout as parallel_layout

    args, _, _ = _parse(argv, monkeypatch)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=args.lr)
    scheduler = get_scheduler(optimizer_config_from_args(args, torch.device("cpu")),
                              scheduler_config(args), optimizer)
    lrs = [optimizer.param_groups[0][key]]
    for _ in range(iterations):
        scheduler.step(args.global_batch_size)
        lrs.append(optimizer.param_groups[0][key])
    return lrs


def test_warmup_fraction_init_and_wsd_schedule(monkeypatch) -> None:
    """10 iterations: warmup over 0.2 of them from 0.05, constant, then WSD's linear decay over
    the last 4 to --min-lr."""
    lrs = _lrs(["--train-iters", "10", "--lr-warmup-fraction", "0.2", "--lr-warmup-init", "0.05",
                "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", "linear"], 10,
               monkeypatch)
    warmup = [0.05, 0.05 + 0.95 / 2, 1.0]  # init + (max - init) * step / 2
    stable = [1.0] * 4  # iterations 3-6: up to the decay's start at 10 - 4
    decay = [0.1 + 0.9 * (1 - k / 4) for k in (1, 2, 3, 4)]  # min + (max - min) * (1 - ratio)
    assert lrs == pytest.approx(warmup + stable + decay, abs=1e-12)


def test_train_samples_sets_iterations_and_a_schedule_in_samples(monkeypatch) -> None:
    """Megatron-LM: --train-samples // global batch iterations; warmup and decay in samples."""
    argv = ["--micro-batch-size", "4", "--global-batch-size", "4", "--train-samples", "42",
            "--lr-warmup-samples", "8", "--lr-decay-samples", "32"]
    args, _, _ = _parse(argv, monkeypatch)
    assert args.train_iters == 10  # 42 // 4
    samples = [4 * k for k in range(11)]
    expected = [s / 8 if s <= 8 else 0.1 + 0.9 * max(0.0, 1 - (s - 8) / 24) for s in samples]
    assert _lrs(argv, 10, monkeypatch) == pytest.approx(expected, abs=1e-12)


def test_wsd_exponential_is_the_default_decay(monkeypatch) -> None:
    lrs = _lrs(["--train-iters", "4", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"], 4, monkeypatch)
    coefficients = [1.0, 1.0, 1.0, 2 * 0.5 ** 0.5 - 1, 0.0]  # megatron-core: 2 * 0.5 ** ratio - 1
    assert lrs == pytest.approx([0.1 + 0.9 * c for c in coefficients], abs=1e-12)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_grows_from_start_to_end_over_training(style: str, monkeypatch) -> None:
    """Megatron-LM: start + (end - start) * c over all training samples, c = the step ratio
    (linear) or (cos(pi * (1 - ratio)) + 1) / 2 (cosine)."""
    argv = ["--train-iters", "4", "--weight-decay", "0.5", "--start-weight-decay", "0.1", "--end-weight-decay",
            "0.3", "--weight-decay-incr-style", style]
    ratios = [k / 4 for k in range(5)]
    coefficients = ratios if style == "linear" else [(math.cos(math.pi * (1 - r)) + 1) / 2 for r in ratios]
    expected = [0.1 + 0.2 * c for c in coefficients]
    assert _lrs(argv, 4, monkeypatch, key="weight_decay") == pytest.approx(expected, abs=1e-12)
    assert _lrs(["--train-iters", "4", "--weight-decay", "0.5"], 4, monkeypatch, key="weight_decay") == [0.5] * 5


def _our_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if "No CUDA runtime" not in line]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-query-groups", "2"], "--num-query-groups 2 needs --group-query-attention"),
        (["--hidden-dropout", "1.5"], "--hidden-dropout 1.5 must be in [0, 1)."),
        (["--attention-dropout", "-0.1"], "--attention-dropout -0.1 must be in [0, 1)."),
        (["--init-method-std", "0"], "--init-method-std 0.0 must be a finite number > 0."),
        (["--init-method-std", "nan"], "--init-method-std nan must be a finite number > 0."),
        (["--swiglu", "--hidden-size", "16"], "--swiglu's default FFN size"),
        (["--normalization", "BatchNorm"], "argument --normalization: invalid choice: 'BatchNorm'"),
        (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters must be set when lr_decay_style='WSD'"),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "500"], "--lr-wsd-decay-iters 500 must not exceed the decay's 100 iterations"),
        (["--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters only applies with --lr-decay-style WSD"),
        (["--lr-wsd-decay-style", "step"], "argument --lr-wsd-decay-style: invalid choice: 'step'"),
        (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1); got 1.5."),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction excludes"),
        (["--lr-warmup-init", "2.0"], "--lr-warmup-init 2.0 must not exceed --lr 1.0."),
        (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be >= 1; got 0."),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--use-torch-fsdp2", "--fp16"], "--use-torch-fsdp2 does not support --fp16"),
        (["--use-torch-fsdp2", "--bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "bf16",
          "--no-store-param-remainders"], "--use-torch-fsdp2 does not support --main-params-dtype other than fp32"),
        (["--rotary-base", "500"], "--rotary-base only applies with --position-embedding-type rope (got learned_absolute)."),
        (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent 0.0 must be in (0, 1]."),
        (["--position-embedding-type", "alibi"], "argument --position-embedding-type: invalid choice: 'alibi'"),
        (["--train-samples", "40", "--train-iters", "10"], "--train-iters and --train-samples both set"),
        (["--train-samples", "40", "--lr-decay-iters", "5"], "--lr-decay-iters counts iterations; with --train-samples"),
        (["--lr-warmup-samples", "8"], "--lr-warmup-samples needs --train-samples"),
        (["--train-samples", "2"], "--train-samples 2 must be >= --global-batch-size 4"),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1; got 0."),
        (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism is not offered"),
        (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 only applies with --bf16."),
        (["--manual-gc-interval", "5"], "--manual-gc-interval only applies with --manual-gc."),
        (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0; got -1."),
        (["--empty-unused-memory-level", "3"], "argument --empty-unused-memory-level: invalid choice: 3"),
        (["--no-position-embedding"], "--no-position-embedding is deprecated (as in Megatron-LM): use"),
        (["--kv-channels", "0"], "--kv-channels 0 must be positive."),
        (["--norm-epsilon", "0"], "--norm-epsilon 0.0 must be a finite number > 0."),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0; got 0.0."),
        (["--fp8-param-gather"], "--fp8-param-gather: FP8 training is not offered by this trainer"),
        (["--num-experts", "2", "--disable-bias-linear", "--moe-router-load-balancing-type", "quantile_balancing"],
         "--moe-router-load-balancing-type quantile_balancing is not offered"),
        (["--moe-router-load-balancing-type", "aux_loss"],
         "--moe-router-load-balancing-type only applies with --num-experts"),
        (["--profile-step-start", "-1"], "--profile-step-start must be >= 0; got -1."),
        (["--profile-step-start", "5", "--profile-step-end", "5"], "--profile-step-end 5 must be > --profile-step-start 5."),
        (["--profile-step-end", "3"], "--profile-step-end 3 must be > --profile-step-start 10."),  # Megatron-LM's default start
        (["--profile-ranks", "0", "1"], "--profile-ranks 1: the ranks run from 0 to 0 here."),
        (["--profile-ranks", "-1"], "--profile-ranks -1: the ranks run from 0 to 0 here."),
        (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler writes its trace next to --tensorboard-dir "
                                                  "(<dir>/../torch_profile, as Megatron-LM does); give --tensorboard-dir."),
        (["--start-weight-decay", "0.1"],
         "--start-weight-decay only applies with --weight-decay-incr-style linear or cosine"),
        (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"],
         "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay."),
        (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.3", "--end-weight-decay", "0.1"],
         "--end-weight-decay (0.1) must not be below --start-weight-decay (0.3)."),
        (["--qk-layernorm", "--qk-clip"], "--qk-clip is not offered with --qk-layernorm: the clip rescales W_q"),
        (["--tensorboard-queue-size", "0"], "--tensorboard-queue-size must be >= 1; got 0."),
        (["--use-rope-scaling", "--rotary-interleaved"],
         "--rotary-interleaved and --use-rope-scaling only apply with --position-embedding-type rope"),
        (["--position-embedding-type", "rope", "--rope-scaling-factor", "4"],
         "--rope-scaling-factor only applies with --use-rope-scaling."),
        (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0"],
         "--rotary-seq-len-interpolation-factor 0 must be a finite number > 0."),
        (["--swiglu", "--quick-geglu"], "--swiglu and --quick-geglu exclude each other (one activation)."),
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype can only be fp32 without --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
         "--main-grads-dtype bf16 only applies with --bf16."),
    ],
    ids=["gqa-groups-alone", "hidden-dropout", "attention-dropout", "init-std", "init-std-nan", "swiglu-tiny", "normalization",
         "wsd-without-iters", "wsd-too-long", "wsd-iters-without-wsd", "wsd-style", "warmup-fraction", "warmup-fraction-and-iters",
         "warmup-init", "tb-interval", "unknown", "fsdp2-fp16", "fsdp2-main-params-dtype", "rotary-without-rope", "rotary-percent",
         "position-embedding-type", "samples-and-iters", "iters-schedule-with-samples", "samples-schedule-alone",
         "too-few-samples", "ddp-bucket-size", "context-parallel", "grad-reduce-bf16-without-bf16",
         "gc-interval-without-gc", "gc-interval", "empty-cache-level", "no-position-embedding", "kv-channels", "norm-eps",
         "timeout", "fp8", "load-balancing-type", "load-balancing-without-experts", "profile-start", "profile-end",
         "profile-end-default-start", "profile-ranks", "profile-ranks-negative", "pytorch-profiler-without-tensorboard",
         "start-wd-with-constant", "wd-incr-one-end", "wd-decreasing", "qk-clip-with-qk-layernorm",
         "tensorboard-queue-size", "rope-flags-without-rope", "rope-factor-without-scaling",
         "interpolation-factor", "two-activations", "exp-avg-bf16", "bf16-grads-without-bf16"],
)
def test_bad_new_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, monkeypatch)
    assert exit_info.value.code == 2
    lines = _our_lines(capsys.readouterr().err)
    assert lines[-1].startswith("pretrain_gpt.py: error: ") and message in lines[-1], lines
    if "argument" not in message and "unrecognized" not in message:  # argparse adds its usage line
        assert len(lines) == 1, lines


def _built_model(rank: int, world_size: int, argv: list[str]) -> dict:
    import torch

    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.arguments.training import scheduler_config
    from megatron_eopt.training.parallel import layout as parallel_layout
    from megatron_eopt.training.model.gpt import build_gpt_model, destroy_model_parallel, initialize_model_parallel

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    args, settings, layout = parse_args(ADAM + argv)
    initialize_model_parallel(layout.tp, args.seed)
    try:
        model = build_gpt_model(settings, torch.device("cpu"))
        names = {name: tuple(p.shape) for name, p in model.named_parameters()}
        return {"names": names, "tied": model.output_layer.weight is None,
                "attention_dropout": model.decoder.layers[0].self_attention.core_attention.dropout_p,
                "norm_eps": {module.eps for module in model.modules() if isinstance(module, torch.nn.LayerNorm)},
                "rope": model.position_embedding_type}
    finally:
        destroy_model_parallel()


def test_flags_build_that_model(run_distributed) -> None:
    """The model itself: tied output layer, biases, SwiGLU's FFN size, GQA's key/value width."""
    (default,) = run_distributed(_built_model, 1, args=(["--swiglu", "--hidden-size", "96", "--num-attention-heads",
                                                         "4", "--group-query-attention", "--num-query-groups", "2",
                                                         "--attention-dropout", "0.1"],))
    names = default["names"]
    assert default["tied"] and not any(name.startswith("output_layer") for name in names), names
    assert names["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 256, 96)  # int(4 * 96 * 2 / 3 / 64) * 64 = 256, gated: two halves
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"] == (96 + 2 * 2 * 24, 96)  # q + 2 groups of k, v
    assert "decoder.layers.0.self_attention.linear_proj.bias" in names
    assert default["attention_dropout"] == 0.1
    (untied,) = run_distributed(_built_model, 1, args=(["--untie-embeddings-and-output-weights",
                                                        "--disable-bias-linear"],))
    assert not untied["tied"] and untied["names"]["output_layer.weight"] == (64, 64)
    assert not any(name.endswith(".bias") and "linear" in name for name in untied["names"]), untied["names"]
    assert default["norm_eps"] == {1e-5} and default["rope"] == "learned_absolute"
    (qkv_bias,) = run_distributed(_built_model, 1, args=(["--disable-bias-linear", "--add-qkv-bias", "--norm-epsilon",
                                                          "1e-6", "--use-rotary-position-embeddings"],))
    biases = sorted(name for name in qkv_bias["names"] if name.endswith(".bias") and "linear" in name)
    assert biases == ["decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.1.self_attention.linear_qkv.bias"]
    assert qkv_bias["norm_eps"] == {1e-6} and qkv_bias["rope"] == "rope"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seq-length", "15"], "--seq-length 15 must be divisible by --tensor-model-parallel-size 2 with sequence parallelism."),
    ],
    ids=["seq-length"],
)
def test_bad_sequence_parallel_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(["--tensor-model-parallel-size", "2", "--sequence-parallel"] + argv, monkeypatch, world_size=2)
    (line,) = _our_lines(capsys.readouterr().err)
    assert line.startswith(f"pretrain_gpt.py: error: {message}"), line


def test_sequence_parallel_is_off_at_one_tensor_parallel_rank(monkeypatch, capsys) -> None:
    """As in Megatron-LM, and said."""
    _, settings, _ = _parse(["--sequence-parallel"], monkeypatch)
    assert not settings.sequence_parallel
    assert "--sequence-parallel is off: it needs --tensor-model-parallel-size > 1" in capsys.readouterr().out
    _, settings, _ = _parse(["--sequence-parallel", "--tensor-model-parallel-size", "2"], monkeypatch, world_size=2)
    assert settings.sequence_parallel


@pytest.mark.parametrize("argv,message", [
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine needs CUDA and Transformer Engine"),
    (["--distributed-backend", "nccl"], "--distributed-backend nccl needs CUDA, and none is available"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0; got 0.0."),
    (["--attention-backend", "magic"], "argument --attention-backend: invalid choice: 'magic'"),
], ids=["te-on-cpu", "nccl-on-cpu", "exit-duration", "attention-backend"])
def test_bad_device_and_exit_flags(argv: list[str], message: str, monkeypatch, capsys) -> None:
    import torch

    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(SystemExit):
        _parse(argv, monkeypatch)
    assert message in _our_lines(capsys.readouterr().err)[-1]


def _run_printing(rank: int, world_size: int, argv: list[str]) -> tuple[list[dict], str]:
    """pretrain_gpt's records and what it printed."""
    import contextlib
    import io

    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        records = run_pretrain_gpt(rank, world_size, argv)
    return records, out.getvalue()


def test_megatron_lm_flags_without_effect_are_named_and_exit_duration_stops(run_distributed, tmp_path) -> None:
    """A Megatron-LM command line's kernel and bookkeeping flags run, each named in one line as
    changing nothing, and so are other optimizers' settings; --exit-duration-in-mins stops (after saving) once the time is past."""
    from megatron_eopt.training.arguments.no_effect import NO_EFFECT

    argv = ADAM + ["--train-iters", "5", "--log-interval", "1", "--transformer-impl", "local",
                   "--distributed-backend", "gloo", "--exit-duration-in-mins", "1e-9", "--save", str(tmp_path),
                   "--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
                   "--no-gradient-accumulation-fusion", "--use-flash-attn", "--attention-backend", "auto",
                   "--num-workers", "2", "--use-cpu-initialization", "--log-validation-ppl-to-tensorboard",
                   "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling", "--no-persist-layer-norm",
                   "--timing-log-level", "0", "--log-world-size-to-tensorboard", "--openai-gelu",
                   "--apply-residual-connection-post-layernorm", "--muon-momentum", "0.8", "--soap-shampoo-beta", "0.9"]
    (records, printed), = run_distributed(_run_printing, 1, args=(argv,))
    assert [r["iteration"] for r in records] == [1]
    assert "exiting after iteration 1 (--exit-duration-in-mins 1e-09:" in printed
    from megatron_eopt.checkpointing.storage import latest_checkpoint

    assert latest_checkpoint(str(tmp_path)).endswith("1"), latest_checkpoint(str(tmp_path))  # saved before exiting
    for flag in NO_EFFECT:
        if flag in argv:
            assert f"> {flag}" in printed and ": no effect, " in printed, flag
    assert "--num-workers 2: no effect, samples are read in the training process" in printed
    assert "> --log-world-size-to-tensorboard: no effect without --tensorboard-dir" in printed
    assert ("> --muon-momentum 0.8, --soap-shampoo-beta 0.9: no effect with --optimizer adam, which does not read "
            "them (they set other optimizers)") in printed  # as Megatron-LM's loop with ours installed says it


def test_log_throughput_and_pytorch_profiler_on_cpu(run_distributed, tmp_path) -> None:
    """One run, Megatron-LM's llama3 example's logging flags: --log-throughput's TFLOP/s/GPU on
    each line, in TensorBoard and the JSONL is the hand-counted FLOPs of the model built (--swiglu's
    default FFN, the query groups) over the interval's seconds per iteration; --profile
    --use-pytorch-profiler writes its trace where Megatron-LM does, holding iterations
    [--profile-step-start, --profile-step-end) and no other."""
    import gzip
    import json

    from megatron_eopt.training.curves import read_metrics
    from tests.unit.training.logging.test_performance import hand_count
    from tests.unit.training.logging.test_training_log import MEGATRON_LINE, _scalars

    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--swiglu", "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "4"]
    argv = ADAM + model + ["--train-iters", "4", "--log-interval", "2", "--log-throughput", "--profile",
                           "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
                           "--tensorboard-dir", str(tmp_path / "tb"), "--metrics-jsonl", str(tmp_path / "m.jsonl")]
    (records, printed), = run_distributed(_run_printing, 1, args=(argv,))
    # --swiglu's default FFN size: int(4 * 64 * 2 / 3 / 64) * 64 = 128; global batch 4 (one rank).
    flops = hand_count(batch=4, seq=16, layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=64, swiglu=True)
    assert [r["iteration"] for r in records] == [1, 2, 4]
    assert [r["throughput"] for r in records] == pytest.approx(
        [flops / (r["elapsed_ms"] / 1000 * 1e12) for r in records], rel=1e-12)
    lines = [match for match in map(MEGATRON_LINE.match, printed.splitlines()) if match]
    # Megatron-LM's one decimal from 1 TFLOP/s up; below, three significant digits (not 0.0).
    assert [float(m["throughput"]) for m in lines] == pytest.approx([r["throughput"] for r in records], rel=5e-3), printed
    assert all(len(m["throughput"].lstrip("0.")) == 3 for m in lines if float(m["throughput"]) < 1), printed
    assert [record["throughput"] for record in read_metrics(str(tmp_path / "m.jsonl"))[0]] == [
        r["throughput"] for r in records]
    tensorboard = _scalars(tmp_path / "tb")["throughput"]
    assert [(step, pytest.approx(value, rel=1e-6)) for step, value in tensorboard] == [
        (r["iteration"], r["throughput"]) for r in records]
    assert "> --log-throughput: TFLOP/s/GPU counts per process here" in printed
    with gzip.open(tmp_path / "torch_profile" / "rank-0.json.gz", "rt") as trace:  # <tensorboard dir>/../torch_profile
        events = json.load(trace)["traceEvents"]
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2"}, steps
    assert "torch.profiler records iteration 2 of this run on every rank" in printed


def _run_catching_exit(rank: int, world_size: int, argv: list[str]) -> tuple[object, str, str]:
    """(records, or the exit status; what was printed; what went to stderr)."""
    import contextlib
    import io

    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result = run_pretrain_gpt(rank, world_size, argv)
        except SystemExit as exit_info:
            result = exit_info.code
    return result, out.getvalue(), err.getvalue()


def test_model_only_checkpoint_without_rng(run_distributed, tmp_path) -> None:
    """--no-save-optim --no-save-rng (Megatron-LM): the checkpoint holds the model and no RNG
    states (the layer-wise broadcasts still in flight with --overlap-param-gather are waited for
    first); resuming it needs --no-load-optim, and says that no RNG state was restored."""
    import json

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_eopt.checkpointing.storage import MANIFEST, latest_checkpoint

    base = ADAM + ["--log-interval", "1", "--use-distributed-optimizer", "--overlap-param-gather"]
    saved, _, _ = run_distributed(_run_catching_exit, 1, args=(base + [
        "--train-iters", "2", "--save", str(tmp_path), "--no-save-optim", "--no-save-rng"],))[0]
    assert [r["iteration"] for r in saved] == [1, 2]
    path = latest_checkpoint(str(tmp_path))
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["optimizers"] is None and not manifest["has_scheduler"]
    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    assert keys and not any(key.startswith("rng/") for key in keys), sorted(keys)

    status, _, err = run_distributed(_run_catching_exit, 1, args=(base + ["--train-iters", "4", "--load", str(tmp_path)],))[0]
    assert status == 2 and "holds no optimizer state" in err and "--no-load-optim" in err, err
    resumed, printed, _ = run_distributed(_run_catching_exit, 1, args=(base + [
        "--train-iters", "4", "--load", str(tmp_path), "--no-load-optim"],))[0]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert "RNG states not restored: the checkpoint holds none" in printed


def _run_poisoned(rank: int, world_size: int, argv: list[str], iteration: int, value: float) -> tuple[object, str]:
    """(records, or the exit status; stderr) of a run with `value` put into one gradient element."""
    import contextlib
    import io

    from tests.pretrain_gpt_in_process import run_pretrain_gpt_with_overflow

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            result = run_pretrain_gpt_with_overflow(rank, world_size, argv, iteration, value)
        except SystemExit as exit_info:
            result = exit_info.code
    return result, err.getvalue()


def test_nan_gradient_stops_the_run_unless_told_to_skip(run_distributed) -> None:
    """Megatron-LM's --check-for-nan-in-loss-and-grad is on by default: a NaN in a gradient at
    iteration 2 stops the run there with one line; --no-check-for-nan-in-loss-and-grad skips that
    step (counted) and trains on. An inf (not NaN) is left to the optimizer's skip either way."""
    argv = ADAM + ["--train-iters", "3", "--log-interval", "1"]
    status, err = run_distributed(_run_poisoned, 1, args=(argv, 2, float("nan")))[0]
    assert status == 2 and "iteration 2: found NaN in the gradients (Megatron-LM's check;" in err, err
    records, _ = run_distributed(_run_poisoned, 1, args=(argv + ["--no-check-for-nan-in-loss-and-grad"], 2,
                                                         float("nan")))[0]
    assert [r["skipped"] for r in records] == [0, 1, 0], records
    records, _ = run_distributed(_run_poisoned, 1, args=(argv, 2, float("inf")))[0]
    assert [r["skipped"] for r in records] == [0, 1, 0], records


def test_distributed_timeout_reaches_the_process_group(monkeypatch) -> None:
    """--distributed-timeout-minutes is the timeout init_process_group gets (default 10, as
    Megatron-LM); the call is intercepted, no group is made."""
    import datetime

    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.arguments.training import scheduler_config
    import torch.distributed as dist

    from megatron_eopt.training.parallel import layout as parallel_layout

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for argv, minutes in (([], 10), (["--distributed-timeout-minutes", "60"], 60)):
        args, _, layout = _parse(argv + ["--distributed-backend", "gloo"], monkeypatch)
        parallel_layout.init_distributed(args, layout)
        assert calls[-1]["timeout"] == datetime.timedelta(minutes=minutes), calls
    # Plain `python` (no MASTER_ADDR): one process meets in an in-process store, on no port at all
    # (a free port picked then bound later raced with runs started beside it: EADDRINUSE).
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    parallel_layout.init_distributed(args, layout)
    assert isinstance(calls[-1]["store"], dist.HashStore) and "MASTER_PORT" not in os.environ, calls


def test_ranks_without_a_rendezvous_address_end_in_one_line(monkeypatch) -> None:
    """Two ranks from plain `python` (WORLD_SIZE 2, no MASTER_ADDR): torch's env:// ValueError ends
    in the trainer's one rendezvous line (fail, intercepted here), not a traceback."""
    import torch.distributed as dist

    from megatron_eopt.training.parallel import elastic, layout as parallel_layout

    lines = []
    monkeypatch.setattr(elastic, "fail", lambda rank, message: lines.append(message))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    args, _, layout = _parse(["--distributed-backend", "gloo"], monkeypatch, world_size=2)
    parallel_layout.init_distributed(args, layout)
    assert len(lines) == 1 and lines[0].startswith("the rendezvous of 2 ranks at ?:? failed after"), lines
    assert "MASTER_ADDR expected" in lines[0], lines


@pytest.mark.parametrize("argv,line", [
    (["--qk-clip-threshold", "50"], "--qk-clip-threshold 50: no effect without --qk-clip, the clip they set"),
    (["--log-max-attention-logit", "--qk-clip-threshold", "50", "--qk-clip-alpha", "0.3"],
     "--qk-clip-threshold 50 and --qk-clip-alpha 0.3: no effect without --qk-clip, the clip they set "
     "(--log-max-attention-logit only records the logits)"),
    (["--qk-clip", "--qk-clip-threshold", "50"], None),
    (["--use-precision-aware-optimizer", "--no-store-param-remainders"],
     "--no-store-param-remainders: no effect without --bf16: only bf16 parameters of the precision-aware optimizer "
     "keep their fp32 main weights as remainders"),
    (["--bf16", "--use-precision-aware-optimizer", "--no-store-param-remainders"], None),
    (["--fp16", "--use-precision-aware-optimizer"],
     "--use-precision-aware-optimizer with --fp16: parameter remainders (on by default) have no effect, they apply "
     "to bf16 parameters only; the main weights are --main-params-dtype fp32"),
    (["--multi-latent-attention", "--mscale", "0.7", "--mscale-all-dim", "0.5"],
     "--mscale 0.7 and --mscale-all-dim 0.5: no effect with --rotary-scaling-factor 1 (YaRN's mscale factors, "
     "0.1 * mscale * ln(factor) + 1, are 1 unless the factor exceeds 1, as in megatron-core)"),
    (["--multi-latent-attention", "--rope-type", "rope", "--mscale-all-dim", "0.5"],
     "--mscale-all-dim 0.5: no effect with --rotary-scaling-factor 1"),
    (["--multi-latent-attention", "--rope-type", "rope", "--rotary-scaling-factor", "4"],
     "--rotary-scaling-factor 4: no effect with --rope-type rope without --mscale-all-dim (it scales YaRN's "
     "frequencies, and MLA's softmax only through --mscale-all-dim)"),
    (["--multi-latent-attention", "--rotary-scaling-factor", "4", "--mscale", "0.7"], None),
    (["--multi-latent-attention", "--rope-type", "rope", "--rotary-scaling-factor", "4", "--mscale-all-dim", "1"],
     None),
], ids=["qk-threshold", "qk-settings-logging", "qk-clip", "remainders-fp32", "remainders-bf16", "remainders-fp16",
        "mscale-factor-1", "mscale-all-dim-rope", "rope-scaling-factor", "yarn-scaled", "rope-softmax-scaled"])
def test_flags_this_combination_leaves_without_effect_are_named(argv: list[str], line, monkeypatch) -> None:
    """The start-up lines of flags the others make change nothing (say_setup prints no_effect_lines)."""
    from megatron_eopt.training.arguments.no_effect import combination_lines, no_effect_lines

    args, _, _ = _parse(argv, monkeypatch)
    lines = no_effect_lines(args)
    assert lines == combination_lines(args)  # none of the always-inert flags given
    if line is None:
        assert lines == [], lines
    else:
        assert len(lines) == 1 and lines[0].startswith(line), lines
