"""scripts/pretrain_gpt.py with --num-experts (issue 13): expert parallelism against one process.

Reference: the same command line in one process (EP=1, every expert local, no gradient
reduction). Against it, 6 iterations at EP=2 (2 ranks: DP 2, expert DP 1) and EP=2 x DP=2
(4 ranks: expert DP 2), with Muon (gradients reduced by megatron_eopt/training/parallel/grad_reduction.py), layer-wise
Muon (reduced onto owners by the optimizer) and Adam, to 1e-5 relative: the layouts sum the same
gradients in another order. Gradient accumulation differs too (4, 2 and 1 micro-batches per
rank), which the aux loss runs (--moe-aux-loss-coeff) depend on through megatron's aux-loss
scale. Parameter norms (--log-params-norm) to 1e-5 too: each expert counted once, over the
expert model-parallel group. The runs also record the Newton-Schulz calls (expert matrices go to Muon, equal shapes in
one batched call per step), and the EP=2 layer-wise run saves a checkpoint that a one-process
run resumes. With tensor parallelism (and --sequence-parallel, which megatron-core's MoELayer
needs there): TP=2, TP=2 x EP=2 (the dispatcher gathers over all 4 ranks), TP=2 x DP=2 and
TP=2 x PP=2 against one process, with validation and SwiGLU experts, checkpoints resumed in one process, and one
backward's expert and router gradients against TP=1's. Then each MoE flag's bad values: one line
on stderr naming the flag.
"""

import re

import pytest
import torch

from tests.newton_schulz_calls import recording_newton_schulz_calls
from tests.pretrain_gpt_in_process import run_pretrain_gpt
from tests.unit.training.parallel.test_pretrain_gpt_pipeline import _assert_same_training, run_training

ITERATIONS, SAVED_AT = 6, 3
# 2 MoE layers x 4 experts; each expert an fc1 [128, 32] and an fc2 [32, 128] (no other matrix
# has these shapes: attention blocks are 32 x 32, the router 4 x 32).
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--lr", "1e-2",
        "--log-interval", "1", "--eval-iters", "0", "--disable-bias-linear", "--num-experts", "4",
        "--moe-router-topk", "2", "--muon-fp32-matmul-prec", "highest", "--log-params-norm"]
EXPERT_SHAPES = ((128, 32), (32, 128))
EXPERTS_PER_RANK = {1: 2 * 4, 2: 2 * 2, 4: 2 * 2}  # by world size: layers x local experts (EP 1, 2, 2)
AUX = ["--moe-aux-loss-coeff", "0.1"]
RUNS = {
    "muon": ["--optimizer", "muon"],
    "layer-wise muon, aux loss": ["--optimizer", "muon", "--use-distributed-optimizer", *AUX],
    "adam, aux loss": ["--optimizer", "adam", *AUX],
}


def run_recording_newton_schulz(rank: int, world_size: int, argv: list[str]) -> tuple[list[dict], list[tuple]]:
    """`run_pretrain_gpt`, also returning the shape of every Newton-Schulz call on this rank."""
    with recording_newton_schulz_calls() as calls:
        return run_pretrain_gpt(rank, world_size, argv), calls


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _grad_norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


def _params_norms(records: list[dict]) -> list[float]:
    return [r["params_norm"] for r in records]


def _load_balancing(records: list[dict]) -> list[float]:
    return [r["load_balancing_loss"] for r in records]


def _layout(world_size: int) -> list[str]:
    return [] if world_size == 1 else ["--expert-model-parallel-size", "2"]


def _check_expert_calls(name: str, world_size: int, per_rank_calls: list[list[tuple]]) -> None:
    """Expert matrices go to Muon, each shape in one batched (3-D) call per step on each rank
    that steps any; each expert matrix orthogonalized once per step on every rank holding it,
    or with the layer-wise optimizer once per expert data-parallel group (on its owner)."""
    expert_dp = {1: 1, 2: 1, 4: 2}[world_size]
    held = EXPERTS_PER_RANK[world_size] * world_size  # expert matrices of one shape over all ranks
    expected = held // expert_dp if "layer-wise" in name else held
    for shape in EXPERT_SHAPES:
        calls = [[c for c in rank_calls if c[-2:] == shape] for rank_calls in per_rank_calls]
        assert all(len(c) == 3 for rank_calls in calls for c in rank_calls), (name, world_size, calls)
        assert all(len(rank_calls) in (0, ITERATIONS) for rank_calls in calls), (name, world_size, calls)
        assert sum(c[0] for rank_calls in calls for c in rank_calls) == expected * ITERATIONS, (name, world_size, calls)


