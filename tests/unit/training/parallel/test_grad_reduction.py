"""megatron_eopt/training/parallel/grad_reduction.py: fp32 accumulation into `main_grad` and the bucketed DP average,
each against an independent reference (autograd.grad per micro-batch; one all-reduce per
parameter)."""

import torch
import torch.distributed as dist

from megatron_eopt.training.parallel.grad_reduction import GradReducer, split_into_buckets


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).dtype)
    return model(inputs).float().pow(2).mean()


def test_bf16_gradients_are_summed_in_fp32_into_main_grad():
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    per_micro_batch = [torch.autograd.grad(_loss(model, seed), params) for seed in range(4)]
    reducer = GradReducer(model, dp_group=None, accumulate_in_fp32=True)
    for _ in range(2):  # a second step starts again from zero
        reducer.zero_grads()
        for seed in range(4):
            _loss(model, seed).backward()
    for index, param in enumerate(params):
        fp32_sum = sum(grads[index].float() for grads in per_micro_batch)
        assert param.grad is None and param.main_grad.dtype == torch.float32
        assert torch.equal(param.main_grad, fp32_sum)
    bf16_sums = [sum(grads[i] for grads in per_micro_batch).float() for i in range(len(params))]
    assert any(not torch.equal(p.main_grad, s) for p, s in zip(params, bf16_sums))  # the test can tell


def test_buckets_keep_order_and_dtype_and_size():
    params = [torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
              ((3, torch.float32), (4, torch.float32), (2, torch.bfloat16), (9, torch.bfloat16), (1, torch.bfloat16))]
    sizes = [[p.numel() for p in bucket] for bucket in split_into_buckets(params, bucket_numel=8)]
    assert sizes == [[3, 4], [2], [9], [1]]


def _reduce_both_ways(rank: int, world_size: int, dtype: torch.dtype, fp32: bool) -> tuple[int, int, float]:
    """(collectives of the bucketed average, parameters, max |bucketed - per-parameter reference|)."""
    model = _model(dtype)  # the same weights on every rank, a different micro-batch per rank
    reducer = GradReducer(model, dist.group.WORLD, accumulate_in_fp32=fp32, bucket_numel=150)
    reducer.zero_grads()
    _loss(model, seed=rank).backward()
    grads = [(p.main_grad if fp32 else p.grad).clone() for p in model.parameters()]
    for grad in grads:  # the reference: one all-reduce per parameter, then the mean
        dist.all_reduce(grad)
        grad.div_(world_size)
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, **kwargs: calls.append(tensor.numel()) or all_reduce(tensor, **kwargs)
    try:
        reducer.average_over_data_parallel()
    finally:
        dist.all_reduce = all_reduce
    reduced = [p.main_grad if fp32 else p.grad for p in model.parameters()]
    error = max((a - b).abs().max().item() for a, b in zip(reduced, grads))
    return len(calls), len(grads), error


def test_bucketed_average_equals_one_all_reduce_per_parameter(run_distributed):
    # 4 parameters of 128, 16, 64 and 4 elements: buckets [128, 16], [64, 4] at 150 elements.
    for dtype, fp32 in ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        for collectives, params, error in run_distributed(_reduce_both_ways, 2, args=(dtype, fp32)):
            assert (collectives, params) == (2, 4)
            assert error == 0.0  # halving is exact, and the sum of two is the same either way


def _expert_model() -> torch.nn.Module:
    model = _model(torch.float32)
    model[2].weight.allreduce = False  # megatron-core's tag for an expert parameter (at EP > 1)
    return model


def test_expert_parameters_need_their_group():
    import pytest

    with pytest.raises(ValueError, match="1 expert parameters .* pass expert_dp_group"):
        GradReducer(_expert_model(), dp_group=None, accumulate_in_fp32=False)


def _reduce_with_experts(rank: int, world_size: int, expert_dp_size: int) -> float:
    """DP 4; experts summed over groups of `expert_dp_size` ranks, divided by 4. Returns max error."""
    groups = [dist.new_group(list(range(start, start + expert_dp_size))) for start in range(0, world_size, expert_dp_size)]
    expert_dp_group = groups[rank // expert_dp_size]
    model = _expert_model()
    reducer = GradReducer(model, dist.group.WORLD, accumulate_in_fp32=False, expert_dp_group=expert_dp_group)
    _loss(model, seed=rank).backward()
    own = {name: p.grad.clone() for name, p in model.named_parameters()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, own)
    reducer.average_over_data_parallel()
    # The reference, by hand: dense parameters the mean over all ranks; the expert weight the sum
    # over this rank's expert-DP group divided by the whole DP size.
    members = range(rank // expert_dp_size * expert_dp_size, (rank // expert_dp_size + 1) * expert_dp_size)
    errors = []
    for name, param in model.named_parameters():
        ranks = members if name == "2.weight" else range(world_size)
        expected = sum(everyone[r][name] for r in ranks) / world_size
        errors.append((param.grad - expected).abs().max().item())
    for group in groups:
        dist.destroy_process_group(group)
    return max(errors)


def test_expert_gradients_summed_over_their_group_divided_by_dp(run_distributed):
    for expert_dp_size in (1, 2):  # EP 4 and EP 2 at DP 4
        errors = run_distributed(_reduce_with_experts, 4, args=(expert_dp_size,))
        assert max(errors) < 1e-7, (expert_dp_size, errors)
