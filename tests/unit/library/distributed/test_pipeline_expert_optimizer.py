"""The optimizer over pipeline stages and expert-parallel ranks equals the PP=1/EP=1 optimizer.

No pipeline schedule runs (pp_ep_runs.py says why): every layout gets the same global model and
synthetic global gradient, takes STEPS steps, and its parameters, gathered by global name from
all ranks, are compared with the single-process PP=1/EP=1 run's: 1e-6 absolute, tighter than
issue 13's 1e-5 (fp32 Muon at 'highest'; measured <= 3e-8: the gradient norm is summed over
other ranks in another order, so the clip coefficient differs in the last bit). Counting the
tied output-layer copy twice in the norm moves Adam's parameters by 4.5e-6 and Muon's by 6.7e-5,
which is why the tolerance is 1e-6. Replicas (DP
ranks) must be bitwise equal. Clipping is active in every step, so a norm that misses a stage,
counts the tied output-layer copy twice, or counts an expert-DP replica twice changes every
parameter. Layouts:
- 2 ranks: PP=2 (tied embeddings across the stages), PP=2 with 2 virtual chunks per rank,
  a 2-stage pipeline whose last stage holds only the final norm and output layer (no Muon
  matrix), MoE at EP=2 (4 experts, SequentialMLP, allgather dispatcher).
- 4 ranks: TP=2 x PP=2, PP=2 x DP=2, MoE at EP=2 x DP=2.
each with adam, muon and layer-wise muon. Also: a NaN gradient on the last stage only makes
every rank of every stage skip with nothing changed, and equal-shape expert matrices go through
one batched Newton-Schulz call.
"""

from dataclasses import replace

import pytest
import torch

from tests.newton_schulz_calls import recording_newton_schulz_calls
from tests.unit.library.checkpointing.pp_ep_runs import DENSE, MOE, Layout, Run, assemble_global, reference

STEPS = 3
TOLERANCE = 1e-6
OPTIMIZER_VARIANTS = (("adam", False), ("muon", False), ("muon", True))
EMBEDDINGS_ONLY_LAST = replace(DENSE, share_embeddings_and_output_weights=False, pipeline_model_parallel_layout="Et*4|L")
TWO_RANK_LAYOUTS = (
    dict(pp=2),
    dict(pp=2, vpp=2),
    dict(pp=2, settings=EMBEDDINGS_ONLY_LAST),
    dict(ep=2, settings=MOE),
)
FOUR_RANK_LAYOUTS = (
    dict(tp=2, pp=2),
    dict(pp=2),
    dict(ep=2, settings=MOE),
)


def _train(layout: Layout, single_process: bool = False) -> tuple:
    run = Run(layout, single_process)
    try:
        for step in range(STEPS):
            ok, _ = run.step(step)
            if not ok:
                raise RuntimeError(f"{layout}: step {step} was skipped")
        return run.global_params()
    finally:
        run.close()


def _layouts_body(rank: int, world_size: int, layouts: tuple) -> dict:
    results, references = {}, {}
    for optimizer, layer_wise in OPTIMIZER_VARIANTS:
        for changes in layouts:
            layout = Layout(optimizer, layer_wise, **changes)
            ref = reference(replace(layout, layer_wise=False))
            if ref not in references:
                references[ref] = _train(ref, single_process=True)
            results[layout.describe(world_size)] = (references[ref], _train(layout))
    return results


def _compare(per_rank: list[dict]) -> dict[str, float]:
    """{layout: max |difference|} with every global parameter present in both."""
    errors = {}
    for name in per_rank[0]:
        expected = assemble_global([per_rank[0][name][0]])
        actual = assemble_global([results[name][1] for results in per_rank])
        assert set(expected) == set(actual), f"{name}: {sorted(set(expected) ^ set(actual))}"
        errors[name] = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    return errors


@pytest.mark.parametrize("world_size, layouts", [(2, TWO_RANK_LAYOUTS), (4, FOUR_RANK_LAYOUTS)])
def test_layouts_equal_single_process(run_distributed, world_size, layouts):
    errors = _compare(run_distributed(_layouts_body, world_size, args=(layouts,), timeout=900))
    assert len(errors) == len(layouts) * len(OPTIMIZER_VARIANTS)
    worst = {name: error for name, error in errors.items() if not error <= TOLERANCE}
    assert not worst, f"max |param - PP=1/EP=1 param| above {TOLERANCE}: {worst}; all: {errors}"


def _nan_on_last_stage_body(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    results = {}
    for optimizer, layer_wise in OPTIMIZER_VARIANTS:
        run = Run(Layout(optimizer, layer_wise, pp=2, ep=1))
        try:
            assert run.step(0)[0]
            run.set_gradients(1)
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                run.params["decoder.final_layernorm.weight"].grad[0] = float("nan")
            before = {k: p.detach().clone() for k, p in run.params.items()}
            states_before = _state_tensors(run)
            ok, norm, _ = run.optimizer.step()
            unchanged = all(torch.equal(before[k], p) for k, p in run.params.items())
            results[f"{optimizer}{' layer-wise' if layer_wise else ''}"] = (
                ok, norm, unchanged and _state_tensors(run) == states_before)
        finally:
            run.close()
    return results


def _state_tensors(run: Run) -> list[bytes]:
    state = run.optimizer.state_dict()
    return [t.numpy().tobytes() for t in _tensors(state)]


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("world_size", [2, 4])
def test_nan_on_last_stage_skips_every_rank(run_distributed, world_size):
    for rank, results in enumerate(run_distributed(_nan_on_last_stage_body, world_size)):
        for optimizer, (ok, norm, unchanged) in results.items():
            assert (ok, norm, unchanged) == (False, None, True), f"rank {rank}, {optimizer}: {ok}, {norm}, {unchanged}"


def _batched_experts_body(rank: int, world_size: int) -> list:
    with recording_newton_schulz_calls() as calls:
        run = Run(Layout("muon", ep=world_size, settings=MOE))
        try:
            assert run.step(0)[0]
        finally:
            run.close()
    return calls


def test_equal_shape_expert_matrices_in_one_batched_call(run_distributed):
    # MOE: 2 layers x 4 experts, each a gated fc1 [96, 32] (gate and up orthogonalized apart,
    # 48 x 32 each) and fc2 [32, 48]. EP=2: 2 experts per rank and layer.
    for rank, calls in enumerate(run_distributed(_batched_experts_body, 2)):
        gate_up = [shape for shape in calls if shape[-2:] == (48, 32)]
        fc2 = [shape for shape in calls if shape[-2:] == (32, 48)]
        assert gate_up == [(2 * 2 * 2, 48, 32)], f"rank {rank}: {calls}"
        assert fc2 == [(2 * 2, 32, 48)], f"rank {rank}: {calls}"
