"""scripts/pretrain_gpt.py with --num-experts (issue 13): expert parallelism against one process.

Reference: the same command line in one process (EP=1, every expert local, no gradient
reduction). Against it, 10 iterations at EP=2 (2 ranks: DP 2, expert DP 1) and EP=2 x DP=2
(4 ranks: expert DP 2), with Muon (gradients reduced by scripts/grad_reduction.py), layer-wise
Muon (reduced onto owners by the optimizer) and Adam, to 1e-5 relative: the layouts sum the same
gradients in another order. Gradient accumulation differs too (4, 2 and 1 micro-batches per
rank), which the aux loss runs (--moe-aux-loss-coeff) depend on through megatron's aux-loss
scale. The runs also record the Newton-Schulz calls (expert matrices go to Muon, equal shapes in
one batched call per step), and the EP=2 layer-wise run saves a checkpoint that a one-process
run resumes.
"""

import pytest

from tests.pretrain_gpt_in_process import run_pretrain_gpt

ITERATIONS = 10
# 2 MoE layers x 4 experts; each expert an fc1 [128, 32] and an fc2 [32, 128] (no other matrix
# has these shapes: attention blocks are 32 x 32, the router 4 x 32).
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--lr", "1e-2",
        "--log-interval", "1", "--eval-iters", "0", "--disable-bias-linear", "--num-experts", "4",
        "--moe-router-topk", "2", "--muon-fp32-matmul-prec", "highest"]
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
    from megatron_eopt.ops import newton_schulz

    calls = []
    original = newton_schulz.NewtonSchulzSettings.orthogonalize

    def recording(self, x, **kwargs):
        calls.append(tuple(x.shape))
        return original(self, x, **kwargs)

    newton_schulz.NewtonSchulzSettings.orthogonalize = recording
    try:
        return run_pretrain_gpt(rank, world_size, argv), calls
    finally:
        newton_schulz.NewtonSchulzSettings.orthogonalize = original


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _grad_norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


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
                argv += ["--save", checkpoint, "--save-interval", "5"]
            results[name, world_size] = run_distributed(run_recording_newton_schulz, world_size, args=(argv,))
    resumed = run_distributed(run_pretrain_gpt, 1, args=(ARGV + RUNS["layer-wise muon, aux loss"] + [
        "--load", checkpoint, "--ckpt-step", "5"],))[0]

    differences = {}
    for name in RUNS:
        reference = _losses(results[name, 1][0][0])
        assert len(reference) == ITERATIONS and reference[-1] < reference[0]
        # Muon and Adam hardly see a gradient's scale; the norm does (e.g. experts summed but not
        # divided by the data-parallel size).
        reference_norms = _grad_norms(results[name, 1][0][0])
        for world_size in (2, 4):
            per_rank = results[name, world_size]
            for records, _ in per_rank:
                assert _losses(records) == pytest.approx(reference, rel=1e-5), (name, world_size)
                assert _grad_norms(records) == pytest.approx(reference_norms, rel=1e-5), (name, world_size)
            differences[name, world_size] = max(abs(a / b - 1) for a, b in zip(_losses(per_rank[0][0]), reference))
        if "muon" in name:
            for world_size in (1, 2, 4):
                _check_expert_calls(name, world_size, [calls for _, calls in results[name, world_size]])
    print("max relative loss difference against one process:", differences)
    # The aux loss changes training by far more than the tolerance (else the runs above could
    # not tell a wrong aux-loss scale).
    muon, with_aux = _losses(results["muon", 1][0][0]), _losses(results["layer-wise muon, aux loss", 1][0][0])
    assert max(abs(a / b - 1) for a, b in zip(with_aux, muon)) > 1e-3
    # The EP=2 checkpoint of iteration 5, resumed in one process, continues as the reference.
    reference = _losses(results["layer-wise muon, aux loss", 1][0][0])
    assert [r["iteration"] for r in resumed] == list(range(6, ITERATIONS + 1))
    assert _losses(resumed) == pytest.approx(reference[5:], rel=1e-5)
