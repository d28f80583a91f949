"""Megatron-LM's own `pretrain()` loop on CPU (gloo, 2 ranks) with megatron_eopt's optimizer.

scripts/pretrain_gpt_megatron_lm.py runs Megatron-LM's loop through megatron_eopt/runtime/
megatron_lm_cpu.py when CUDA is absent. A tiny GPT (2 layers, hidden 64, 4 heads, seq 32, rope,
global batch 8 of micro-batches of 2, 6 iterations, dropout 0 unless said) runs in the harness's workers
(tests/megatron_lm_in_process.py: ~2 s a run, imports paid once); its launches under torchrun
(restarts, faults) are in test_megatron_lm_faults.py. Every expectation comes from another run:
megatron-core's own optimizer (`--megatron-core-optimizer`, the loop without `install()`), or the
same run without interruption.
Losses are what the loop hands its logger ('lm loss' averaged over micro-batches and DP ranks).

- Same math as megatron-core: Adam, distributed Adam (`--use-distributed-optimizer --bf16`), and
  layer-wise Muon (`--optimizer muon --use-distributed-optimizer`) with
  `--bf16` (megatron-core's layer-wise optimizer fails in fp32: it chains a bare TensorParallelMuon,
  which has no `get_loss_scale`), give megatron-core's losses. `--clip-grad 0` there: the gradient
  norm is summed in another order by each implementation (1 ulp apart, checked to 1e-6), and a
  clipping factor from it would move every later step by that ulp.
- Exact resume: `--save` at iteration 3 (`--exit-interval 3`), `--load` to 6 equals the run that
  was not interrupted at iterations 4-6 (losses, gradient norms, learning rates), and ends with the
  same parameters and optimizer state on every rank, bitwise, for `--ckpt-format torch_dist`
  (dp_reshardable and `--dist-ckpt-optim-fully-reshardable`) and `--ckpt-format torch`.
  Every iteration is equal, with dropout too: on CPU dropout draws from the patch's "CUDA"
  generator, which Megatron-LM checkpoints apart from the CPU one. (Drawn from the CPU generator,
  the masks moved after a resume: a DataLoader draws its seed from it when its iterator starts.)
  Megatron-LM's printed log line is not equal: it logs a run's first iteration without resetting
  its averages, so the second printed iteration after a restart (5 here) shows the mean of
  iterations 4 and 5; test_megatron_lm_faults.py checks that from the printed lines.
- TP=2 and PP=2; MoE at EP=2; jobs moving from megatron-core to us and back (see each test).
"""

import pathlib

import pytest
import torch

from tests.megatron_lm_in_process import Run, run_megatron_lm_many, run_megatron_lm_refused

ROOT = pathlib.Path(__file__).resolve().parents[2]
ITERATIONS, SAVED_AT = 6, 3
MODEL = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope "
    f"--micro-batch-size 2 --global-batch-size 8 --train-iters {ITERATIONS} --lr 1e-3 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --attention-dropout 0 --hidden-dropout 0 --num-workers 0 "
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--distributed-backend gloo"
).split()
MEGATRON_CORE = ["--megatron-core-optimizer"]
NO_CLIP = ["--clip-grad", "0"]
OPTIMIZERS = {
    "adam": ["--optimizer", "adam"],
    "muon": ["--optimizer", "muon"],
    "layer-wise muon": ["--optimizer", "muon", "--use-distributed-optimizer"],
    "distributed adam": ["--optimizer", "adam", "--use-distributed-optimizer", "--bf16"],
    "adam with dropout": ["--optimizer", "adam", "--attention-dropout", "0.1", "--hidden-dropout", "0.1"],
}
FORMATS = {
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist fully_reshardable": ["--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"],
    "torch": ["--ckpt-format", "torch"],
}
# The fully reshardable layout is the distributed optimizer's: each optimizer with the formats it has
# (distributed Adam's torch_dist resumes: test_a_job_moves_from_megatron_core_and_back).
RESUMES = {"adam": ("torch_dist", "torch"), "muon": ("torch_dist", "torch"),
           "layer-wise muon": ("torch_dist", "torch_dist fully_reshardable", "torch"),
           "distributed adam": ("torch",), "adam with dropout": ("torch_dist",)}