def test_expert_parallel_layouts_equal_one_process(run_distributed, tmp_path):
    checkpoint = str(tmp_path / "ep2")
    results = {}
    for world_size in (1, 2, 4):
        for name, flags in RUNS.items():
            argv = ARGV + flags + _layout(world_size)
            if world_size == 2 and name.startswith("layer-wise"):
                argv += ["--save", checkpoint, "--save-interval", str(SAVED_AT)]
            results[name, world_size] = run_distributed(run_recording_newton_schulz, world_size, args=(argv,))
    resumed = run_distributed(run_pretrain_gpt, 1, args=(ARGV + RUNS["layer-wise muon, aux loss"] + [
        "--load", checkpoint, "--ckpt-step", str(SAVED_AT)],))[0]

    differences = {}
    for name in RUNS:
        reference = _losses(results[name, 1][0][0])
        assert len(reference) == ITERATIONS and reference[-1] < reference[0]
        # Muon and Adam hardly see a gradient's scale; the norm does (e.g. experts summed but not
        # divided by the data-parallel size). 1e-4: expert gradients are summed in another order
        # at EP=2 (measured up to 1.8e-5 for adam with the aux loss; a scale error is >= 0.3).
        reference_norms = _grad_norms(results[name, 1][0][0])
        for world_size in (2, 4):
            per_rank = results[name, world_size]
            for records, _ in per_rank:
                assert _losses(records) == pytest.approx(reference, rel=1e-5), (name, world_size)
                assert _grad_norms(records) == pytest.approx(reference_norms, rel=1e-4), (name, world_size)
                # Each expert counted once (EP=2 rank alone holds half of them: 11% off).
                assert _params_norms(records) == pytest.approx(_params_norms(results[name, 1][0][0]), rel=1e-5)
                # Megatron-LM's logged load-balancing loss: per layer and micro-batch, averaged
                # over data parallelism (0 without an aux loss, as Megatron-LM logs it).
                assert _load_balancing(records) == pytest.approx(_load_balancing(results[name, 1][0][0]), rel=1e-5)
            differences[name, world_size] = (
                max(abs(a / b - 1) for a, b in zip(_losses(per_rank[0][0]), reference)),
                max(abs(a / b - 1) for a, b in zip(_grad_norms(per_rank[0][0]), reference_norms)))
        if "muon" in name:
            for world_size in (1, 2, 4):
                _check_expert_calls(name, world_size, [calls for _, calls in results[name, world_size]])
    print("max relative (loss, grad norm) difference against one process:", differences)
    # The switch load-balancing loss is E / (topk T^2) * sum_e tokens_e * probs_e: 1 for a
    # uniform router, a little above it while training balances the experts.
    assert set(_load_balancing(results["muon", 1][0][0])) == {0.0}
    balancing = _load_balancing(results["adam, aux loss", 1][0][0])
    assert all(1.0 <= value < 1.5 for value in balancing), balancing
    # The aux loss changes training by far more than the tolerance (else the runs above could
    # not tell a wrong aux-loss scale).
    muon, with_aux = _losses(results["muon", 1][0][0]), _losses(results["layer-wise muon, aux loss", 1][0][0])
    assert max(abs(a / b - 1) for a, b in zip(with_aux, muon)) > 1e-3
    # The EP=2 checkpoint of iteration SAVED_AT, resumed in one process, continues as the reference.
    reference = _losses(results["layer-wise muon, aux loss", 1][0][0])
    assert [r["iteration"] for r in resumed] == list(range(SAVED_AT + 1, ITERATIONS + 1))
    assert _losses(resumed) == pytest.approx(reference[SAVED_AT:], rel=1e-5)
    print("resumed at EP=1 from EP=2, max relative loss difference:",
          max(abs(a / b - 1) for a, b in zip(_losses(resumed), reference[SAVED_AT:])))


