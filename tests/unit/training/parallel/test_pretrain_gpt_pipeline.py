"""Pipeline parallelism in scripts/pretrain_gpt.py (issue #13): every pipeline layout trains as the
single-process PP=1 run does.

Reference: the same command line in a one-process world (no pipeline, no TP, no DP). Compared, to
1e-5 relative over 6 fp32 iterations (gradient norms 1e-4): the training losses, the gradient
norms, the parameter norms (--log-params-norm: summed over TP x PP, the tied output copy counted once) and the
validation losses (evaluation runs through the pipeline too), for adam, muon and muon with the
layer-wise distributed optimizer (at PP=2 x DP=2 also with --overlap-param-gather), at PP=2,
PP=2 with 2 model chunks per rank (interleaved 1F1B), TP=2 x PP=2 and PP=2 x DP=2; and at PP=2 with uneven splits, one of which leaves the last stage
without a transformer layer (so without a Muon matrix). Embeddings are tied (the default), so the
tied gradient sum across the first and last stage is exercised everywhere.
"""

import os

import pytest

from tests.pretrain_gpt_in_process import run_pretrain_gpt

ITERATIONS = 6
# Relative. Losses: the bound. Gradient norms: TP's split matmuls sum in another order, and
# a gradient is a small difference of large terms (TP=2 x PP=2 muon: 1.4e-5 at iteration 10 of a 10-iteration run).
TOLERANCE = {"loss": 1e-5, "validation": 1e-5, "grad_norm": 1e-4, "params_norm": 1e-5, "load_balancing_loss": 1e-5}
ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--lr", "1e-2",
        "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--log-params-norm",
        "--muon-fp32-matmul-prec", "highest", "--swiglu", "--ffn-hidden-size", "64"]
OPTIMIZERS = {"adam": ["--optimizer", "adam"], "muon": ["--optimizer", "muon"],
              "muon layer-wise": ["--optimizer", "muon", "--use-distributed-optimizer"]}
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {  # name: (world size, flags)
    "PP=2": (2, PP2),
    "PP=2, 2 chunks per rank": (2, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "TP=2 x PP=2": (4, PP2 + ["--tensor-model-parallel-size", "2"]),
    "PP=2 x DP=2": (4, PP2),
}
UNEVEN = {  # muon only: the splits change which stage holds which matrices
    "first stage 1 layer": PP2 + ["--decoder-first-pipeline-num-layers", "1"],
    "embedding and loss counted": PP2 + ["--account-for-embedding-in-pipeline-split",
                                         "--account-for-loss-in-pipeline-split"],
    "last stage without layers": PP2 + ["--pipeline-model-parallel-layout", "Et*4|L"],
}


def run_training(rank: int, world_size: int, argv: list[str]) -> dict[str, list[float]]:
    """pretrain_gpt's logged curves and every validation loss it computed (on this rank)."""
    from megatron_eopt.training.loop import evaluation

    validation: list[float] = []
    original = evaluation.evaluate

    def evaluate(*args, **kwargs) -> float:
        validation.append(original(*args, **kwargs))
        return validation[-1]

    evaluation.evaluate = evaluate
    try:
        records = run_pretrain_gpt(rank, world_size, argv)
    finally:
        evaluation.evaluate = original
    curves = {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
              "params_norm": [r["params_norm"] for r in records], "validation": validation}
    if "load_balancing_loss" in records[0]:  # MoE (tests/unit/training/model/test_pretrain_gpt_moe.py)
        curves["load_balancing_loss"] = [r["load_balancing_loss"] for r in records]
    return curves


@pytest.fixture(scope="module")
def references(run_distributed) -> dict[str, dict[str, list[float]]]:
    return {name: run_distributed(run_training, 1, args=(ARGV + flags,))[0] for name, flags in OPTIMIZERS.items()}


def _assert_same_training(curves_per_rank: list[dict[str, list[float]]], reference: dict[str, list[float]]) -> None:
    assert len(reference["loss"]) == ITERATIONS and reference["loss"][-1] < reference["loss"][0]
    assert len(reference["validation"]) == 3  # iterations 3 and 6, and the final validation
    for curves in curves_per_rank:  # every rank logs the same (the last stage's loss, broadcast)
        for key, expected in reference.items():
            assert curves[key] == pytest.approx(expected, rel=TOLERANCE[key]), key


# TP=2 x PP=2 (4 ranks, ~12 s) in `make test-slow`: `make test` trains it with sequence parallelism
# against one process (test_pretrain_gpt_sequence_parallel.py).
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.slow] if name == "TP=2 x PP=2" else [])
                                    for name in LAYOUTS])
