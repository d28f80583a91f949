"""Checkpoints of torch FSDP2 models (`fully_shard`, DTensor Shard(0) rows), CPU gloo.

- Exact resume at FSDP=2 (GQA + SwiGLU GPT, muon, adam and polargrad, fp32, real gradients through FSDP2's
  forward/backward): N iterations, save, a fresh FSDP2 model/optimizer/scheduler (RNG
  reseeded), load, N more equal 2N straight: every parameter shard and every optimizer state
  tensor BITWISE.
- Exact resume at TP=2 x FSDP2=2 (4 ranks, muon and adam): the same comparison, each rank its
  rows of its TP shard.
- Resharding both ways: FSDP=2 -> layer-wise DP=2 and layer-wise DP=2 -> FSDP=3 (uneven rows:
  32 = 11 + 11 + 10), and adam FSDP=2 -> one process. After loading, one step with the same
  synthetic global gradient must give the parameters that continuing in the saved layout gives,
  to 1e-6 (fp32; the gradient norm is summed in another order over other ranks). Both sides are
  our layouts stepping independently: neither is a value the code under test printed.
- bf16 moments (the precision-aware optimizer): exact resume at FSDP=2 (muon, adam; the
  comparison is of dtypes too), and FSDP=2 -> layer-wise DP=2 resharding.
- Optimizer state that is neither scalar nor parameter-shaped (NorMuon's second moment) is
  refused at save, before anything is written.
"""

import os

import torch

from megatron_eopt.checkpointing import CheckpointError, save_checkpoint
from tests.unit.library.checkpointing.checkpoint_runs import GPTRun, Layout
from tests.unit.library.checkpointing.test_checkpoint import (_global_params, _load_then_step, _save_then_continue, _train,
                                                              assert_resumed_exactly, resume_differences)

RESUME_STEPS = 4


def _shards(run: GPTRun) -> dict:
    return {name: p.detach().to_local().clone() for name, p in run.model.named_parameters()}


def _resume_body(rank: int, world_size: int, directory: str) -> dict:
    layouts = (Layout("muon", fsdp2=True), Layout("adam", fsdp2=True), Layout("polargrad", fsdp2=True))
    return resume_differences(layouts, _shards, directory, world_size, RESUME_STEPS)


def test_fsdp2_resume_is_exact_for_muon_adam_and_polargrad(run_distributed, tmp_path) -> None:
    assert_resumed_exactly(run_distributed(_resume_body, world_size=2, args=(str(tmp_path),), timeout=600), cases=3)


def _bf16_state_resume_body(rank: int, world_size: int, directory: str) -> dict:
    layouts = (Layout("muon", fsdp2=True, bf16_state=True), Layout("adam", fsdp2=True, bf16_state=True))
    return resume_differences(layouts, _shards, directory, world_size, RESUME_STEPS)


def test_fsdp2_resume_with_bf16_moments_is_exact(run_distributed, tmp_path) -> None:
    """bf16 moments on the shards: saved in bf16, loaded back bitwise, the run continues exactly."""
    results = run_distributed(_bf16_state_resume_body, world_size=2, args=(str(tmp_path),), timeout=600)
    assert_resumed_exactly(results, cases=2)


def _tp2_resume_body(rank: int, world_size: int, directory: str) -> dict:
    # Muon only: Adam's moments take the same parameter-shaped path (FSDP=2 tests both).
    layouts = (Layout("muon", tp=2, fsdp2=True),)
    return resume_differences(layouts, _shards, directory, world_size, RESUME_STEPS)


def test_tp2_x_fsdp2_resume_is_exact_for_muon(run_distributed, tmp_path) -> None:
    """TP=2 x FSDP2=2: N + save + load into a fresh model and optimizer + N == 2N, key by key."""
    assert_resumed_exactly(run_distributed(_tp2_resume_body, world_size=4, args=(str(tmp_path),), timeout=600), cases=1)


