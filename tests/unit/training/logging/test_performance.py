"""megatron_eopt/training/logging/performance.py: the FLOP count behind --log-throughput and the start-up notes of the
profiling flags (the trainer runs with them are in tests/unit/training/test_pretrain_gpt_flags.py).

The FLOPs expected here are counted by hand for each model, from the standard GPT count
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 5.1):
2 FLOPs per multiply-add, backward twice the forward (3x in all), per token and layer the QKV and
output projections, the attention scores and their product with V (halved: causal mask, as
Megatron-LM counts them), the MLP's matrices; then the logits. Layer norms, softmax, the MoE
router and the embedding lookup are not counted (nor are they by Megatron-LM).
"""

import argparse

import pytest

from megatron_eopt.training.model.gpt import GPTModelSettings
from megatron_eopt.training.logging.performance import flops_per_iteration, performance_lines


def hand_count(batch: int, seq: int, layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int,
               swiglu: bool, experts_per_token: int = 1, head_dim: int | None = None) -> int:
    """One global batch's FLOPs, forward and backward (head_dim: --kv-channels, default h / heads)."""
    head_dim = head_dim or hidden // heads
    attention = heads * head_dim  # the queries' width (the hidden size unless --kv-channels)
    qkv = 2 * hidden * (attention + 2 * groups * head_dim)  # per token: q, and k, v for each group
    scores_and_values = 2 * 2 * seq * attention // 2  # QK^T and AV over the causal half of the sequence
    out = 2 * attention * hidden
    mlp = (3 if swiglu else 2) * 2 * hidden * ffn * experts_per_token  # SwiGLU: gate, up, down
    logits = 2 * hidden * vocab
    return 3 * batch * seq * (layers * (qkv + scores_and_values + out + mlp) + logits)


@pytest.mark.parametrize("settings,groups,experts_per_token", [
    (GPTModelSettings(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                      ffn_hidden_size=256, swiglu=False, seq_length=32, vocab_size=100), 4, 1),
    (GPTModelSettings(num_layers=3, hidden_size=96, num_attention_heads=8, num_query_groups=2,
                      ffn_hidden_size=160, swiglu=True, seq_length=48, vocab_size=384), 2, 1),
    (GPTModelSettings(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                      ffn_hidden_size=96, swiglu=True, seq_length=16, vocab_size=64, num_moe_experts=4,
                      moe_router_topk=3), 4, 3),
    (GPTModelSettings(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                      ffn_hidden_size=128, swiglu=True, seq_length=16, vocab_size=64), 2, 1),
], ids=["mha-gelu", "gqa-swiglu", "moe-top3", "kv-channels"])
def test_flops_per_iteration_is_the_hand_count(settings: GPTModelSettings, groups: int, experts_per_token: int) -> None:
    expected = hand_count(8, settings.seq_length, settings.num_layers, settings.hidden_size,
                          settings.num_attention_heads, groups, settings.ffn_hidden_size, settings.vocab_size,
                          settings.swiglu, experts_per_token, settings.kv_channels)
    assert flops_per_iteration(settings, 8) == expected


def test_flops_of_the_textbook_model() -> None:
    """The closed form for MHA with a 4h GELU MLP, 72 B s l h^2 (1 + s / (12 h) + V / (12 l h))
    (Narayanan et al.'s eq. 3 with the attention scores halved for the causal mask)."""
    b, s, l, h, v = 4, 128, 6, 256, 1000
    settings = GPTModelSettings(num_layers=l, hidden_size=h, num_attention_heads=8, num_query_groups=None,
                                ffn_hidden_size=4 * h, swiglu=False, seq_length=s, vocab_size=v)
    closed_form = 72 * b * s * l * h**2 * (1 + s / (12 * h) + v / (12 * l * h))
    assert flops_per_iteration(settings, b) == pytest.approx(closed_form, rel=1e-12)


def _args(**given) -> argparse.Namespace:
    values = dict(log_throughput=False, profile=False, use_pytorch_profiler=False, profile_step_start=10,
                  profile_step_end=12, profile_ranks=[], profile_flags_given=[], tensorboard_dir=None, train_iters=100)
    values.update(given)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("args,on_cuda,expected", [
    (_args(), False, []),
    (_args(log_throughput=True), False, ["--log-throughput: TFLOP/s/GPU counts per process here (no GPUs)"]),
    (_args(log_throughput=True), True, []),
    (_args(profile=True), False, ["--profile: no effect here, the CUDA profiler capture range needs CUDA; "
                                  "--use-pytorch-profiler profiles on CPU"]),
    (_args(profile=True, profile_ranks=[0, 2]), True,
     ["--profile: CUDA profiler capture range (nsys --capture-range=cudaProfilerApi) over iterations 11-12 "
      "on ranks [0, 2]"]),
    (_args(profile=True, use_pytorch_profiler=True, tensorboard_dir="runs/tb", profile_step_start=3,
           profile_step_end=6), False,
     ["--profile --use-pytorch-profiler: torch.profiler records iterations 3-5 of this run on every rank, trace "
      "runs/torch_profile/rank-<rank>.json.gz"]),
    (_args(profile=True, use_pytorch_profiler=True, tensorboard_dir="tb", train_iters=5), False,
     ["--profile --use-pytorch-profiler: torch.profiler records iterations 10-11 of this run on every rank, trace "
      "torch_profile/rank-<rank>.json.gz (none of --train-iters 5: nothing is profiled)"]),
    (_args(use_pytorch_profiler=True, profile_flags_given=["--use-pytorch-profiler", "--profile-step-end"]), False,
     ["--use-pytorch-profiler, --profile-step-end: no effect without --profile (as in Megatron-LM)"]),
], ids=["nothing", "throughput-cpu", "throughput-cuda", "profile-cpu", "profile-cuda", "pytorch-profiler",
        "pytorch-profiler-past-the-end", "details-without-profile"])
def test_start_up_lines_say_what_the_flags_do(args: argparse.Namespace, on_cuda: bool, expected: list[str]) -> None:
    assert performance_lines(args, on_cuda) == expected
