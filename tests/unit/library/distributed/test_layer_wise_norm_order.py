"""The layer-wise optimizer's gradient norm is megatron-core's LayerWiseDistributedOptimizer's, bit for
bit, whoever owns the parameters (distributed/layer_wise_norm_order.py).

The reference is megatron-core's: its own ping-pong deal of the parameters to the data-parallel ranks
(`LayerWiseDistributedOptimizer._shard_params_ping_pong`, as Megatron-LM's loop builds it), and its
norm (clip_grads.py's get_grad_norm_fp32 over utils.local_multi_tensor_l2_norm, written out: each
rank's fp32 norm of the vector of its gradients' norms, squared, summed over the ranks). The
parameters come in the order of the non-distributed optimizer's children, which the matrix's
one-rank cell holds to megatron-core's (tests/megatron_lm_matrix.py). Over 4 ranks the deal is
0 1 2 3 3 2 1 0 ..., ours by Newton-Schulz cost: the ranks' parts differ, so their sum rounds
otherwise in the last bit (without the reordering the first case already differs by 1 ulp, measured).
"""

import types

import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model
from tests.gpt_training import model_parallel

SETTINGS = GPTModelSettings(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=8)
MUON = dict(optimizer="muon", lr=0.003, min_lr=0.0, weight_decay=0.05, clip_grad=1.0,
            muon_fp32_matmul_prec="highest")


def _set_grads(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """The same gradients on every rank (already averaged, as megatron-core's DDP leaves them), times `scale`."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 0.1 * scale


def _megatron_core_norm(plain, group) -> float:
    """megatron-core's layer-wise norm over the parameters in `plain`'s children's order."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    optimizers = [types.SimpleNamespace(param_groups=[{"params": list(g["params"])} for g in child.optimizer.param_groups])
                  for child in plain.chained_optimizers]
    deal = types.SimpleNamespace(dp_cp=group, expt_dp=None)
    LayerWiseDistributedOptimizer._shard_params_ping_pong(deal, optimizers, torch.distributed.get_world_size(group), 1)
    grads = [p.grad for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]]
    norms = [torch.norm(grad) for grad in grads]
    square = torch.tensor([float(torch.norm(torch.tensor(norms)))]) ** 2
    torch.distributed.all_reduce(square, group=group)
    return square.item() ** 0.5


def _norms_body(rank: int, world_size: int) -> list[tuple]:
    from megatron.core import parallel_state as ps

    cases = []
    for seed, reduce_grads in ((0, False), (1, False), (2, True), (3, True)):
        with model_parallel(1, seed=7):
            model = build_gpt_model(SETTINGS)
            plain = get_megatron_optimizer(OptimizerConfig(**MUON), [model])  # fp32: main params are the model's
            layer_wise = get_megatron_optimizer(OptimizerConfig(**MUON, use_layer_wise_distributed_optimizer=True,
                                                                layer_wise_reduce_grads=reduce_grads), [model])
            _set_grads(model, seed)
            expected = _megatron_core_norm(plain, ps.get_data_parallel_group())
            phases_norm = layer_wise.get_grad_norm()  # megatron-core's phases (step_phases.py)
            if reduce_grads:  # averaged onto the owners by the step: 4 x (rank 0), 0, 0, 0 give them exactly x
                _set_grads(model, seed, scale=float(world_size) if rank == 0 else 0.0)
            ok, step_norm, _ = layer_wise.step()
            cases.append((seed, reduce_grads, ok, expected, phases_norm, step_norm))
    return cases


def test_layer_wise_norm_is_megatron_core_ping_pong_sum_bitwise(run_distributed) -> None:
    """With the gradients on every rank (megatron-core DDP's all-reduce) and reduced onto the owners."""
    for per_rank in run_distributed(_norms_body, world_size=4, timeout=300):
        for seed, reduce_grads, ok, expected, phases_norm, step_norm in per_rank:
            assert ok and expected > MUON["clip_grad"], (seed, expected)  # the step clips by it
            assert step_norm == expected, (seed, reduce_grads, step_norm, expected)
            assert phases_norm == expected or reduce_grads, (seed, phases_norm, expected)  # not yet averaged