def test_pipeline_layouts_train_as_one_process(layout: str, references, run_distributed) -> None:
    world_size, flags = LAYOUTS[layout]
    for name, optimizer_flags in OPTIMIZERS.items():
        records = run_distributed(run_training, world_size, args=(ARGV + optimizer_flags + flags,))
        _assert_same_training(records, references[name])
    if layout == "PP=2 x DP=2":
        # The layer-wise parameter broadcasts left to each chunk's next forward (and waited for
        # by evaluation and by --log-params-norm, which reads every parameter).
        overlap = OPTIMIZERS["muon layer-wise"] + ["--overlap-param-gather"]
        _assert_same_training(run_distributed(run_training, world_size, args=(ARGV + overlap + flags,)),
                              references["muon layer-wise"])


def test_uneven_pipeline_splits_train_as_one_process(references, run_distributed) -> None:
    for flags in UNEVEN.values():
        records = run_distributed(run_training, 2, args=(ARGV + OPTIMIZERS["muon"] + flags,))
        _assert_same_training(records, references["muon"])


def test_rope_under_tensor_and_pipeline_parallelism(run_distributed) -> None:
    """RoPE (on CPU through megatron_eopt/training/model/cpu_gpt_model.py's substitution) on every stage: TP=2 x PP=2
    equals one process."""
    rope = ARGV + OPTIMIZERS["muon"] + ["--position-embedding-type", "rope", "--rotary-percent", "0.5"]
    reference = run_distributed(run_training, 1, args=(rope,))[0]
    _assert_same_training(run_distributed(run_training, 4, args=(rope + LAYOUTS["TP=2 x PP=2"][1],)), reference)


@pytest.mark.parametrize("precision", [["--bf16", "--optimizer", "muon"], ["--fp16", "--optimizer", "adam"]],
                         ids=["bf16 muon (fp32 main_grad)", "fp16 adam (loss scale)"])
def test_half_precision_pipeline_trains_as_one_process(precision: list[str], run_distributed) -> None:
    """16-bit models through the pipeline: the tied-embedding sum reads the fp32 main_grad, and
    the fp16 loss scale multiplies the loss on the last stage (the first iterations are skipped
    until the scale fits, on every stage alike). Not bitwise: at PP=1 the tied weight's two
    gradients (lookup and output layer) are summed by autograd in 16 bits, at PP=2 each stage's in
    its own fp32 main_grad and then in fp32 (measured: 1.2e-4 bf16, 3.3e-5 fp16)."""
    # 6 iterations, no evaluation: 16-bit matmuls are slow on CPUs without bf16 instructions.
    argv = ARGV + precision + ["--train-iters", "6", "--eval-iters", "0"] + \
        ["--initial-loss-scale", "4096"] * ("--fp16" in precision)
    reference = run_distributed(run_training, 1, args=(argv,))[0]
    assert len(reference["loss"]) == 6 and reference["loss"][-1] < reference["loss"][0]
    for curves in run_distributed(run_training, 2, args=(argv + PP2,)):
        assert curves["loss"] == pytest.approx(reference["loss"], rel=1e-3)


def _stage_layers(rank: int, world_size: int, argv: list[str]) -> list[list[int]]:
    """The global numbers of the transformer layers in each of this rank's model chunks."""
    import torch

    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.model.gpt import build_gpt_model_chunks, destroy_model_parallel, initialize_model_parallel

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    args, settings, layout = parse_args(["--optimizer", "adam", "--lr", "1e-3"] + argv)
    initialize_model_parallel(layout.tp, args.seed, pipeline_model_parallel_size=layout.pp,
                              virtual_pipeline_model_parallel_size=layout.vpp)
    try:
        chunks = build_gpt_model_chunks(settings, torch.device("cpu"))
        return [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("flags,expected", [
    (PP2, [[[1, 2]], [[3, 4]]]),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], [[[1], [3]], [[2], [4]]]),
    (PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"], [[[1], [3]], [[2], [4]]]),
    (UNEVEN["first stage 1 layer"], [[[1]], [[2, 3, 4]]]),
    (UNEVEN["embedding and loss counted"], [[[1, 2]], [[3, 4]]]),  # (4 + 2) / 2 = 3 a stage, E and L one each
    (UNEVEN["last stage without layers"], [[[1, 2, 3, 4]], [[]]]),
    (PP2 + ["--pipeline-model-parallel-layout", "Et|t|t|tL"], [[[1], [3]], [[2], [4]]]),
])
def test_pipeline_flags_split_the_layers(flags: list[str], expected, run_distributed) -> None:
    assert run_distributed(_stage_layers, 2, args=(ARGV + flags,)) == expected