# Flags -------------------------------------------------------------------------------------------

MOE = ["--num-experts", "4", "--disable-bias-linear"]


def _parse_error(argv: list[str], world_size: int, monkeypatch, capsys) -> list[str]:
    """parse_args's stderr lines for `argv` (it must exit with status 2)."""
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--optimizer", "adam", "--lr", "1.0"] + argv)
    assert exit_info.value.code == 2
    return [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]


@pytest.mark.parametrize(
    "argv,world_size,message",
    [
        (["--num-experts", "-1"], 1, "--num-experts must be >= 1 (or 0 for dense MLPs); got -1."),
        (MOE + ["--moe-router-topk", "1"], 1, "--moe-router-topk 1 with the softmax score needs --moe-router-pre-softmax"),
        (MOE + ["--moe-router-topk", "5"], 1, "--moe-router-topk must be in [1, --num-experts 4]; got 5"),
        (["--moe-router-topk", "2"], 1, "--moe-router-topk only applies with --num-experts"),
        (MOE + ["--expert-model-parallel-size", "3"], 4,
         "--expert-model-parallel-size 3 must be >= 1 and divide --num-experts 4 and the data-parallel size 4."),
        (MOE + ["--expert-model-parallel-size", "4"], 2,
         "--expert-model-parallel-size 4 must be >= 1 and divide --num-experts 4 and the data-parallel size 2."),
        (MOE + ["--expert-model-parallel-size", "0"], 1, "--expert-model-parallel-size 0 must be >= 1"),
        (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 only applies with --num-experts"),
        (MOE + ["--moe-aux-loss-coeff", "-0.1"], 1, "--moe-aux-loss-coeff must be a finite number >= 0; got -0.1."),
        (MOE + ["--moe-aux-loss-coeff", "nan"], 1, "--moe-aux-loss-coeff must be a finite number >= 0; got nan."),
        (["--moe-aux-loss-coeff", "0.01"], 1, "--moe-aux-loss-coeff only applies with --num-experts"),
        (["--moe-token-dispatcher-type", "allgather", "--moe-router-topk", "2"], 1,
         "--moe-router-topk and --moe-token-dispatcher-type only apply with --num-experts"),
        (MOE + ["--tensor-model-parallel-size", "2"], 2,
         "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel"),
        (MOE + ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
         "--use-torch-fsdp2 does not support --num-experts with --tensor-model-parallel-size > 1"),
        (MOE + ["--expert-tensor-parallel-size", "2"], 1,
         "--expert-tensor-parallel-size 2: only the tensor-parallel size (1) is offered"),
        (["--expert-tensor-parallel-size", "1"], 1, "--expert-tensor-parallel-size 1 only applies with --num-experts"),
        (MOE + ["--recompute-activations", "--recompute-modules", "moe", "--calculate-per-token-loss"], 1,
         "--calculate-per-token-loss with --num-experts is not offered"),
    ],
    ids=["experts", "topk-1", "topk-above-experts", "topk-alone", "ep-experts", "ep-dp", "ep-0", "ep-alone",
         "aux-negative", "aux-nan", "aux-alone", "two-alone", "tp", "fsdp2", "etp", "etp-alone", "per-token"],
)
def test_bad_moe_flags_exit_with_one_line(argv, world_size, message, monkeypatch, capsys) -> None:
    lines = _parse_error(argv, world_size, monkeypatch, capsys)
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines


def test_bad_dispatcher_choice_names_the_flag(monkeypatch, capsys) -> None:
    lines = _parse_error(MOE + ["--moe-token-dispatcher-type", "flex"], 1, monkeypatch, capsys)
    assert "argument --moe-token-dispatcher-type: invalid choice: 'flex'" in lines[-1], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusals; CUDA runs megatron-core's own modules")
@pytest.mark.parametrize("argv,message", [
    (["--moe-token-dispatcher-type", "alltoall"], "--moe-token-dispatcher-type alltoall needs CUDA"),
    (["--num-experts", "4"], "--num-experts on CPU needs --disable-bias-linear"),
], ids=["alltoall", "bias"])
def test_cpu_refusals_name_the_flag(argv, message, monkeypatch, capsys) -> None:
    argv = argv if "--num-experts" in argv else MOE + argv
    lines = _parse_error(argv, 1, monkeypatch, capsys)
    assert len(lines) == 1 and message in lines[0], lines


def test_moe_flags_reach_the_settings(monkeypatch) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    _, settings, layout = parse_args(["--optimizer", "adam", "--lr", "1.0", *MOE, "--moe-router-topk", "3",
                                                   "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"])
    assert (layout.ep, layout.dp) == (2, 4)
    assert (settings.num_moe_experts, settings.moe_router_topk, settings.moe_aux_loss_coeff) == (4, 3, 0.01)
    assert settings.moe_token_dispatcher_type == "allgather"
    _, dense, layout = parse_args(["--optimizer", "adam", "--lr", "1.0", "--num-experts", "0"])
    assert dense.num_moe_experts is None and layout.ep == 1  # Megatron-LM: 0 experts is a dense model


# The CPU substitutions refuse what they cannot do ------------------------------------------------

def _moe_config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                             use_cpu_initialization=True, **fields)


