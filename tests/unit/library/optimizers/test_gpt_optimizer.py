"""get_megatron_optimizer on megatron-core's real GPTModel (CPU, gloo).

Tensor parallelism must not change the math: TP=2 takes the same steps as TP=1 (losses,
gradient norms, and each rank's shard of every parameter, to 1e-5 in fp32: the matmuls are
split differently, so round-off differs). Process groups come from megatron-core's
parallel_state, as in a Megatron-LM run.
"""

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, swiglu=True, vocab_size=64, seq_length=16)
CONFIG = dict(lr=3e-3, min_lr=3e-4, decoupled_lr=1e-3, weight_decay=0.1, clip_grad=0.3)


def fixed_batch() -> torch.Tensor:
    """One batch, reused every step, so that a falling loss shows the optimizer works."""
    generator = torch.Generator().manual_seed(1000)
    return torch.randint(0, SETTINGS.vocab_size, (4, SETTINGS.seq_length + 1), generator=generator)


def snapshot(model: torch.nn.Module) -> dict:
    """name -> (value, partition_dim or -1, partition_stride): what `local_shard` needs."""
    return {
        name: (p.detach().clone(),
               getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1,
               getattr(p, "partition_stride", 1))
        for name, p in model.named_parameters()
    }


def train_gpt(settings: GPTModelSettings, config: OptimizerConfig, tp: int, steps: int, seed: int,
              tokens: torch.Tensor) -> dict:
    """`steps` optimizer steps on one batch at tensor parallelism `tp` (megatron parallel_state)."""
    from megatron.core import parallel_state

    initialize_model_parallel(tp, seed=seed)
    try:
        model = build_gpt_model(settings)
        optimizer = get_megatron_optimizer(config, [model])
        losses, norms = [], []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = gpt_loss(model, tokens)
            loss.backward()
            ok, grad_norm, _ = optimizer.step()
            assert ok
            losses.append(loss.item())
            norms.append(grad_norm)
        return {
            "losses": losses,
            "norms": norms,
            "params": snapshot(model),
            "groups": [(g["group_key"], len(g["params"])) for g in optimizer.param_groups],
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        }
    finally:
        destroy_model_parallel()


def train(tp: int, steps: int) -> dict:
    return train_gpt(SETTINGS, OptimizerConfig(**CONFIG), tp, steps, seed=7, tokens=fixed_batch())


def local_shard(full: torch.Tensor, partition_dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """The part of a TP=1 tensor that TP rank `rank` of `size` holds (megatron's layout)."""
    if partition_dim < 0:
        return full
    # With partition_stride k the tensor is k blocks (e.g. [gate; up]), each split over ranks.
    blocks = full.chunk(stride, dim=partition_dim)
    return torch.cat([block.chunk(size, dim=partition_dim)[rank] for block in blocks], dim=partition_dim)


def _tp_equivalence_body(rank: int, world_size: int, steps: int) -> dict:
    reference = train(tp=1, steps=steps)  # DP=2: both ranks take the same steps on the same batch
    sharded = train(tp=2, steps=steps)
    errors = {}
    for name, (shard, dim, stride) in sharded["params"].items():
        expected = local_shard(reference["params"][name][0], dim, stride, dist.get_rank(), 2)
        errors[name] = (shard - expected).abs().max().item()
    return {
        "loss_pairs": list(zip(reference["losses"], sharded["losses"])),
        "norm_pairs": list(zip(reference["norms"], sharded["norms"])),
        "errors": errors,
        "groups": sharded["groups"],
    }


def test_tensor_parallel_gpt_steps_equal_tp1(run_distributed) -> None:
    for result in run_distributed(_tp_equivalence_body, world_size=2, args=(4,)):
        for tp1, tp2 in result["loss_pairs"]:
            assert abs(tp1 - tp2) < 1e-5, result["loss_pairs"]
        for tp1, tp2 in result["norm_pairs"]:
            assert abs(tp1 - tp2) < 1e-5 * tp1, result["norm_pairs"]
        assert max(n for n, _ in result["norm_pairs"]) > CONFIG["clip_grad"]  # clipping active
        bad = {name: e for name, e in result["errors"].items() if e > 1e-5}
        assert not bad, bad
        assert result["loss_pairs"][-1][0] < result["loss_pairs"][0][0]  # it trains
        # default, no-decay and decoupled-lr groups, every one non-empty at TP=2
        assert len(result["groups"]) == 3 and all(n > 0 for _, n in result["groups"])
