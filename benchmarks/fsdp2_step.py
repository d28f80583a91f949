"""Muon on a torch FSDP2 model: our owner-per-matrix step against the redundant one, state, bytes.

A megatron-core GPT sharded with `fully_shard` (each layer, then the root) on all ranks. Timed:
the Muon part of one step (the inner TensorParallelMuon step over the local shards) against an
AReaL-style redundant step (every matrix's `full_tensor()` and Newton-Schulz on every rank, the
same blocks, keeping the local rows). Also: optimizer-state bytes per rank against the unsharded
optimizer's, and the bytes a step exchanges against the lower bound of two shard volumes per
matrix.

    torchrun --nproc-per-node 4 benchmarks/fsdp2_step.py [--hidden 512 --layers 4]

gloo on CPU (fp32, 'highest'); NCCL with one GPU per rank under CUDA. Medians after warm-up,
interleaved, on the slowest rank. Prints numbers (rank 0); asserts nothing.
"""


import torch
import torch.distributed as dist


from _distributed import gpt_benchmark_parser, init_distributed, time_iterations
from _timing import write_json

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.ops.newton_schulz import orthogonalize_batched
from megatron_eopt.ops.splits import merge_blocks, split_blocks
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    initialize_model_parallel,
)


def build(settings: GPTModelSettings, device: torch.device) -> torch.nn.Module:
    initialize_model_parallel(1, seed=1234)
    try:
        return build_gpt_model(settings, device)
    finally:
        destroy_model_parallel()


def gathered_momentum(inner, p: torch.nn.Parameter, group: dict, mesh):
    """The simpler design's first half: the momentum update on this rank's shard of `p`, then
    the whole matrix of momenta on every rank (an all-gather); returns it and `p`'s row shards."""
    from torch.distributed.tensor import DTensor, Shard

    shards = inner._row_shards_of[id(p)]
    momentum = inner.state[p]["momentum_buffer"]
    momentum.lerp_(p.grad, 1 - group["momentum"])
    shape = shards.layout.local_shape
    full = DTensor.from_local(momentum, mesh, [Shard(0)], shape=torch.Size(shape), stride=(shape[1], 1)).full_tensor()
    return full, shards


def redundant_step(muon, mesh) -> None:
    """AReaL-style: momentum on the shard, then every rank all-gathers and orthogonalizes every matrix."""
    rank = dist.get_rank()
    group = muon.param_groups[0]
    fulls, items = [], []
    for p in (p for g in muon.param_groups for p in g["params"]):
        full, shards = gathered_momentum(muon, p, group, mesh)
        fulls.append(full)
        items.append((p, shards))
    blocks = [split_blocks(full, s.layout) for full, (_, s) in zip(fulls, items)]
    scales = [muon.settings.scale(*shape) for _, s in items for shape in s.layout.global_block_shapes()]
    with torch.no_grad():
        results = orthogonalize_batched([b for per in blocks for b in per], scales, muon.settings)
        start = 0
        for per, (p, s) in zip(blocks, items):
            whole = merge_blocks(results[start:start + len(per)], s.layout)
            start += len(per)
            p.add_(whole.split(s.rows_by_rank)[rank], alpha=-group["lr"])


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for child in optimizer.chained_optimizers
               for s in child.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def row_shards(inner):
    """Each matrix's row shards over the ranks (its owner, rows by rank, layout)."""
    return [inner._row_shards_of[id(p)] for group in inner.param_groups for p in group["params"]]


def exchanged_bytes(muon, world_size: int) -> tuple[int, int]:
    """(bytes all ranks send per step for the Muon matrices, two shard volumes per matrix)."""
    sent, bound = 0, 0
    for s in row_shards(muon):
        cols = s.layout.local_shape[1]
        non_owner_rows = sum(rows for r, rows in enumerate(s.rows_by_rank) if r != s.owner)
        sent += 2 * non_owner_rows * cols * 4  # there and back, fp32
        bound += 2 * (s.layout.local_shape[0] // world_size) * cols * 4 * (world_size - 1)
    return sent, bound


def sharded_gpt_optimizer(args, config: OptimizerConfig, device: torch.device):
    """A GPT of --hidden/--layers sharded with fully_shard (each layer, then the root) over all
    ranks, its optimizer with random gradients in place, and the inner optimizer of the first
    child (the matrices') ready to step: (settings, mesh, optimizer, inner)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    heads = max(1, args.hidden // 64)
    settings = GPTModelSettings(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
                                num_query_groups=max(1, heads // 2), ffn_hidden_size=4 * args.hidden,
                                vocab_size=1024, seq_length=128)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = build(settings, device)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = get_megatron_optimizer(config, [model])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    child = optimizer.chained_optimizers[0]
    child.grad_stats(False)  # local gradients in place on the shard aliases
    return settings, mesh, optimizer, child.optimizer


def muon_benchmark(description: str):
    """The command line, the device and a Muon config, fp32 Newton-Schulz on CPU (bf16 is emulated
    there) and megatron-core's 'medium' on GPUs: (args, device, precision, config)."""
    args = gpt_benchmark_parser(description).parse_args()
    device = init_distributed()
    precision = "highest" if device.type == "cpu" else "medium"
    return args, device, precision, OptimizerConfig(optimizer="muon", lr=1e-3, muon_fp32_matmul_prec=precision)


def max_over_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def main() -> None:
    args, device, precision, config = muon_benchmark(__doc__.splitlines()[0])
    settings, mesh, optimizer, muon = sharded_gpt_optimizer(args, config, device)
    seconds = time_iterations({"ours": muon.step, "redundant": lambda: redundant_step(muon, mesh)}, args, device)
    local_state = max_over_ranks(state_bytes(optimizer), device)
    unsharded = build(settings, device)
    from megatron_eopt.runtime.process_groups import ParallelGroups

    full_state = state_bytes(get_megatron_optimizer(config, [unsharded], pg_collection=ParallelGroups.single_process()))
    sent, bound = exchanged_bytes(muon, dist.get_world_size())
    if dist.get_rank() == 0:
        ratio = seconds["ours"] / seconds["redundant"]
        print(f"FSDP2 Muon, GPT hidden {args.hidden}, {args.layers} layers, {dist.get_world_size()} ranks on "
              f"{device.type} ({precision}), median of {args.repeats} steps")
        print(f"Muon step: ours {seconds['ours'] * 1e3:.1f} ms, redundant {seconds['redundant'] * 1e3:.1f} ms, "
              f"ratio {ratio:.3f}")
        print(f"state bytes: max per rank {local_state}, unsharded {full_state}, "
              f"ratio {local_state / full_state:.3f}")
        print(f"exchanged per step (all ranks, Muon matrices): {sent} bytes; two shard volumes per matrix "
              f"(even split): {bound} bytes")
        write_json(args.json, {"step_ms": {n: s * 1e3 for n, s in seconds.items()}, "step_ratio": ratio,
                               "state_ratio": local_state / full_state, "exchanged_bytes": sent,
                               "two_shard_volumes_bytes": bound, "exchanged_over_bound": sent / bound,
                               "world_size": dist.get_world_size(),
                               "device": device.type})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