def test_cpu_router_refuses_quantile_balancing() -> None:
    from megatron_eopt.training.model.moe import CPUTopKRouter

    with pytest.raises(ValueError, match=re.escape("CPUTopKRouter does not support "
                                                   "moe_router_load_balancing_type='quantile_balancing'")):
        CPUTopKRouter(_moe_config(moe_router_load_balancing_type="quantile_balancing"))


def test_cpu_moe_layer_refuses_alltoall() -> None:
    from megatron_eopt.training.model.moe import CPUMoELayer

    with pytest.raises(ValueError, match="moe_token_dispatcher_type='alltoall' needs CUDA"):
        CPUMoELayer(_moe_config(moe_token_dispatcher_type="alltoall"))


def test_experts_through_the_pipeline_equal_one_process(run_distributed) -> None:
    """EP=2 x PP=2 (4 ranks, one MoE layer a stage; megatron_eopt/training/parallel/pipeline.py) with the aux loss, whose
    gradient scale follows the pipeline's micro-batches: the one-process losses and norms."""
    argv = ARGV + RUNS["layer-wise muon, aux loss"]
    reference = run_distributed(run_pretrain_gpt, 1, args=(argv,))[0]
    pipelined = run_distributed(run_pretrain_gpt, 4, args=(argv + _layout(2) + ["--pipeline-model-parallel-size", "2"],))
    for records in pipelined:
        assert _losses(records) == pytest.approx(_losses(reference), rel=1e-5)
        assert _grad_norms(records) == pytest.approx(_grad_norms(reference), rel=1e-4)
        assert _params_norms(records) == pytest.approx(_params_norms(reference), rel=1e-5)
        assert _load_balancing(records) == pytest.approx(_load_balancing(reference), rel=1e-5)


# Tensor parallelism (with sequence parallelism, as megatron-core's MoELayer needs) ---------------

SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# Validation at iterations 3 and 6 and after training (what _assert_same_training compares), and
# SwiGLU experts: each expert's fc1 holds gate and up rows, split over expert TP block by block.
TP_ARGV = ARGV[:ARGV.index("--eval-iters")] + ARGV[ARGV.index("--eval-iters") + 2:] + [
    "--eval-interval", str(SAVED_AT), "--eval-iters", "1", "--swiglu"]
TP_LAYOUTS = {  # name: (world size, flags); TP x EP gathers the tokens of all 4 ranks
    "TP=2": (2, SP),
    "TP=2 x EP=2": (4, SP + _layout(2)),
    "TP=2 x DP=2": (4, SP),
    "TP=2 x PP=2": (4, SP + ["--pipeline-model-parallel-size", "2"]),  # one MoE layer a stage
}