def _parse(argv: list[str], world_size: int, monkeypatch):
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return parse_args(["--optimizer", "adam", "--lr", "1e-3"] + argv)


@pytest.mark.parametrize("argv,message", [
    (["--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3 must be >= 1 and divide"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size 0 must be >= 1"),
    (["--num-layers", "3"] + PP2, "--num-layers 3 must be divisible by --pipeline-model-parallel-size 2 x 1"),
    (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "3"] + PP2,
     "--num-layers-per-virtual-pipeline-stage 3 must be >= 1 and divide the layers per pipeline rank"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank", "2"] + PP2,
     "give one"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], "--num-virtual-stages-per-pipeline-rank needs "
                                                      "--pipeline-model-parallel-size > 1"),
    (["--num-layers", "4", "--decoder-first-pipeline-num-layers", "5"] + PP2, "must split evenly"),
    (["--num-layers", "4", "--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"] + PP2,
     "exclude --account-for-embedding/loss-in-pipeline-split"),
    (["--num-layers", "4", "--account-for-embedding-in-pipeline-split"] + PP2,
     "--num-layers 4 + 1 for the embedding must be divisible"),
    (["--num-layers", "2", "--pipeline-model-parallel-layout", "Et*3|L"] + PP2,
     "--pipeline-model-parallel-layout 'Et*3|L' does not fit"),
    (["--pipeline-model-parallel-layout", "Et|L", "--decoder-first-pipeline-num-layers", "1"] + PP2,
     "it excludes --decoder-first-pipeline-num-layers"),
    (["--use-torch-fsdp2"] + PP2, "--use-torch-fsdp2 does not support --pipeline-model-parallel-size > 1"),
], ids=["pp-not-dividing", "pp-zero", "layers-not-dividing", "layers-per-chunk", "both-chunk-flags",
        "chunks-without-pp", "first-too-many", "first-and-accounting", "accounting-not-dividing", "bad-layout",
        "layout-and-first", "fsdp2"])
def test_bad_pipeline_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, 4, monkeypatch)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines


LAYOUT_STRINGS = ["Et|t|t|tL", "Et*3|L", "E(tt|)*2L", "Ettt|(tt|)*2,L", "Et*2|t*2|L", "E,t,t|t,tL", "tE|ttL", "Et|tL|L",
           "EttL", "E|tttt|L|", "Etx|ttL", "Et|tm|tL", "(Et|)*2ttL", "Et*4|L|E", "E|t*4L"]


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_layout_strings_are_read_as_megatron_core_reads_them(pp: int) -> None:
    """layout_stages/check_layout (torch-free) against megatron-core's PipelineParallelLayerLayout,
    the reference: the same strings fit, with the same model chunks per rank; the others fail."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_eopt.training.arguments.pipeline import check_layout, layout_stages

    for text in LAYOUT_STRINGS:
        try:
            reference = PipelineParallelLayerLayout(text, pp)
            reference.validate_layer_layout(num_layers=4, mtp_num_layers=None)
            expected = reference.virtual_pipeline_model_parallel_size
        except (AssertionError, ValueError, KeyError):
            expected = None
        try:
            stages = layout_stages(text)
            check_layout(stages, pp, 4)
            got = len(stages) // pp
        except ValueError:
            got = None
        assert got == expected, (text, pp)


@pytest.mark.parametrize("saved,loaded", [
    ((2, OPTIMIZERS["muon layer-wise"] + PP2), (1, OPTIMIZERS["muon"])),
    ((1, OPTIMIZERS["adam"]), (2, OPTIMIZERS["adam"] + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"])),
], ids=["PP2 layer-wise -> PP1", "PP1 -> PP2 interleaved"])
def test_checkpoint_moves_between_pipeline_layouts(saved, loaded, references, run_distributed, tmp_path) -> None:
    """Saved at iteration 3 in one layout, resumed in another: iterations 4-6 are the reference's."""
    (saved_world, saved_flags), (loaded_world, loaded_flags) = saved, loaded
    reference = references["muon" if "muon" in saved_flags else "adam"]
    checkpoints = ["--save", str(tmp_path), "--load", str(tmp_path)]
    first = run_distributed(run_training, saved_world, args=(ARGV + saved_flags + checkpoints + ["--exit-interval", "3"],))
    assert first[0]["loss"] == pytest.approx(reference["loss"][:3], rel=1e-5)
    for curves in run_distributed(run_training, loaded_world, args=(ARGV + loaded_flags + checkpoints,)):
        assert curves["loss"] == pytest.approx(reference["loss"][3:], rel=1e-5)
        assert curves["validation"] == pytest.approx(reference["validation"][1:], rel=1e-5)
