"""--qk-layernorm (Megatron-LM's norm on each head's query and key), checked three ways.

- What it computes: scaling the query and key rows of every linear_qkv by 3 (rows found from
  megatron's documented layout, written out here: per key/value group its query heads, then its
  key, then its value) leaves the loss as it was with the flag (1e-5: the norm's epsilon) and
  changes it without.
- Tensor parallelism: the q/k norm weights are replicated over TP but each rank's gradient covers
  only its heads. One backward: each TP=2 rank's gradient alone differs from TP=1's, summed over
  TP (the trainer's finalize step) it is TP=1's (1e-6). Ten iterations: TP=2 (Muon) and TP=2 with
  sequence parallelism (Adam, --apply-layernorm-1p, RMSNorm) train as one process (losses,
  gradient and parameter norms, validation; the pipeline tests' tolerances).
- Weight decay: none on the q/k norms unless --apply-wd-to-qk-layernorm (megatron-core's rule).
"""

import pytest

from tests.pretrain_gpt_in_process import run_pretrain_gpt
from tests.unit.training.parallel.test_pretrain_gpt_pipeline import ARGV, OPTIMIZERS, _assert_same_training, run_training

QK_NORM = ["--qk-layernorm"]
HEADS, HEAD_DIM = 4, 8  # ARGV's 4 heads of width 32 / 4, one key/value group per head


def _loss_with_scaled_qk_rows(rank: int, world_size: int, qk_layernorm: bool) -> tuple[float, float]:
    """The loss of a fresh model, and again after its query and key rows are scaled by 3."""
    import torch

    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, gpt_loss, initialize_model_parallel

    initialize_model_parallel(1, seed=7)
    try:
        model = build_gpt_model(GPTModelSettings(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                                 num_query_groups=None, qk_layernorm=qk_layernorm,
                                                 init_method_std=0.2))  # logits of order 1
        tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = gpt_loss(model, tokens).item()
            for name, param in model.named_parameters():
                if name.endswith("linear_qkv.weight"):
                    for group in range(HEADS):  # rows [q | k | v] of each group, HEAD_DIM each
                        param[3 * HEAD_DIM * group: 3 * HEAD_DIM * group + 2 * HEAD_DIM] *= 3.0
            return before, gpt_loss(model, tokens).item()
    finally:
        destroy_model_parallel()


def test_query_and_key_norms_undo_a_scaling_of_their_projections(run_distributed) -> None:
    (normalized,) = run_distributed(_loss_with_scaled_qk_rows, 1, args=(True,))
    (plain,) = run_distributed(_loss_with_scaled_qk_rows, 1, args=(False,))
    assert normalized[1] == pytest.approx(normalized[0], rel=1e-5)
    assert plain[1] != pytest.approx(plain[0], rel=1e-3)  # measured 4.4e-3


def _qk_norm_grads_and_weight_decay(rank: int, world_size: int, sum_over_tp: bool, apply_wd: bool) -> dict:
    """One backward's gradients of the q/k norm weights (summed over TP when asked) and the
    weight decay of the optimizer group each of them is in."""
    import torch
    from megatron.core import parallel_state

    from megatron_eopt import OptimizerConfig, get_megatron_optimizer
    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, gpt_loss, initialize_model_parallel
    from megatron_eopt.training.parallel.grad_reduction import tensor_parallel_partial_params
    from megatron_eopt.training.parallel.sequence_parallel import sum_grads_over_tensor_parallel

    initialize_model_parallel(world_size, seed=3)
    try:
        model = build_gpt_model(GPTModelSettings(qk_layernorm=True, normalization="RMSNorm"))
        tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
        gpt_loss(model, tokens).backward()
        if sum_over_tp:
            sum_grads_over_tensor_parallel(tensor_parallel_partial_params([model]),
                                           parallel_state.get_tensor_model_parallel_group())
        qk_norms = {name: p for name, p in model.named_parameters() if "_layernorm" in name and "self_attention" in name}
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1,
                                                           apply_wd_to_qk_layernorm=apply_wd), [model])
        decay = {name: group["weight_decay"] for group in optimizer.param_groups for name, p in qk_norms.items()
                 if any(p is q for q in group["params"])}
        return {"grads": {name: p.grad.clone() for name, p in qk_norms.items()}, "weight_decay": decay}
    finally:
        destroy_model_parallel()


def test_qk_norm_grads_are_summed_over_tensor_parallel_ranks(run_distributed) -> None:
    import torch

    (full,) = run_distributed(_qk_norm_grads_and_weight_decay, 1, args=(False, False))
    halves = run_distributed(_qk_norm_grads_and_weight_decay, 2, args=(False, True))
    summed = run_distributed(_qk_norm_grads_and_weight_decay, 2, args=(True, False))
    names = set(full["grads"])
    assert len(names) == 2 * 2 and all(g.shape == (HEAD_DIM,) for g in full["grads"].values())  # 2 layers, q and k
    for name in names:
        assert not torch.allclose(halves[0]["grads"][name], full["grads"][name], atol=1e-6), name
        for rank in summed:
            torch.testing.assert_close(rank["grads"][name], full["grads"][name], rtol=1e-5, atol=1e-6)
    assert set(full["weight_decay"].values()) == {0.0} and set(halves[0]["weight_decay"].values()) == {0.1}
    assert set(full["weight_decay"]) == names


def test_tensor_parallel_qk_layernorm_trains_as_one_process(run_distributed) -> None:
    muon = ARGV + OPTIMIZERS["muon"] + QK_NORM
    reference = run_distributed(run_training, 1, args=(muon,))[0]
    _assert_same_training(run_distributed(run_training, 2, args=(muon + ["--tensor-model-parallel-size", "2"],)),
                          reference)
    adam = ARGV + OPTIMIZERS["adam"] + QK_NORM + ["--apply-layernorm-1p", "--normalization", "RMSNorm"]
    reference = run_distributed(run_training, 1, args=(adam,))[0]
    sequence_parallel = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _assert_same_training(run_distributed(run_training, 2, args=(adam + sequence_parallel,)), reference)


def test_max_attention_logit_is_logged_with_qk_layernorm(run_distributed) -> None:
    argv = ARGV + OPTIMIZERS["muon"] + QK_NORM + ["--log-max-attention-logit", "--train-iters", "2", "--eval-iters", "0"]
    (records,) = run_distributed(run_pretrain_gpt, 1, args=(argv,))
    # The first step's logits come from the initial norms (gain 1, bias 0): queries and keys of
    # width 8 and norm sqrt(8), so |q.k| / sqrt(8) <= sqrt(8).
    assert 0.0 < records[0]["max_attention_logit"] <= 8 ** 0.5 * (1 + 1e-5), records
