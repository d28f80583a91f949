"""Muon step time and optimizer state per rank: layer-wise distributed against replicated.

Both step the same GPT-shaped fp32 weights (hidden 512, 4 layers, GQA, SwiGLU by default;
megatron-core's names, so QKV and fc1 are split as in a real model) with the same gradients
on every rank (already all-reduced, as after DDP), built by
get_megatron_optimizer(optimizer='muon') over the data-parallel group WORLD. Replicated: every
rank orthogonalizes every matrix. Layer-wise (use_layer_wise_distributed_optimizer=True): each
rank owns whole parameters, keeps state for and steps only those, then broadcasts them; the
design goal at 2 ranks is a step ratio of about 0.55 and about half the state.

    torchrun --nproc-per-node 2 benchmarks/layer_wise_vs_replicated.py [--json PATH]

gloo on CPU; NCCL with one GPU per rank when CUDA is available. Median of several steps after
warm-up, the two optimizers interleaved, each step timed on the slowest rank. Prints numbers
(rank 0); asserts nothing.
"""


import torch
import torch.distributed as dist


from _distributed import gather_ints, gpt_benchmark_parser, init_distributed, time_interleaved
from _gpt import GptWeights, shape_from
from _timing import write_json

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer


def state_tensor_bytes(optimizer) -> int:
    """Bytes of the tensors in the optimizer state of every child (fp32: no main copies)."""
    return sum(
        t.numel() * t.element_size()
        for child in optimizer.chained_optimizers
        for state in child.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )


def main() -> None:
    args = gpt_benchmark_parser(__doc__.splitlines()[0]).parse_args()
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    shape = shape_from(args)
    torch.manual_seed(0)  # the same weights and gradients on every rank
    models = {"layer_wise": GptWeights(shape).to(device), "replicated": GptWeights(shape).to(device)}
    models["replicated"].load_state_dict(models["layer_wise"].state_dict())
    grads = [torch.randn_like(p) for p in models["layer_wise"].parameters()]
    groups = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=dist.group.WORLD)
    optimizers = {
        name: get_megatron_optimizer(
            OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1, clip_grad=1.0,
                            use_layer_wise_distributed_optimizer=(name == "layer_wise")),
            model, config_overrides={}, pg_collection=groups,
        )
        for name, model in models.items()
    }

    def set_grads(model: torch.nn.Module) -> None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()

    seconds = time_interleaved(
        {name: optimizer.step for name, optimizer in optimizers.items()},
        {name: (lambda m=model: set_grads(m)) for name, model in models.items()},
        args.warmup, args.repeats, device,
    )
    state_bytes = {
        "layer_wise": gather_ints(optimizers["layer_wise"].optimizer_state_bytes(), device),
        "replicated": gather_ints(state_tensor_bytes(optimizers["replicated"]), device),
    }
    # Sanity: both took the same steps from the same start, so the weights should agree.
    difference = torch.tensor(max((a - b).abs().max().item() for a, b in zip(
        models["layer_wise"].parameters(), models["replicated"].parameters())), device=device)
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)

    if rank == 0:
        params = sum(p.numel() for p in models["replicated"].parameters())
        report(args, device, world_size, params, seconds, state_bytes, difference.item())
    dist.destroy_process_group()


def report(args, device, world_size, params, seconds, state_bytes, difference) -> None:
    step_ratio = seconds["layer_wise"] / seconds["replicated"]
    state_ratio = max(state_bytes["layer_wise"]) / max(state_bytes["replicated"])
    print(f"{params / 1e6:.1f}M fp32 parameters (hidden {args.hidden}, {args.layers} layers), "
          f"{world_size} ranks on {device.type}, {torch.get_num_threads()} threads/rank, "
          f"torch {torch.__version__}, median of {args.repeats} steps")
    print(f"{'':12} {'step ms':>9} {'state MiB per rank':>24}")
    for name in ("layer_wise", "replicated"):
        per_rank = " ".join(f"{b / 2**20:7.2f}" for b in state_bytes[name])
        print(f"{name:12} {seconds[name] * 1e3:9.1f} {per_rank:>24}")
    print(f"ratio layer-wise / replicated: step {step_ratio:.3f} (goal ~0.55), "
          f"state {state_ratio:.3f} (largest rank)")
    print(f"max |weight difference| after {args.warmup + args.repeats} steps: {difference:.2e}")
    write_json(args.json, {
        "model": shape_from(args).describe(), "world_size": world_size, "device": device.type,
        "threads_per_rank": torch.get_num_threads(), "parameters": params, "repeats": args.repeats,
        "step_ms": {name: s * 1e3 for name, s in seconds.items()}, "step_ratio": step_ratio,
        "state_bytes_per_rank": state_bytes, "state_ratio": state_ratio, "max_weight_difference": difference,
    })


if __name__ == "__main__":
    main()
