"""Megatron-LM's own `pretrain()` loop on CPU (gloo) with megatron_eopt's optimizer.

scripts/pretrain_gpt_megatron_lm.py runs Megatron-LM's loop through megatron_eopt/runtime/
megatron_lm_cpu.py when CUDA is absent. A tiny GPT (2 layers, hidden 64, 4 heads, seq 32, rope,
global batch 8 of micro-batches of 2, 6 iterations, dropout 0 unless said) runs in the harness's workers
(tests/megatron_lm_in_process.py: ~2 s a run, imports paid once); its launches under torchrun
(restarts, faults) are in test_megatron_lm_faults.py. Every expectation comes from another run:
megatron-core's own optimizer (`--megatron-core-optimizer`, the loop without `install()`), or the
same run without interrupting it.
Losses are what the loop hands its logger ('lm loss' averaged over micro-batches and DP ranks).

- The parity matrix (tests/megatron_lm_matrix.py): engines x layouts x precisions x checkpoint
  formats x moves against megatron-core's optimizer, one test per cell part; the selected parts run
  in one call to the workers per world size. `make test` runs the cells marked for it (every engine,
  format and move once), `make test-slow` the rest. docs/megatron-lm.md shows the table.
- Exact resume: `--save` at iteration 3, `--load` to 6 equals the run that was not interrupted at
  iterations 4-6 (losses, gradient norms, learning rates), and ends with the same parameters and
  optimizer state on every rank, bitwise. In the matrix the saving run goes on to 6 and is that run
  (tests/megatron_lm_matrix.py); MoE on Megatron-FSDP below stops at the save (`--exit-interval 3`)
  and is held to a run that never saved. With dropout too: on CPU dropout draws
  from the patch's "CUDA" generator, which Megatron-LM checkpoints apart from the CPU one. Megatron-LM's
  printed log line is not equal: it logs a run's first iteration without resetting its averages, so
  the second printed iteration after a restart (5 here) shows the mean of iterations 4 and 5;
  test_megatron_lm_faults.py checks that from the printed lines.
- Refusals end in one line on rank 0 and status 2 on every rank.
"""

import re

import pytest

from tests.megatron_lm_in_process import Run, run_megatron_lm_many, run_megatron_lm_refused
from tests.megatron_lm_matrix import (  # noqa: F401 (also imported by the other tests of this loop)
    BF16_MOMENTS, CELLS, EXPERTS, EP2, ALLGATHER, ITERATIONS, MEGATRON_CORE, MEGATRON_FSDP, MODEL, ROOT, TORCH_FSDP2,
    Cell, Part, Unexpected, cell_jobs, check_part, matrix_table, parts, run_jobs, unique_jobs)
from tests.megatron_lm_matrix import saving_at_3, assert_equal_tensors as _assert_equal_tensors  # noqa: F401
from tests.megatron_lm_matrix import assert_resumed_exactly as _assert_resumed_exactly
from tests.megatron_lm_matrix import column as _column, state_dtypes as _state_dtypes  # noqa: F401
from tests.refusals import assert_one_error_line


def _runs(run_distributed, *flag_lists: list[str], world_size: int = 2) -> list[list[Run]]:
    """Each command line on 2 ranks (or `world_size`), in one call to the workers: per run, each rank's Run."""
    per_rank = run_distributed(run_megatron_lm_many, world_size, args=([MODEL + flags for flags in flag_lists],),
                               timeout=600)
    return [list(runs) for runs in zip(*per_rank)]


# ---------------------------------------------------------------- the parity matrix

MATRIX = [pytest.param(cell, part, id=f"{cell.name} | {part[0]} | {part[1]}",
                       marks=[] if in_make_test else [pytest.mark.slow])
          for cell in CELLS for part, in_make_test in parts(cell)]
SECONDS_PER_RUN = {1: 60, 2: 90, 4: 240}  # the call's limit per command line, on 2 loaded cores