SOURCES = {  # name: (layout, world size)
    "FSDP2": (Layout(fsdp2=True), 2),
    "DP2 layer-wise": (Layout(layer_wise=True), 2),
    "adam FSDP2": (Layout("adam", fsdp2=True), 2),
    "TP2 x FSDP2": (Layout(tp=2, fsdp2=True), 4),
    "FSDP2 bf16-state": (Layout(fsdp2=True, bf16_state=True), 2),
}
RESHARDINGS = [  # (source, target layout, target world size)
    ("FSDP2", Layout(layer_wise=True), 2),
    ("DP2 layer-wise", Layout(fsdp2=True), 3),
    ("adam FSDP2", Layout("adam"), 1),
    ("TP2 x FSDP2", Layout(), 1),  # TP=2 x FSDP2=2 -> one process
    ("DP2 layer-wise", Layout(tp=2, fsdp2=True), 4),  # and into TP=2 x FSDP2=2
    ("FSDP2 bf16-state", Layout(layer_wise=True, bf16_state=True), 2),  # bf16 moments, FSDP2 -> layer-wise
]


def test_fsdp2_checkpoints_reshard_to_and_from_layer_wise(run_distributed, tmp_path) -> None:
    continued = {}
    for name, (layout, world_size) in SOURCES.items():
        directory = str(tmp_path / name.replace(" ", "_"))
        results = run_distributed(_save_then_continue, world_size=world_size, args=(layout, directory), timeout=600)
        continued[name] = (_global_params(results, layout.tp), directory)
    for source, layout, world_size in RESHARDINGS:
        expected, directory = continued[source]
        results = run_distributed(_load_then_step, world_size=world_size, args=(layout, directory), timeout=600)
        actual = _global_params(results, layout.tp)
        assert set(actual) == set(expected)
        errors = {name: (actual[name] - value).abs().max().item() for name, value in expected.items()}
        worst = max(errors.values())
        print(f"{source} -> {layout.describe(world_size)}: worst difference {worst:.2e}")
        assert worst < 1e-6, (source, layout.describe(world_size), sorted(errors.items(), key=lambda e: -e[1])[:3])


def _normuon_body(rank: int, world_size: int, directory: str) -> dict:
    run = _train(Layout("normuon", fsdp2=True), 0, 1)
    try:
        save_checkpoint(directory, 1, [run.model], run.optimizer, run.scheduler)
        return {"error": None, "files": sorted(os.listdir(directory))}
    except CheckpointError as error:
        return {"error": str(error), "files": sorted(os.listdir(directory)) if os.path.isdir(directory) else []}
    finally:
        run.close()


def test_fsdp2_state_that_is_not_parameter_shaped_is_refused_before_writing(run_distributed, tmp_path) -> None:
    """NorMuon's second moment of a row shard ((rows, 1) or (1, cols)) has no global layout yet."""
    for result in run_distributed(_normuon_body, world_size=2, args=(str(tmp_path / "normuon"),), timeout=600):
        assert result["error"] and "not supported for torch FSDP2" in result["error"], result
        assert "decoder.layers" in result["error"] and not result["files"], result


def _pretrain_resume_body(rank: int, world_size: int, directory: str) -> dict:
    """Three command lines in one call (each builds its FSDP2 mesh from the live process groups)."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt
    from tests.unit.library.distributed.test_fsdp2 import PRETRAIN_ARGV

    argv = [a if a != "20" else "6" for a in PRETRAIN_ARGV] + ["--use-torch-fsdp2"]  # --train-iters 6
    straight = run_pretrain_gpt(rank, world_size, argv)
    first = run_pretrain_gpt(rank, world_size, argv + ["--save", directory, "--exit-interval", "3"])
    resumed = run_pretrain_gpt(rank, world_size, argv + ["--load", directory])
    return {"straight": straight, "first": first, "resumed": resumed}


def test_pretrain_gpt_fsdp2_save_and_load_resume_exactly(run_distributed, tmp_path) -> None:
    """scripts/pretrain_gpt.py --use-torch-fsdp2 --save/--load: 3 + save + load + 3 == 6 straight."""
    for result in run_distributed(_pretrain_resume_body, world_size=2, args=(str(tmp_path),), timeout=600):
        losses = {name: {r["iteration"]: r["loss"] for r in records} for name, records in result.items()}
        assert sorted(losses["straight"]) == [1, 2, 3, 4, 5, 6], losses
        assert sorted(losses["first"]) == [1, 2, 3] and sorted(losses["resumed"]) == [4, 5, 6], losses
        for iteration in range(1, 7):  # bitwise: the same sums in the same order
            assert (losses["first"] | losses["resumed"])[iteration] == losses["straight"][iteration], iteration
