"""`--overlap-grad-reduce` (issue #14 item 5, CPU): each gradient bucket's data-parallel
all-reduce starts during the last micro-batch's backward, and the results are those of the
reduction after backward, bit for bit.

GradReducer directly: no bucket starts before the last micro-batch, every bucket has started
when its backward returns, and the gradients equal the non-overlapped reducer's exactly. The
trainer: DP=2 (adam; bf16 muon, fp32 main_grad), PP=2 x DP=2 (tied embeddings: their sum
over the pipeline must wait for the overlapped buckets) and MoE at EP=2 x DP=4 (expert buckets
over the expert data-parallel group) with small buckets log the same losses
and gradient norms with and without the flag; with the layer-wise optimizer (which then takes
averaged gradients instead of reducing onto owners) it trains as one process.
"""

import torch
import torch.distributed as dist

from megatron_eopt.training.parallel.grad_reduction import GradReducer
from tests.pretrain_gpt_in_process import run_pretrain_gpt
from tests.unit.training.parallel.test_grad_reduction import _loss, _model
from tests.unit.training.parallel.test_pretrain_gpt_pipeline import ARGV, OPTIMIZERS, _assert_same_training, run_training

MICRO_BATCHES = 3


def _overlapped_and_not(rank: int, world_size: int, dtype: torch.dtype, fp32: bool) -> dict:
    reducers = {}
    for overlap in (False, True):
        model = _model(dtype)
        reducer = GradReducer(model, dist.group.WORLD, accumulate_in_fp32=fp32, bucket_numel=150, overlap=overlap)
        reducer.zero_grads(MICRO_BATCHES)
        started = []
        for micro_batch in range(MICRO_BATCHES):
            _loss(model, seed=10 * rank + micro_batch).backward()
            started.append(reducer.buckets_started)
        reducer.average_over_data_parallel()
        grads = [(p.main_grad if fp32 else p.grad).clone() for p in model.parameters()]
        reducers[overlap] = {"started": started, "buckets": len(reducer.buckets), "grads": grads}
    return reducers


def test_buckets_start_in_the_last_backward_and_give_the_same_gradients(run_distributed) -> None:
    for dtype, fp32 in ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        for ranks in run_distributed(_overlapped_and_not, 2, args=(dtype, fp32)):
            plain, overlapped = ranks[False], ranks[True]
            assert plain["buckets"] == overlapped["buckets"] == 2
            assert plain["started"] == [0, 0, 0]  # everything after backward
            assert overlapped["started"] == [0, 0, 2]  # both during the last backward
            for a, b in zip(plain["grads"], overlapped["grads"]):
                assert torch.equal(a, b)


OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]  # several buckets for this model


def test_trainer_with_overlap_logs_the_same_run(run_distributed) -> None:
    runs = {"DP=2 adam": (2, OPTIMIZERS["adam"]),
            "DP=2 bf16 muon": (2, OPTIMIZERS["muon"] + ["--bf16", "--train-iters", "4", "--eval-iters", "0"]),
            "PP=2 x DP=2 muon": (4, OPTIMIZERS["muon"] + ["--pipeline-model-parallel-size", "2"]),
            # expert buckets summed over the expert data-parallel group (EP=2 of DP=4)
            "EP=2 x DP=4 MoE adam": (4, OPTIMIZERS["adam"] + ["--num-experts", "4", "--disable-bias-linear",
                                                              "--expert-model-parallel-size", "2",
                                                              "--moe-aux-loss-coeff", "0.1"])}
    for name, (world_size, flags) in runs.items():
        argv = ARGV + flags + ["--ddp-bucket-size", "2000"]
        plain = run_distributed(run_pretrain_gpt, world_size, args=(argv,))
        overlapped = run_distributed(run_pretrain_gpt, world_size, args=(argv + ["--overlap-grad-reduce"],))
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in overlapped[0]] == [r[key] for r in plain[0]], (name, key)


def test_layer_wise_optimizer_with_overlapped_reduction_trains_as_one_process(run_distributed) -> None:
    argv = ARGV + OPTIMIZERS["muon layer-wise"]
    reference = run_distributed(run_training, 1, args=(argv,))[0]
    _assert_same_training(run_distributed(run_training, 2, args=(argv + OVERLAP,)), reference)