@pytest.fixture(scope="module")
def matrix_results(request, run_distributed, tmp_path_factory) -> dict[tuple[str, Part], list]:
    """Every selected cell part's runs: per part, per job, each rank's result. One call to the
    workers per world size runs each command line once; a run recorded as refusing or failing gets a
    call of its own, after them (`_run_check`)."""
    selected = [(item.callspec.params["cell"], item.callspec.params["part"]) for item in request.session.items
                if item.module is request.module and getattr(item, "originalname", "") == "test_matrix_cell"]
    print(matrix_table(list(dict.fromkeys(cell for cell, _ in selected))))
    results: dict[tuple[str, Part], list] = {}
    for world_size in sorted({cell.world_size for cell, _ in selected}):
        batch = [(cell, part, cell_jobs(cell, part, str(tmp_path_factory.mktemp("matrix"))))
                 for cell, part in selected if cell.world_size == world_size]
        jobs, where = unique_jobs([job for _, _, part_jobs in batch for job in part_jobs])
        running = [index for index, (kind, _) in enumerate(jobs) if kind == "run"]
        per_rank = run_distributed(run_jobs, world_size, args=([jobs[i] for i in running],),
                                   timeout=SECONDS_PER_RUN[world_size] * len(running)) if running else []
        per_job = dict(zip(running, (list(ranks) for ranks in zip(*per_rank))))
        per_job.update({index: _run_check(run_distributed, world_size, job) for index, job in enumerate(jobs)
                        if job[0] != "run"})
        for cell, part, part_jobs in batch:
            results[cell.name, part] = [per_job[index] for index in where[:len(part_jobs)]]
            where = where[len(part_jobs):]
    return results


def _run_check(run_distributed, world_size: int, job) -> list:
    """A run that refuses or fails, in a call of its own: one that ends after the model is wrapped
    leaves its gradient hooks holding the process groups (objects C++ keeps alive), so the harness
    replaces the world after it (`leaves_groups`)."""
    per_rank = run_distributed(run_jobs, world_size, args=([job],), timeout=SECONDS_PER_RUN[world_size],
                               leaves_groups=True)
    return [results[0] for results in per_rank]


@pytest.mark.parametrize(("cell", "part"), MATRIX)
def test_matrix_cell(matrix_results, cell: Cell, part: Part) -> None:
    """One part of a cell of the matrix (tests/megatron_lm_matrix.py): the compared optimizer against
    megatron-core's through one format (same math, and each move continues as the same side's own
    continuation), or our Muon in one TP mode (learns, resumes exactly); where megatron-core refuses
    or fails, its recorded message and our resume."""
    results = matrix_results[cell.name, part]
    check_part(cell, part, results)
    # On CPU Megatron-FSDP's device is the CPU's throughout (runtime/megatron_lm_cpu.py): no warning that it differs.
    device_warnings = [w for ranks in results for run in ranks if isinstance(run, Run) for w in run.warnings
                       if "instead of the current" in w]
    assert not device_warnings, device_warnings[0]


def test_cells_are_named_once() -> None:
    names = [cell.name for cell in CELLS]
    assert len(names) == len(set(names)), [name for name in names if names.count(name) > 1]


MATRIX_MARKERS = re.compile(r"<!-- parity matrix: begin -->\n(.*?)<!-- parity matrix: end -->", re.S)


def test_docs_show_the_matrix() -> None:
    """docs/megatron-lm.md shows matrix_table() between its markers, exactly (a cell added, removed or
    changed on either side fails)."""
    shown = MATRIX_MARKERS.findall((ROOT / "docs" / "megatron-lm.md").read_text())
    assert len(shown) == 1, "docs/megatron-lm.md: one `<!-- parity matrix: begin -->` ... `end -->` block"
    assert shown[0] == matrix_table(), "docs/megatron-lm.md's matrix differs: paste python -m tests.megatron_lm_matrix"


# ---------------------------------------------------------------- refusals

REFUSED = {  # a command line the loop refuses, and what its one line says
    "ours, in validate_args": (["--optimizer", "dist_muon", "--use-megatron-fsdp"],
                               "--optimizer dist_muon is the layer-wise distributed optimizer"),
    "ours, a checkpoint FSDP2 cannot write": (["--optimizer", "muon", "--use-torch-fsdp2",
                                               "--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist",
                                               "--save", "never_written", "--save-interval", "1"],
                                              "use --ckpt-format torch_dcp"),
    "ours, --qk-clip without Transformer Engine": (["--optimizer", "muon", "--qk-clip", "--qk-clip-alpha", "1.0"],
                                                   "--qk-clip-alpha must be in (0, 1)"),
    "ours, precision-aware Adam without Transformer Engine": (
        ["--optimizer", "adam", "--use-distributed-optimizer", "--bf16", "--use-precision-aware-optimizer"],
        "needs Transformer Engine's FusedAdam (not installed): install transformer-engine, or add "
        "--optimizer-cpu-offload"),
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
                    "the checkpoint's lr schedule has total number of iterations 32 samples (4 iterations x "
                    "--global-batch-size 8), this command line gives 48 samples (6 iterations x --global-batch-size 8)")


