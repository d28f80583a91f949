"""The DeepSeek-style case in Megatron-LM's loop: gpt_megatron_lm_deepseek_muon_megatron_fsdp_ep2.

Multi-latent attention, MoE with a shared expert (4 experts at EP=2), QK-clip, Muon with bf16
moments, `--bf16`, Megatron-FSDP (`optim_grads_params`), `--ckpt-format fsdp_dtensor`, 2 ranks,
8 iterations, as Megatron-LM's runner runs a `ckpt-resume` case (saved at 4 and 8, resumed from 4).
One launch, three runs: the case's two, and the same model without `--qk-clip` (the logits still
measured) for 5 steps. Checked:
- the case against its CPU golden (test_golden_cases.py leaves it to this test);
- the resume is exact: iterations 5-8 of the resumed run equal the run not interrupted in loss,
  gradient norm and learning rate, and both end with the same parameters and optimizer state on
  every rank, to the last bit (the golden's check of the resume is only within its tolerance);
- the clip, from logits measured outside the optimizer: around each step the test runs the model's
  forward again on the step's micro-batches (no gradient), before the step and after it, and reads
  each head's largest logit from megatron-core's local attention (MAX over the ranks).

What QK-clip bounds, and what it does not. It scales each head whose largest logit, measured in
the step's forward, exceeds tau by tau / S, after the update (Kimi K2's MuonClip; megatron-core's
`clip_qk` does the same). The same batch's logits after the step are tau x U / S for a clipped
head, with U the logit after the update alone: above tau whenever the update grows it. Here
(lr 1e-2, logits 0.02-0.1) one update grows them by up to 80 %, and the largest logit of a step's
batch after the step reached 1.85 tau; the unit tests (docs/qk-clip.md) show <= tau at lr 0. So this
test checks what holds exactly: at the first step whose forward exceeds tau, each first-layer
head's logit on that batch after the step equals the unclipped run's after the same step times
min(1, tau / S) (both runs are equal before it; the first layer's input does not depend on the
clip, the second's does). It also checks that the measurement is the one the step clipped with
(the logit Megatron-LM logs equals the largest one measured before the step) and that the
measurement is repeatable (Megatron-LM's first step, in warmup, has lr 0: after equals before).
"""

import contextlib
import dataclasses
import pathlib

import pytest
import torch

from megatron_eopt.training.functional import goldens
from megatron_eopt.training.functional.cases import RunPaths, case_argv
from tests.functional import golden_cases
from tests.functional.test_megatron_lm_loop import _assert_equal_tensors, _state_dtypes

NAME = "gpt_megatron_lm_deepseek_muon_megatron_fsdp_ep2"
UNCLIPPED_DROPS = ("--qk-clip", "--qk-clip-threshold", "--save", "--load", "--save-interval")
UNCLIPPED_ITERATIONS = 5  # the clipped run first clips at step 5 (its forward's logit passes tau)
# bf16 weights: a clipped head's weights are scaled in fp32 and rounded to bf16 again.
CLIP_RTOL = 1e-2


def _largest_logits(batches: list, model: list) -> torch.Tensor:
    """[layers, heads]: each head's largest logit over `batches`, MAX over the ranks, from a forward
    of the model as it is (no gradient); megatron-core's local attention records them (install())."""
    import torch.distributed as dist
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_eopt.integrations.megatron_lm_gpt import forward_step
    from megatron_eopt.placement.megatron_fsdp_model import megatron_fsdp_wrappers

    attentions = [m for chunk in model for m in chunk.modules() if isinstance(m, DotProductAttention)]
    with torch.no_grad():
        for batch in batches:
            forward_step(iter([batch]), model[0])
    for wrapper in megatron_fsdp_wrappers(model):  # its parameters back to its shards, as after a backward
        wrapper.synchronize_param_gather()
    maxima = torch.stack([attention.current_max_attn_logits.float() for attention in attentions])
    for attention in attentions:
        attention.current_max_attn_logits = None  # the step measures its own forward only
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return maxima


@contextlib.contextmanager
def _logits_around_each_step(records: list):
    """Megatron-LM's train_step with its micro-batches read first, and their largest logits per
    head appended to `records` as (before the step, after it)."""
    import megatron.training.training as training
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.rerun_state_machine import RerunDataIterator

    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        batches = [next(data_iterator) for _ in range(get_num_microbatches())]
        before = _largest_logits(batches, model)
        result = original(forward_step_func, RerunDataIterator(iter(batches)), model, optimizer, *args, **kwargs)
        records.append((before, _largest_logits(batches, model)))
        return result

    training.train_step = train_step
    try:
        yield
    finally:
        training.train_step = original