# `make test` runs Muon; the aux-loss runs (~24 s) are in `make test-slow`: the router's aux losses train
# the same at TP=2 with sequence parallelism, EP=2 and PP=2 in test_pretrain_gpt_moe_router.py, and the
# layer-wise optimizer with experts equals one process in test_pipeline_expert_optimizer.py.
@pytest.mark.parametrize("name,layouts", [
    ("muon", ("TP=2", "TP=2 x EP=2")),
    pytest.param("layer-wise muon, aux loss", ("TP=2 x EP=2", "TP=2 x DP=2"), marks=pytest.mark.slow),
    pytest.param("adam, aux loss", ("TP=2", "TP=2 x PP=2"), marks=pytest.mark.slow),
], ids=["muon", "layer-wise-muon-aux", "adam-aux"])
def test_tensor_parallel_experts_train_as_one_process(name, layouts, run_distributed, tmp_path) -> None:
    """6 iterations at TP=2 with sequence parallelism (x EP=2, DP=2, PP=2): the one-process losses,
    validation losses and parameter norms to 1e-5, gradient norms to 1e-4 (expert matrices split
    over expert TP: Muon orthogonalizes whole matrices, the norms count each shard once). The
    first layout saves a checkpoint at iteration 3 that a one-process run resumes."""
    argv = TP_ARGV + RUNS[name]
    reference = run_distributed(run_training, 1, args=(argv,))[0]
    checkpoint = str(tmp_path / "tp2")
    for index, layout in enumerate(layouts):
        world_size, flags = TP_LAYOUTS[layout]
        save = ["--save", checkpoint, "--save-interval", str(SAVED_AT)] if index == 0 else []
        _assert_same_training(run_distributed(run_training, world_size, args=(argv + flags + save,)), reference)
    resumed = run_distributed(run_pretrain_gpt, 1, args=(argv + ["--load", checkpoint, "--ckpt-step", str(SAVED_AT)],))[0]
    assert [r["iteration"] for r in resumed] == list(range(SAVED_AT + 1, ITERATIONS + 1))
    assert _losses(resumed) == pytest.approx(reference["loss"][SAVED_AT:], rel=1e-5)


def _moe_grads(rank: int, world_size: int, tp: int, sum_over_tp: bool) -> tuple[int, dict]:
    """(TP rank, gradients of the MoE layer's parameters) after one backward of a one-layer
    model with the aux loss, the sequence-parallel ones (router) summed over TP when asked."""
    from megatron.core import parallel_state

    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, gpt_loss, initialize_model_parallel
    from megatron_eopt.training.model.moe import start_step
    from megatron_eopt.training.parallel.grad_reduction import tensor_parallel_partial_params
    from megatron_eopt.training.parallel.sequence_parallel import sum_grads_over_tensor_parallel

    initialize_model_parallel(tp, seed=3)
    try:
        model = build_gpt_model(GPTModelSettings(num_layers=1, swiglu=False, sequence_parallel=tp > 1,
                                                 num_moe_experts=4, moe_aux_loss_coeff=0.1))
        start_step(torch.ones(()), num_micro_batches=1)
        tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
        gpt_loss(model, tokens).backward()
        if sum_over_tp:
            sum_grads_over_tensor_parallel(tensor_parallel_partial_params([model]), parallel_state.get_tensor_model_parallel_group())
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if ".mlp." in name}
        return parallel_state.get_tensor_model_parallel_rank(), grads
    finally:
        destroy_model_parallel()


def test_tensor_parallel_moe_gradients_are_the_one_process_gradients(run_distributed) -> None:
    """At TP=2 (sequence parallel) each rank's expert gradients are its shards of the TP=1 ones
    (fc1 rows, fc2 columns: the dispatcher brought it every token of the TP group), with no sum;
    the router's gradient covers this rank's tokens only (not TP=1's) until summed over TP."""
    ((_, full),) = run_distributed(_moe_grads, 1, args=(1, False))
    alone = run_distributed(_moe_grads, 2, args=(2, False))
    summed = run_distributed(_moe_grads, 2, args=(2, True))
    router = "decoder.layers.0.mlp.router.weight"
    experts = [name for name in full if ".local_experts." in name]
    assert len(experts) == 8 and router in full
    for (tp_rank, grads), (_, summed_grads) in zip(alone, summed):
        assert not torch.allclose(grads[router], full[router], atol=1e-6)
        torch.testing.assert_close(summed_grads[router], full[router], rtol=1e-5, atol=1e-7)
        for name in experts:
            dim = 0 if "linear_fc1" in name else 1  # column- and row-parallel
            torch.testing.assert_close(grads[name], full[name].chunk(2, dim=dim)[tp_rank], rtol=1e-5, atol=1e-7)
