"""scripts/pretrain_gpt.py with --num-experts on the sharded engines: EP=2 x FSDP=2 (4 ranks).

Each EP rank's routed experts are sharded over its expert-data-parallel group (2 ranks), the rest
over all 4 ranks: `--use-torch-fsdp2` (fully_shard of each MoE layer's experts on a mesh of their
own, their gradients summed there and divided by the data-parallel size) and `--use-megatron-fsdp`
(its expert mesh). Reference: the same command line in one process (EP=1, every expert local).
Muon at 'highest', 2 MoE layers of 4 SwiGLU experts, top-2, no clipping (test_megatron_fsdp.py's
BF16 says why), 4 iterations.
- fp32: losses and gradient norms to 1e-6 relative (measured 6e-8 on both engines: the same
  gradients summed in another order). Experts' gradients off by the EP size, or summed over their
  mesh without the division, change the gradient norm by far more.
- --bf16 (slow): bf16 compute of fp32 weights against one process's bf16 weights with fp32 main
  copies: losses to 1e-4 (measured 3.5e-5 on FSDP2, 3.0e-5 on Megatron-FSDP, after the first
  iteration's equal loss and gradient norm). A run saved at 2 (`--exit-interval 2`) and resumed
  equals the run not interrupted, bitwise: the checkpoint stores each expert under its global index.
"""

import pytest

from tests.pretrain_gpt_in_process import run_pretrain_gpt
from tests.unit.library.distributed.test_fsdp2 import PRETRAIN_ARGV

ITERATIONS, SAVED_AT = 4, 2
ARGV = PRETRAIN_ARGV + ["--train-iters", str(ITERATIONS), "--clip-grad", "0", "--disable-bias-linear",
                        "--num-experts", "4", "--moe-router-topk", "2"]
ENGINES = {"torch FSDP2": ["--use-torch-fsdp2"],
           "Megatron-FSDP": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]}
EP2 = ["--expert-model-parallel-size", "2"]


def _sharded_runs(rank: int, world_size: int, argv: list[str], directory: str, resume: bool) -> dict:
    runs = {}
    for name, flags in ENGINES.items():
        sharded = argv + EP2 + flags
        runs[name] = run_pretrain_gpt(rank, world_size, sharded)
        if resume:
            saved = f"{directory}/{name.replace(' ', '_')}"
            first = run_pretrain_gpt(rank, world_size, sharded + ["--save", saved, "--exit-interval", str(SAVED_AT)])
            runs[f"{name}, resumed"] = first + run_pretrain_gpt(rank, world_size, sharded + ["--load", saved])
    return runs


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in records}


def _check(run_distributed, tmp_path, precision: list[str], tolerance: float, resume: bool) -> None:
    argv = ARGV + precision
    (reference,) = run_distributed(run_pretrain_gpt, 1, args=(argv,), timeout=300)
    expected = [r["loss"] for r in reference]
    assert len(expected) == ITERATIONS and expected[-1] < expected[0], expected
    per_rank = run_distributed(_sharded_runs, 4, args=(argv, str(tmp_path), resume), timeout=300)
    for rank, runs in enumerate(per_rank):
        for name in ENGINES:
            straight = _losses(runs[name])
            got = [straight[i] for i in range(1, ITERATIONS + 1)]
            print(f"{name} EP=2 x FSDP=2 vs one process {precision}, rank {rank}: max relative loss difference "
                  f"{max(abs(g - e) / abs(e) for g, e in zip(got, expected)):.1e}")
            assert got == pytest.approx(expected, rel=tolerance), (name, rank)
            if not precision:
                assert [r["grad_norm"] for r in runs[name]] == pytest.approx(
                    [r["grad_norm"] for r in reference], rel=tolerance), (name, rank)
            if resume:
                assert _losses(runs[f"{name}, resumed"]) == straight, (name, rank)  # bitwise


def test_experts_on_both_sharded_engines_equal_one_process(run_distributed, tmp_path) -> None:
    _check(run_distributed, tmp_path, [], 1e-6, resume=False)


@pytest.mark.slow
def test_experts_on_both_sharded_engines_in_bf16_equal_one_process_and_resume_exactly(run_distributed,
                                                                                       tmp_path) -> None:
    _check(run_distributed, tmp_path, ["--bf16"], 1e-4, resume=True)