def _case_and_unclipped(rank: int, world_size: int, case, output: str) -> tuple:
    """The case's runs and the unclipped run, each with its logits around every step."""
    from tests.golden_cases_in_process import run_case
    from tests.megatron_lm_in_process import run_megatron_lm

    clipped, unclipped = [], []
    with _logits_around_each_step(clipped):
        runs = run_case(rank, world_size, case, output)
    without_clip = {k: v for k, v in case.model_args.items() if k not in UNCLIPPED_DROPS}
    without_clip["--exit-interval"] = UNCLIPPED_ITERATIONS  # past the first step that clips
    argv = case_argv(dataclasses.replace(case, model_args=without_clip), RunPaths(pathlib.Path(output) / "unclipped"))
    with _logits_around_each_step(unclipped):
        unclipped_run = run_megatron_lm(rank, world_size, argv)
    return runs, clipped, unclipped_run, unclipped


def _column(run, key: str, iterations) -> list:
    by_iteration = {record["iteration"]: record[key] for record in run.records}
    return [by_iteration.get(i) for i in iterations]


def test_deepseek_style_case_matches_its_golden_resumes_exactly_and_clips(run_distributed, tmp_path) -> None:
    case = golden_cases.cases()[NAME]
    per_rank = run_distributed(_case_and_unclipped, case.world_size, args=(case, str(tmp_path)), timeout=900)
    iterations, half = case.train_iters, case.train_iters // 2
    tau = float(case.model_args["--qk-clip-threshold"])

    golden = goldens.load_golden(goldens.find_golden(case, goldens.platform_name("cpu"), False,
                                                     golden_cases.cpu_reference_platform()))
    verdicts = goldens.check_runs(case, golden, goldens.read_runs(case, RunPaths(tmp_path)), on_cuda=False)
    assert verdicts and all(v.passed for v in verdicts), "\n".join(v.message for v in verdicts)

    after_half = range(half + 1, iterations + 1)
    for rank, ((straight, resumed), _, _, _) in enumerate(per_rank):
        where = f"rank {rank}"
        assert [r["iteration"] for r in resumed.records] == list(after_half), where
        for key in ("lm loss", "grad norm", "learning rate", "max attention logit"):
            assert _column(resumed, key, after_half) == _column(straight, key, after_half), f"{where}: {key}"
        assert straight.parameters and straight.optimizer_state, where
        _assert_equal_tensors(resumed.parameters, straight.parameters, f"{where}: parameters")
        _assert_equal_tensors(resumed.optimizer_state, straight.optimizer_state, f"{where}: optimizer state")
        assert resumed.optimizer_package == "megatron_eopt" and torch.bfloat16 in _state_dtypes(straight.optimizer_state)
    losses = _column(per_rank[0][0][0], "lm loss", range(1, iterations + 1))
    assert losses[-1] < losses[0] - 0.5, losses  # it learns

    (straight, _), clipped, unclipped_run, unclipped = per_rank[0]
    assert len(clipped) == iterations + half and len(unclipped) == UNCLIPPED_ITERATIONS
    for step, (before, after) in enumerate(clipped[iterations:], half + 1):  # the resumed run's
        assert torch.equal(before, clipped[step - 1][0]) and torch.equal(after, clipped[step - 1][1]), step
    clipped = clipped[:iterations]
    logged = _column(straight, "max attention logit", range(1, iterations + 1))
    assert logged == [before.max().item() for before, _ in clipped]  # what the step measured
    assert torch.equal(clipped[0][0], clipped[0][1])  # step 1 has lr 0 (warmup): the forward repeats
    first = next(step for step, (before, _) in enumerate(clipped) if before.max() > tau)
    assert 0 < first < UNCLIPPED_ITERATIONS, [before.max().item() for before, _ in clipped]
    assert _column(unclipped_run, "lm loss", range(1, first + 2)) == losses[:first + 1]
    before, after = clipped[first]
    assert torch.equal(unclipped[first][0], before)  # the same weights and batch until that step
    eta = (tau / before[0]).clamp(max=1.0)
    assert (eta < 1).any() and (eta == 1).any(), eta  # some heads of the first layer clipped, some not
    expected = unclipped[first][1][0] * eta
    assert torch.equal(after[0][eta == 1], expected[eta == 1])
    assert after[0] == pytest.approx(expected, rel=CLIP_RTOL), (after[0], expected, eta)
    ratios = [(a / tau).max().item() for _, a in clipped]
    print(f"largest logit of a step's batch after the step / tau: {max(ratios):.2f} clipped, "
          f"{max((a / tau).max().item() for _, a in unclipped):.2f} unclipped; "
          f"first clip at step {first + 1}, eta {eta.tolist()}, clipped heads against the unclipped run x eta "
          f"{((after[0] - expected) / expected).abs().max().item():.1e} relative")