def _runs(run_distributed, *flag_lists: list[str], world_size: int = 2) -> list[list[Run]]:
    """Each command line on 2 ranks (or `world_size`), in one call to the workers: per run, each rank's Run."""
    per_rank = run_distributed(run_megatron_lm_many, world_size, args=([MODEL + flags for flags in flag_lists],),
                               timeout=600)
    return [list(runs) for runs in zip(*per_rank)]


def _saving_at_3(directory: str) -> list[str]:
    """Save at SAVED_AT to `directory`, and stop there."""
    return ["--save", directory, "--save-interval", str(SAVED_AT), "--exit-interval", str(SAVED_AT)]


def _column(run: Run, key: str, iterations) -> list:
    by_iteration = {record["iteration"]: record[key] for record in run.records}
    return [by_iteration.get(i) for i in iterations]


def _assert_same_math(ours: list[Run], theirs: list[Run], our_package: str = "megatron_eopt") -> None:
    """Bitwise equal losses and learning rates; gradient norms to 1e-6 (summed in other orders)."""
    every = range(1, ITERATIONS + 1)
    assert [r.optimizer_package for r in ours + theirs] == [our_package] * len(ours) + ["megatron"] * len(theirs)
    for mine, reference in zip(ours, theirs):
        assert _column(mine, "lm loss", every) == _column(reference, "lm loss", every)
        assert _column(mine, "learning rate", every) == _column(reference, "learning rate", every)
        assert _column(mine, "grad norm", every) == pytest.approx(_column(reference, "grad norm", every), rel=1e-6)
    losses = _column(ours[-1], "lm loss", every)  # the last pipeline stage's
    assert losses[-1] < losses[0] - 0.2, losses  # it learns: not two runs that do nothing


def test_adam_equals_megatron_cores_adam(run_distributed) -> None:
    ours, theirs = _runs(run_distributed, OPTIMIZERS["adam"] + NO_CLIP, OPTIMIZERS["adam"] + NO_CLIP + MEGATRON_CORE)
    _assert_same_math(ours, theirs)


def _assert_equal_tensors(mine, reference, where: str) -> None:
    if isinstance(mine, dict):
        assert mine.keys() == reference.keys(), where
        for key in mine:
            _assert_equal_tensors(mine[key], reference[key], f"{where}.{key}")
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(reference), where
        for i, (a, b) in enumerate(zip(mine, reference)):
            _assert_equal_tensors(a, b, f"{where}[{i}]")
    elif torch.is_tensor(mine):
        assert torch.equal(mine, reference), where
    else:
        assert mine == reference, where


def _state_dtypes(state) -> set:
    """The dtypes of the tensors anywhere in `state` (nested dicts and lists)."""
    if isinstance(state, dict):
        return set().union(*map(_state_dtypes, state.values()))
    if isinstance(state, (list, tuple)):
        return set().union(*map(_state_dtypes, state))
    return {state.dtype} if torch.is_tensor(state) else set()


@pytest.mark.parametrize("optimizer", RESUMES)
def test_resume_continues_exactly(run_distributed, tmp_path, optimizer: str) -> None:
    flags = OPTIMIZERS[optimizer]
    command_lines = [flags]
    for name in RESUMES[optimizer]:
        directory = str(tmp_path / name.replace(" ", "_"))
        command_lines += [flags + FORMATS[name] + _saving_at_3(directory), flags + FORMATS[name] + ["--load", directory]]
    straight, *interrupted = _runs(run_distributed, *command_lines)
    for name, saved, resumed in zip(RESUMES[optimizer], interrupted[::2], interrupted[1::2]):
        _assert_resumed_exactly(straight, saved, resumed, f"{optimizer}, {name}")


def _assert_resumed_exactly(straight: list[Run], saved: list[Run], resumed: list[Run], where: str) -> None:
    """Saved at SAVED_AT and stopped; resumed, equal to the run not interrupted from there on, to the
    last bit of every rank's parameters and optimizer state."""
    after = range(SAVED_AT + 1, ITERATIONS + 1)
    for rank, (first, mine, reference) in enumerate(zip(saved, resumed, straight)):
        where_rank = f"{where}, rank {rank}"
        assert first.exit_status == 0 and _column(first, "iteration", range(1, ITERATIONS + 1)) == [
            1, 2, 3, None, None, None], where_rank  # it stopped at the save
        assert [r["iteration"] for r in mine.records] == list(after), where_rank  # it went on from the save
        for key in ("lm loss", "grad norm", "learning rate"):
            assert _column(mine, key, after) == _column(reference, key, after), f"{where_rank}: {key}"
        assert mine.parameters and mine.optimizer_state, where_rank  # something to compare
        _assert_equal_tensors(mine.parameters, reference.parameters, f"{where_rank}: parameters")
        _assert_equal_tensors(mine.optimizer_state, reference.optimizer_state, f"{where_rank}: optimizer state")
        assert mine.optimizer_package == reference.optimizer_package, where_rank


EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
MODEL_PARALLEL = {
    "muon at TP=2": ["--optimizer", "muon", "--tensor-model-parallel-size", "2"],
    "adam at PP=2": ["--optimizer", "adam", "--pipeline-model-parallel-size", "2"],
}


def test_tensor_and_pipeline_parallel_equal_megatron_core_and_resume_exactly(run_distributed, tmp_path) -> None:
    """At TP=2 (Muon: megatron-core's TensorParallelMuon against ours) and at PP=2 (Adam; the last
    stage logs the loss), 2 ranks each: megatron-core's losses, and a torch_dist resume at 3 that
    ends equal to the run not interrupted."""
    command_lines = []
    for name, flags in MODEL_PARALLEL.items():
        directory = str(tmp_path / name.replace(" ", "_"))
        command_lines += [flags + NO_CLIP, flags + NO_CLIP + MEGATRON_CORE,
                          flags + NO_CLIP + _saving_at_3(directory), flags + NO_CLIP + ["--load", directory]]
    runs = _runs(run_distributed, *command_lines)
    for index, name in enumerate(MODEL_PARALLEL):
        ours, theirs, saved, resumed = runs[4 * index:4 * index + 4]
        _assert_same_math(ours, theirs)
        _assert_resumed_exactly(ours, saved, resumed, name)