def test_refusals_are_one_line_on_rank_zero_and_status_2_on_every_rank(run_distributed, tmp_path) -> None:
    """As our trainer's: rank 0 prints `pretrain_gpt_megatron_lm.py: error: ...` and nothing else of
    ours, rank 1 nothing; both exit with 2 instead of raising (a traceback on every rank). Last, a
    checkpoint is saved and loaded with another lr schedule (SCHEDULE_REFUSED)."""
    checkpoint = ["--save", str(tmp_path / "schedule")]
    refused = {name: case for name, case in REFUSED.items() if "Transformer Engine" not in name or not _has_te_adam()}
    refused = {**refused, "megatron-core's lr-schedule check on --load": (
        SCHEDULE_REFUSED[0] + ["--load", checkpoint[1]], SCHEDULE_REFUSED[1])}
    argvs = [MODEL + SCHEDULE_SAVED + checkpoint] + [MODEL + flags for flags, _ in refused.values()]
    per_rank = run_distributed(run_megatron_lm_refused, 2, args=(argvs,), timeout=600)
    for rank, (saved, *results) in enumerate(per_rank):
        assert saved[0] == 0, (rank, saved[1][-2000:])
        for (name, (_, message)), (status, stderr, _) in zip(refused.items(), results):
            assert status == 2, (name, rank, status, stderr[-2000:])
            assert_one_error_line(stderr, rank, "pretrain_gpt_megatron_lm.py", message, name)
    schedule = per_rank[0][-1][1]
    assert "--override-opt_param-scheduler" in schedule and "--use-checkpoint-opt_param-scheduler" in schedule
    _assert_printed_as_run(per_rank[0][-1][2])


def _has_te_adam() -> bool:
    """Whether Transformer Engine's FusedAdam imports (where it does, precision-aware Adam runs)."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True


def _assert_printed_as_run(stdout: str) -> None:
    """Rank 0's start-up of SCHEDULE_REFUSED: Megatron-LM's argument dump shows QK-clip on, as it runs
    (install()'s validate_args checks it as ours with it off inside), and one line names the flags of
    other optimizers as without effect with adam."""
    dump = {line.split()[0]: line.split()[-1] for line in stdout.splitlines() if " ...." in line}
    assert (dump["qk_clip"], dump["log_max_attention_logit"], dump["optimizer"]) == ("True", "True", "adam"), dump
    unread = [line for line in stdout.splitlines() if "no effect with --optimizer" in line]
    assert unread == ["megatron_eopt: --muon-momentum 0.8, --soap-shampoo-beta 0.9: no effect with --optimizer "
                      "adam, which does not read them (they set other optimizers)"], unread


# ---------------------------------------------------------------- the other optimizers on Megatron-FSDP

# The MoE command line on Megatron-FSDP: bias-free experts, tokens all-gathered.
MEGATRON_FSDP_EXPERTS = MEGATRON_FSDP + EXPERTS + EP2 + ALLGATHER + ["--clip-grad", "1e9"]


# The other optimizers with `yes` in the README's FSDP column (adam: the test above; muon: the DeepSeek-style case).
OTHER_FULLY_SHARDED = ("adaptive_muon", "laprop", "lion", "mop", "polargrad", "scion", "sgd")


# An AdamW run continued with Muon (docs/checkpoints.md, "When a parameter's optimizer changed"): torch
# FSDP2, --ckpt-format torch_dcp, saved at 3 of 3; each load runs no iteration, so what it loaded is its state.
FSDP2_DCP = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--bf16", "--ckpt-format", "torch_dcp",
             "--train-iters", "3"]


def test_adamw_checkpoint_continues_with_muon(run_distributed, tmp_path) -> None:
    """Torch FSDP2's torch_dcp and DDP's torch_dist (megatron-core's layout): refused in one line naming
    the matrices and the opt-in; with --allow-optimizer-change-on-load their state is zero and every
    other parameter's AdamW state (its step too) the saved one, bitwise, and the run trains on from
    iteration 4; --no-load-optim loads. On torch_dist also a Muon run continued with Lion for the
    scalars (--muon-scalar-optimizer: Lion's state starts fresh, Muon's loads) and with AdamW (the
    matrices' state and step as --no-load-optim's fresh AdamW has them, the scalars' the saved).
    The saving runs' own state is the reference; megatron-core's DistributedOptimizer refuses the flag.
    Its own checkpoint (state by buffer bucket, no parameter named) is refused in one line, or with the
    flag read as --no-load-optim: the model bitwise, every state fresh; and it refuses ours in one line."""
    saved = str(tmp_path / "adamw")
    muon = MODEL + FSDP2_DCP + ["--optimizer", "muon", "--load", saved]
    dist_saved, muon_saved = str(tmp_path / "ddp"), str(tmp_path / "ddp_muon")
    ddp = MODEL + ["--train-iters", "3", "--lr-decay-iters", "6", "--ckpt-format", "torch_dist"]
    allow = ["--allow-optimizer-change-on-load"]
    dist_muon, from_muon = ddp + ["--optimizer", "muon", "--load", dist_saved], ddp + ["--load", muon_saved]
    jobs = [("run", MODEL + FSDP2_DCP + ["--optimizer", "adam", "--save", saved, "--save-interval", "3"]),
            ("run", muon + allow), ("run", muon + ["--no-load-optim"]),
            ("run", ddp + ["--optimizer", "adam", "--save", dist_saved, "--save-interval", "3"]),
            ("run", dist_muon + allow),
            ("run", dist_muon + allow + ["--train-iters", "6", "--use-checkpoint-opt_param-scheduler"]),
            ("run", ddp + ["--optimizer", "muon", "--save", muon_saved, "--save-interval", "3"]),
            ("run", from_muon + ["--optimizer", "muon", "--muon-scalar-optimizer", "lion"] + allow),
            ("run", from_muon + ["--optimizer", "adam"] + allow),
            ("run", from_muon + ["--optimizer", "adam", "--no-load-optim"]),
            ("refused", muon), ("refused", dist_muon),
            ("refused", from_muon + ["--optimizer", "adam", "--use-distributed-optimizer"] + allow)]
    # megatron-core's DistributedOptimizer's default torch_dist layout: its state by buffer bucket.
    core_saved = str(tmp_path / "core_adam")
    core = MODEL + ["--train-iters", "3", "--ckpt-format", "torch_dist", "--bf16", "--use-distributed-optimizer"]
    core_muon_saved = str(tmp_path / "core_muon")
    jobs += [("run", core + ["--optimizer", "adam", "--save", core_saved, "--save-interval", "3"]),
             ("run", core + ["--optimizer", "muon", "--load", core_saved] + allow),
             ("refused", core + ["--optimizer", "muon", "--load", core_saved]),
             ("run", core + ["--optimizer", "muon", "--save", core_muon_saved, "--save-interval", "3"]),
             ("refused", core + ["--optimizer", "adam", "--load", core_muon_saved])]
    per_rank = run_distributed(run_jobs, 2, args=(jobs,), timeout=SECONDS_PER_RUN[2] * len(jobs), leaves_groups=True)
    for rank, (adamw, changed, model_only, dist_adamw, dist_changed, trained, dist_muon_run, to_lion, to_adam,
               fresh_adam, refused, dist_refused, core_refused, core_adam, core_to_muon, bucket_refused, _,
               no_bucket_refused) in enumerate(per_rank):
        _assert_bucket_state_skipped(core_adam, core_to_muon, bucket_refused, rank)
        assert no_bucket_refused[0] == 2, (rank, no_bucket_refused[1][-2000:])  # megatron-core's asking buckets
        assert_one_error_line(no_bucket_refused[1], rank, "pretrain_gpt_megatron_lm.py", "--no-load-optim", rank)
        runs = (adamw, changed, model_only, dist_adamw, dist_changed, trained, dist_muon_run, to_lion, to_adam,
                fresh_adam)
        assert not any(isinstance(run, Unexpected) for run in runs), runs
        for status, stderr, _ in (refused, dist_refused):  # the loop's one line, status 2 on every rank
            assert status == 2, (rank, status, stderr[-2000:])
            assert_one_error_line(stderr, rank, "pretrain_gpt_megatron_lm.py", "allow_optimizer_change_on_load", rank)
            assert rank or "--no-load-optim" in stderr, stderr
        assert rank or "decoder.layers.0.mlp.linear_fc1.weight (" in refused[1], refused[1]
        assert rank or ("decoder.layers.mlp.linear_fc1.weight (saved (exp_avg, exp_avg_sq) -> now (momentum_buffer))"
                        in dist_refused[1]), dist_refused[1]
        assert core_refused[0] == 2, (rank, core_refused[1][-2000:])
        assert_one_error_line(core_refused[1], rank, "pretrain_gpt_megatron_lm.py", "DistributedOptimizer steps", rank)
        for saving, loading in ((adamw, changed), (dist_adamw, dist_changed)):
            _assert_adamw_continued_with_muon(saving, loading, rank)
        _assert_equal_tensors(dist_changed.parameters, dist_adamw.parameters, f"rank {rank}, parameters")
        assert [r["iteration"] for r in trained.records] == [4, 5, 6], trained.records
        assert all(0 < r["lm loss"] < 10 for r in trained.records), trained.records
        _assert_muon_continued_with_other_scalars(dist_muon_run, to_lion, to_adam, fresh_adam, rank)
        assert model_only.exit_status == 0, rank


def _assert_bucket_state_skipped(core_adam, to_muon, refused, rank: int) -> None:
    """A bucket-keyed checkpoint (megatron-core's DistributedOptimizer, not fully reshardable) names no
    parameter: refused in one line; with the opt-in the model loads (bitwise) and every state is fresh."""
    assert refused[0] == 2, (rank, refused[1][-2000:])
    assert_one_error_line(refused[1], rank, "pretrain_gpt_megatron_lm.py", "--no-load-optim", rank)
    assert rank or "by buffer bucket" in refused[1], refused[1]
    assert not isinstance(to_muon, Unexpected) and to_muon.exit_status == 0, (rank, to_muon)
    _assert_equal_tensors(to_muon.parameters, core_adam.parameters, f"rank {rank}, parameters")
    states = [value for entry in to_muon.optimizer_state["optimizers"].values() for state in entry["state"].values()
              if isinstance(state, dict) for value in state.values() if hasattr(value, "any")]
    assert states and not any(value.any() for value in states), rank


def _child_states(run) -> dict:
    return {child: entry["state"] for child, entry in run.optimizer_state["optimizers"].items()}


def _assert_muon_continued_with_other_scalars(muon, to_lion, to_adam, fresh_adam, rank: int) -> None:
    """Lion's scalars start at zero, Muon's matrices load; AdamW's matrices as a fresh AdamW's, its scalars load."""
    saved, lion, adam = _child_states(muon), _child_states(to_lion), _child_states(to_adam)["dense"]
    assert set(lion) == {"muon/dense", "lion/dense"} and lion["lion/dense"], lion.keys()
    _assert_equal_tensors(lion["muon/dense"], saved["muon/dense"], f"rank {rank}, muon/dense")
    assert all(not state["exp_avg"].any() for state in lion["lion/dense"].values()), rank
    fresh = _child_states(fresh_adam)["dense"]
    assert adam.keys() == fresh.keys() == saved["muon/dense"].keys() | saved["adam/dense"].keys(), adam.keys()
    for name, state in adam.items():
        reference = saved["adam/dense"].get(name, fresh[name])
        _assert_equal_tensors(state, reference, f"rank {rank}, {name}")


def _assert_adamw_continued_with_muon(adamw, changed, rank: int) -> None:
    """Muon's matrices start at zero momentum; AdamW's parameters load its saved state bitwise."""
    saved_state = _child_states(adamw)["dense"]
    loaded = _child_states(changed)
    assert set(loaded) == {"muon/dense", "adam/dense"} and loaded["adam/dense"] and loaded["muon/dense"], loaded.keys()
    for name, state in loaded["adam/dense"].items():
        _assert_equal_tensors(state, saved_state[name], f"rank {rank}, {name}")
    for name, state in loaded["muon/dense"].items():
        assert not state["momentum_buffer"].any(), (rank, name)


@pytest.mark.slow
def test_every_fully_sharded_optimizer_resumes_experts_from_fsdp_dtensor_exactly(run_distributed, tmp_path) -> None:
    """As the Muon case above, for each other optimizer the sharded engines take (~9 s each)."""
    command_lines = []
    for name in OTHER_FULLY_SHARDED:
        flags, directory = ["--optimizer", name] + MEGATRON_FSDP_EXPERTS, str(tmp_path / name)
        command_lines += [flags, flags + saving_at_3(directory), flags + ["--load", directory]]
    runs = _runs(run_distributed, *command_lines)
    for index, name in enumerate(OTHER_FULLY_SHARDED):
        _assert_resumed_exactly(*runs[3 * index:3 * index + 3], f"{name}, MoE on Megatron-FSDP")