REFUSED = {  # a command line the loop refuses, and what its one line says
    "ours, in validate_args": (["--optimizer", "dist_muon", "--use-megatron-fsdp"],
                               "--optimizer dist_muon is the layer-wise distributed optimizer"),
    "ours, building the optimizer": (["--optimizer", "muon", "--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                      "--ckpt-format", "torch_dist"], "use --ckpt-format torch_dcp"),
    "ours, --qk-clip without Transformer Engine": (["--optimizer", "muon", "--qk-clip", "--qk-clip-alpha", "1.0"],
                                                   "--qk-clip-alpha must be in (0, 1)"),
    "Megatron-LM's flag check": (["--optimizer", "adam", "--use-torch-fsdp2"],
                                 "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    "Megatron-LM's parser": (["--optimizer", "adam", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
}


# A resume whose lr schedule differs from the checkpoint's (megatron-core asserts in its scheduler's
# load): saved at 2 of 4 iterations decaying over 4, loaded with --train-iters 6 (MODEL's), so decaying
# over 6 (in samples, x the global batch of 8). The load also carries flags of other optimizers, named
# as without effect, and QK-clip's, which Megatron-LM's argument dump must show on.
SCHEDULE_SAVED = ["--optimizer", "adam", "--train-iters", "4", "--lr-decay-iters", "4", "--save-interval", "2",
                  "--exit-interval", "2"]
OTHER_OPTIMIZERS = ["--muon-momentum", "0.8", "--soap-shampoo-beta", "0.9"]
QK_CLIP_ON = ["--qk-clip", "--qk-clip-threshold", "100", "--log-max-attention-logit"]
SCHEDULE_REFUSED = (["--optimizer", "adam"] + OTHER_OPTIMIZERS + QK_CLIP_ON,
                    "the checkpoint's lr schedule has total number of iterations 32, this command line gives 48")


def test_refusals_are_one_line_on_rank_zero_and_status_2_on_every_rank(run_distributed, tmp_path) -> None:
    """As our trainer's: rank 0 prints `pretrain_gpt_megatron_lm.py: error: ...` and nothing else of
    ours, rank 1 nothing; both exit with 2 instead of raising (a traceback on every rank). Last, a
    checkpoint is saved and loaded with another lr schedule (SCHEDULE_REFUSED)."""
    checkpoint = ["--save", str(tmp_path / "schedule")]
    refused = {**REFUSED, "megatron-core's lr-schedule check on --load": (
        SCHEDULE_REFUSED[0] + ["--load", checkpoint[1]], SCHEDULE_REFUSED[1])}
    argvs = [MODEL + SCHEDULE_SAVED + checkpoint] + [MODEL + flags for flags, _ in refused.values()]
    per_rank = run_distributed(run_megatron_lm_refused, 2, args=(argvs,), timeout=600)
    for rank, (saved, *results) in enumerate(per_rank):
        assert saved[0] == 0, (rank, saved[1][-2000:])
        for (name, (_, message)), (status, stderr, _) in zip(refused.items(), results):
            errors = [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
            assert status == 2, (name, rank, status, stderr[-2000:])
            if rank == 0:
                assert len(errors) == 1 and errors[0].startswith("pretrain_gpt_megatron_lm.py: error: "), errors
                assert message in errors[0], (name, errors)
            else:
                assert errors == [], (name, errors)
    schedule = per_rank[0][-1][1]
    assert "--override-opt_param-scheduler" in schedule and "--use-checkpoint-opt_param-scheduler" in schedule
    _assert_printed_as_run(per_rank[0][-1][2])


def _assert_printed_as_run(stdout: str) -> None:
    """Rank 0's start-up of SCHEDULE_REFUSED: Megatron-LM's argument dump shows QK-clip on, as it runs
    (install()'s validate_args checks it as ours with it off inside), and one line names the flags of
    other optimizers as without effect with adam."""
    dump = {line.split()[0]: line.split()[-1] for line in stdout.splitlines() if " ...." in line}
    assert (dump["qk_clip"], dump["log_max_attention_logit"], dump["optimizer"]) == ("True", "True", "adam"), dump
    unread = [line for line in stdout.splitlines() if "no effect with --optimizer" in line]
    assert unread == ["megatron_eopt: --muon-momentum 0.8, --soap-shampoo-beta 0.9: no effect with --optimizer "
                      "adam, which does not read them (they set other optimizers)"], unread


# ---------------------------------------------------------------- jobs moving between megatron-core and us

MOVES = {  # optimizer: (flags, the torch_dist formats it moves through)
    "distributed adam": (OPTIMIZERS["distributed adam"] + NO_CLIP, ("torch_dist", "torch_dist fully_reshardable")),
    # dp_reshardable torch_dist: also test_experts_equal_megatron_core_resume_exactly_and_move_both_ways
    # (the same flags with experts; its dense parameters move the same way), so the dense one is slow.
    "layer-wise muon": (OPTIMIZERS["layer-wise muon"] + ["--bf16"] + NO_CLIP, ("torch_dist fully_reshardable",)),
    "layer-wise muon, dp_reshardable": (OPTIMIZERS["layer-wise muon"] + ["--bf16"] + NO_CLIP, ("torch_dist",)),
}
SLOW_MOVES = ("layer-wise muon, dp_reshardable",)


@pytest.mark.parametrize("optimizer", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_MOVES else [])
                                       for name in MOVES])
def test_a_job_moves_from_megatron_core_and_back(run_distributed, tmp_path, optimizer: str) -> None:
    """Ours first gives megatron-core's losses (_assert_same_math; layer-wise Muon: rope, where
    megatron-core sends a learned position table to Muon, we send it to Adam, a lookup table;
    distributed Adam: install()'s factory hands Adam on reduce-scattered gradients to megatron-core's
    DistributedOptimizer, megatron_eopt/distributed/reduce_scattered.py, built from our config, in
    bf16: megatron-core's fp32 DistributedOptimizer shards `model_param.view(-1)` without detaching
    it, so autograd holds its DDP's hooks and the process groups outlive the run in these workers).

    megatron-core's optimizer trains and saves at 3 (the loop without install()); ours loads it
    with --load and continues as megatron-core continuing itself, bitwise (losses and learning
    rates of iterations 4-6; gradient norms to 1e-6, summed in another order); then ours saves
    at 3 and megatron-core loads that and continues the same. Layer-wise Muon: megatron-core's
    chain over Megatron-LM's all-reducing DDP writes each child keyed by parameter
    (MEGATRON_CORE_PING_PONG_LAYOUT), and so do we.
    Distributed Adam: ours is megatron-core's DistributedOptimizer built from our config.
    megatron-core continuing itself equals the run not interrupted (with torch's Adam, after the
    load fixes of megatron_core_torch_adam.distributed_optimizer_loads_with_torch_adam)."""
    flags, formats = MOVES[optimizer]
    command_lines = [flags + MEGATRON_CORE, flags]
    for name in formats:
        theirs, ours = (str(tmp_path / f"{who}_{name.replace(' ', '_')}") for who in ("theirs", "ours"))
        command_lines += [flags + FORMATS[name] + MEGATRON_CORE + _saving_at_3(theirs),
                          flags + FORMATS[name] + ["--load", theirs],
                          flags + FORMATS[name] + MEGATRON_CORE + ["--load", theirs],
                          flags + FORMATS[name] + _saving_at_3(ours),
                          flags + FORMATS[name] + MEGATRON_CORE + ["--load", ours]]
    straight, ours_straight, *moves = _runs(run_distributed, *command_lines)
    our_package = "megatron" if optimizer == "distributed adam" else "megatron_eopt"
    _assert_same_math(ours_straight, straight, our_package)
    for index, name in enumerate(formats):
        _assert_moved(straight, *moves[5 * index:5 * index + 5], our_package, f"{optimizer}, {name}")


def _assert_moved(straight: list[Run], saved: list[Run], moved_in: list[Run], core_resumed: list[Run],
                  ours_saved: list[Run], moved_out: list[Run], our_package: str, where: str) -> None:
    """megatron-core saved at 3 (`saved`); ours continued that (`moved_in`) as megatron-core did
    (`core_resumed`, itself equal to its run not interrupted, `straight`); ours saved at 3
    (`ours_saved`) and megatron-core continued that (`moved_out`) the same."""
    after = range(SAVED_AT + 1, ITERATIONS + 1)
    for rank in range(len(saved)):
        where_rank = f"{where}, rank {rank}"
        assert saved[rank].optimizer_package == "megatron" and ours_saved[rank].optimizer_package == our_package
        assert [r["iteration"] for r in saved[rank].records] == [1, 2, 3], where_rank
        assert moved_in[rank].optimizer_package == our_package, where_rank
        for key in ("lm loss", "grad norm", "learning rate"):
            expected = _column(core_resumed[rank], key, after)
            assert None not in expected, where_rank
            ours_expected = pytest.approx(expected, rel=1e-6) if key == "grad norm" else expected
            assert _column(moved_in[rank], key, after) == ours_expected, f"{where_rank}: in, {key}"
            assert _column(moved_out[rank], key, after) == expected, f"{where_rank}: out, {key}"
            assert expected == _column(straight[rank], key, after), f"{where_rank}: megatron-core's resume, {key}"


def test_experts_equal_megatron_core_resume_exactly_and_move_both_ways(run_distributed, tmp_path) -> None:
    """4 experts at EP=2 with layer-wise Muon in bf16 (each rank steps its own 2 experts, the dense
    parameters split between the ranks), 2 ranks, one call: ours gives megatron-core's losses,
    resumes from a torch_dist save at 3 equal to its run not interrupted (every rank's parameters
    and state bitwise), and a job moves from megatron-core to us and back (as
    test_a_job_moves_from_megatron_core_and_back). megatron-core's chain there holds the dense and
    the expert parameters of one optimizer together, ours apart (megatron_core_formats/layer_wise_optimizer.py)."""
    flags = OPTIMIZERS["layer-wise muon"] + ["--bf16"] + EXPERTS + NO_CLIP + FORMATS["torch_dist"]
    theirs, ours = str(tmp_path / "theirs"), str(tmp_path / "ours")
    (core_straight, ours_straight, saved, moved_in, core_resumed, ours_saved, moved_out,
     ours_resumed) = _runs(run_distributed, flags + MEGATRON_CORE, flags, flags + MEGATRON_CORE + _saving_at_3(theirs),
                           flags + ["--load", theirs], flags + MEGATRON_CORE + ["--load", theirs],
                           flags + _saving_at_3(ours), flags + MEGATRON_CORE + ["--load", ours],
                           flags + ["--load", ours])
    _assert_same_math(ours_straight, core_straight)
    _assert_resumed_exactly(ours_straight, ours_saved, ours_resumed, "MoE")
    _assert_moved(core_straight, saved, moved_in, core_resumed, ours_saved, moved_out, "megatron_eopt", "MoE")


TORCH_FSDP2 = ["--use-torch-fsdp2", "--ckpt-format", "torch_dcp", "--untie-embeddings-and-output-weights", "--bf16"]


def test_torch_fsdp2_with_torch_dcp_equals_megatron_core_and_resumes_exactly(run_distributed, tmp_path) -> None:
    """`--use-torch-fsdp2 --ckpt-format torch_dcp` at 2 ranks: Adam gives megatron-core's Adam's
    losses (megatron-core refuses emerging optimizers on FSDP2), and Adam and Muon resume from a
    torch_dcp checkpoint at 3 equal to the run not interrupted, to the last bit of every rank's
    shards of the parameters and optimizer state."""
    theirs, ours = _fully_sharded_runs(run_distributed, tmp_path, TORCH_FSDP2, "torch FSDP2")
    _assert_same_math(ours, theirs)


# megatron-core's OptimizerConfig takes these with its own Adam only (and Transformer Engine); ours
# with every optimizer (install()'s _optimizer_config_replacement).
BF16_MOMENTS = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def _fully_sharded_runs(run_distributed, tmp_path, engine: list[str], engine_name: str,
                        clip: list[str] = NO_CLIP) -> tuple:
    """megatron-core's Adam on `engine`; ours, with Adam and with Muon (bf16 moments), each also
    saved at 3 and resumed, checked equal to the run not interrupted. Returns (megatron-core's
    Adam, our Adam)."""
    command_lines = [OPTIMIZERS["adam"] + clip + engine + MEGATRON_CORE]
    for name in ("adam", "muon"):
        flags = OPTIMIZERS[name] + clip + engine + (BF16_MOMENTS if name == "muon" else [])
        command_lines += [flags, flags + _saving_at_3(str(tmp_path / name)), flags + ["--load", str(tmp_path / name)]]
    theirs, *runs = _runs(run_distributed, *command_lines)
    for index, name in enumerate(("adam", "muon")):
        straight, saved, resumed = runs[3 * index:3 * index + 3]
        _assert_resumed_exactly(straight, saved, resumed, f"{name} on {engine_name}")
    assert torch.bfloat16 in _state_dtypes(runs[3][0].optimizer_state), engine_name  # Muon's bf16 moments
    return theirs, runs[0]



# --swiglu: Megatron-LM's fsdp_dtensor checkpointing splits linear_fc1 into halves, state included
# (with install(): integrations/megatron_lm_swiglu.py; Muon's momentum_buffer is split too).
MEGATRON_FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--untie-embeddings-and-output-weights",
                 "--swiglu", "--no-bias-swiglu-fusion", "--bf16"]  # the fusion compiles a kernel per process


@pytest.mark.slow  # the MoE test below checks the same on the same engine, with experts
def test_megatron_fsdp_with_fsdp_dtensor_equals_megatron_core_and_resumes_exactly(run_distributed, tmp_path) -> None:
    """`--use-megatron-fsdp --ckpt-format fsdp_dtensor` at 2 ranks: Adam gives megatron-core's Adam's
    losses bitwise and its gradient norms (ours did not learn before its step put the shards into
    Megatron-FSDP's compute weights), and Adam and Muon resume from an fsdp_dtensor checkpoint at 3
    equal to the run not interrupted, to the last bit of every rank's shards. `--clip-grad 1e9`:
    megatron-core computes the norm only when clipping (with 0 it logs 0.0), and 1e9 never clips."""
    theirs, ours = _fully_sharded_runs(run_distributed, tmp_path, MEGATRON_FSDP, "Megatron-FSDP",
                                       clip=["--clip-grad", "1e9"])
    _assert_same_math(ours, theirs)


# The MoE command line on Megatron-FSDP: bias-free experts, tokens all-gathered.
MEGATRON_FSDP_EXPERTS = MEGATRON_FSDP + EXPERTS + ["--moe-token-dispatcher-type", "allgather",
                                                   "--disable-bias-linear", "--clip-grad", "1e9"]


def test_experts_on_megatron_fsdp_checkpoint_in_megatron_cores_fsdp_dtensor_layout(run_distributed, tmp_path) -> None:
    """4 experts at EP=2 on Megatron-FSDP in bf16, `--ckpt-format fsdp_dtensor`, 2 ranks, one call.
    Adam: ours gives megatron-core's losses; megatron-core's checkpoint at 3 continues on ours as on
    megatron-core, and ours on megatron-core as on ours (both name each expert by its global index,
    params/expert_names.py). Muon (bf16 moments) resuming exactly from its own fsdp_dtensor
    checkpoint on this engine with experts: the DeepSeek-style case (test_megatron_lm_deepseek_case.py)."""
    adam = OPTIMIZERS["adam"] + MEGATRON_FSDP_EXPERTS
    theirs, ours = str(tmp_path / "theirs"), str(tmp_path / "ours")
    (core_straight, ours_straight, saved, moved_in, core_resumed, ours_saved, moved_out, ours_resumed) = _runs(
        run_distributed, adam + MEGATRON_CORE, adam, adam + MEGATRON_CORE + _saving_at_3(theirs),
        adam + ["--load", theirs], adam + MEGATRON_CORE + ["--load", theirs], adam + _saving_at_3(ours),
        adam + MEGATRON_CORE + ["--load", ours], adam + ["--load", ours])
    _assert_same_math(ours_straight, core_straight)
    # On CPU Megatron-FSDP's device is the CPU's throughout (runtime/megatron_lm_cpu.py): no warning that it differs.
    device_warnings = [w for run in ours_straight + core_straight for w in run.warnings if "instead of the current" in w]
    assert not device_warnings, device_warnings[0]
    _assert_resumed_exactly(ours_straight, ours_saved, ours_resumed, "Adam, MoE on Megatron-FSDP")
    _assert_moved(core_straight, saved, moved_in, core_resumed, ours_saved, moved_out, "megatron_eopt",
                  "MoE on Megatron-FSDP")


# The other optimizers with `yes` in the README's FSDP column (adam: the test above; muon: the DeepSeek-style case).
OTHER_FULLY_SHARDED = ("adaptive_muon", "laprop", "lion", "mop", "polargrad", "scion", "sgd")


@pytest.mark.slow
def test_every_fully_sharded_optimizer_resumes_experts_from_fsdp_dtensor_exactly(run_distributed, tmp_path) -> None:
    """As the Muon case above, for each other optimizer the sharded engines take (~9 s each)."""
    command_lines = []
    for name in OTHER_FULLY_SHARDED:
        flags, directory = ["--optimizer", name] + MEGATRON_FSDP_EXPERTS, str(tmp_path / name)
        command_lines += [flags, flags + _saving_at_3(directory), flags + ["--load", directory]]
    runs = _runs(run_distributed, *command_lines)
    for index, name in enumerate(OTHER_FULLY_SHARDED):
        _assert_resumed_exactly(*runs[3 * index:3 * index + 3], f"{name}, MoE on Megatron-FSDP")


# Tensor parallelism on Megatron-FSDP (4 ranks): parameters TP splits sit on its 2-D (dp, tp) mesh,
# each TP rank's part split by rows over dp. Dense TP=2 x FSDP=2, and the MoE above at EP=2 x expert
# TP=2 (TP=1: megatron-core's MoE refuses TP > 1 without sequence parallelism, which its CPU norms lack).
MEGATRON_FSDP_TP2 = MEGATRON_FSDP + ["--tensor-model-parallel-size", "2", "--clip-grad", "1e9"]
MEGATRON_FSDP_EXPERT_TP2 = MEGATRON_FSDP_EXPERTS + ["--expert-tensor-parallel-size", "2"]


@pytest.mark.slow  # 9 runs on 4 ranks (283 s at load 20); in make test once issue 83's matrix replaces per-layout tests
def test_tensor_parallel_megatron_fsdp_checkpoints_move_between_megatron_core_and_ours(run_distributed,
                                                                                      tmp_path) -> None:
    """`--use-megatron-fsdp --tensor-model-parallel-size 2 --bf16 --ckpt-format fsdp_dtensor` on 4
    ranks, one call: its 2-D (dp, tp) DTensor state in megatron-core's layout, `linear_fc1` split into
    SwiGLU halves. Adam: megatron-core's checkpoint at 3 continues on ours as on megatron-core, and
    ours on megatron-core as on ours (hence ours gave megatron-core's losses to 3); Muon resumes from
    its own checkpoint equal to the run not interrupted, every rank's shards bitwise (Muon and the
    other optimizers at TP x Megatron-FSDP against one process: tests/unit/library/distributed/test_fsdp2.py)."""
    adam, muon = OPTIMIZERS["adam"] + MEGATRON_FSDP_TP2, OPTIMIZERS["muon"] + MEGATRON_FSDP_TP2
    theirs, ours, muons = (str(tmp_path / name) for name in ("theirs", "ours", "muon"))
    (core_straight, saved, moved_in, core_resumed, ours_saved, moved_out, muon_straight, muon_saved,
     muon_resumed) = _runs(run_distributed, adam + MEGATRON_CORE, adam + MEGATRON_CORE + _saving_at_3(theirs),
                           adam + ["--load", theirs], adam + MEGATRON_CORE + ["--load", theirs],
                           adam + _saving_at_3(ours), adam + MEGATRON_CORE + ["--load", ours],
                           muon, muon + _saving_at_3(muons), muon + ["--load", muons], world_size=4)
    _assert_moved(core_straight, saved, moved_in, core_resumed, ours_saved, moved_out, "megatron_eopt",
                  "Adam at TP=2 x Megatron-FSDP=2")
    _assert_resumed_exactly(muon_straight, muon_saved, muon_resumed, "Muon at TP=2 x Megatron-FSDP=2")


@pytest.mark.slow  # ~30 s on 4 ranks; its checkpoints' test above also holds ours to megatron-core's losses
def test_adam_on_megatron_fsdp_with_tensor_parallelism_equals_megatron_cores(run_distributed) -> None:
    """`--use-megatron-fsdp --tensor-model-parallel-size 2 --bf16` on 4 ranks: our Adam gives
    megatron-core's Adam's losses bitwise and its gradient norms (Muon and the other optimizers at
    TP x Megatron-FSDP against one process: tests/unit/library/distributed/test_fsdp2.py)."""
    flags = OPTIMIZERS["adam"] + MEGATRON_FSDP_TP2
    ours, theirs = _runs(run_distributed, flags, flags + MEGATRON_CORE, world_size=4)
    _assert_same_math(ours, theirs)


@pytest.mark.slow  # ~3 min on 4 ranks; the dense test above checks the same layout in make test
def test_adam_on_megatron_fsdp_with_expert_tensor_parallelism_equals_megatron_cores(run_distributed, tmp_path) -> None:
    """4 experts at EP=2 x expert TP=2 on Megatron-FSDP in bf16 (4 ranks, Megatron-FSDP's 2-D expert
    mesh), one call: our Adam gives megatron-core's Adam's losses bitwise and its gradient norms;
    megatron-core's fsdp_dtensor checkpoint at 3 continues on ours as on megatron-core, and ours on
    megatron-core the same; Muon resumes equal to the run not interrupted (against one process:
    tests/unit/library/distributed/test_fsdp2_experts.py)."""
    adam, muon = OPTIMIZERS["adam"] + MEGATRON_FSDP_EXPERT_TP2, OPTIMIZERS["muon"] + MEGATRON_FSDP_EXPERT_TP2
    theirs, ours, muons = (str(tmp_path / name) for name in ("theirs", "ours", "muon"))
    (ours_straight, core_straight, saved, moved_in, core_resumed, ours_saved, moved_out, muon_straight, muon_saved,
     muon_resumed) = _runs(run_distributed, adam, adam + MEGATRON_CORE, adam + MEGATRON_CORE + _saving_at_3(theirs),
                           adam + ["--load", theirs], adam + MEGATRON_CORE + ["--load", theirs],
                           adam + _saving_at_3(ours), adam + MEGATRON_CORE + ["--load", ours],
                           muon, muon + _saving_at_3(muons), muon + ["--load", muons], world_size=4)
    _assert_same_math(ours_straight, core_straight)
    _assert_moved(core_straight, saved, moved_in, core_resumed, ours_saved, moved_out, "megatron_eopt",
                  "Adam at EP=2 x expert TP=2 on Megatron-FSDP")
    _assert_resumed_exactly(muon_straight, muon_saved, muon_resumed, "Muon at EP=2 x expert TP=2 on Megatron-FSDP")
