"""TensorParallelMuon step time at TP=2 (or 4) in tp_mode 'duplicated', 'distributed', 'sharded', 'auto'.

Every rank holds its megatron-core shard of GPT-shaped fp32 weights (hidden 512, 4 layers, GQA,
SwiGLU by default): linear_qkv and linear_fc1 column-parallel (qkv split into q/k/v per query
group, fc1 into gate/up), linear_proj and linear_fc2 row-parallel; no layer norms.
'duplicated' all-gathers each matrix and orthogonalizes it on every rank; 'distributed'
all-reduces the Gram matrix in each Newton-Schulz iteration; 'sharded' orthogonalizes each
matrix on one rank (two all-to-alls); 'auto' picks one per matrix from the cost model
(ops/muon_cost.py, rates calibrated here), whose predicted steps are printed too.
Design goal: sharded / duplicated <= 0.6 at TP=2.

    torchrun --nproc-per-node 2 benchmarks/tp_modes.py [--json PATH]

gloo on CPU (NCCL on GPUs); fp32_matmul_prec='highest'. Median of several steps after warm-up,
the modes interleaved, each timed on the slowest rank. Prints numbers (rank 0); asserts nothing.
"""

import argparse

import torch
import torch.distributed as dist


from _distributed import gpt_benchmark_parser, init_distributed, time_interleaved
from _gpt import gpt_weight_shapes, matrix_layout, shape_from
from _timing import write_json

from megatron_eopt.ops.muon_cost import step_time_s
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

MODES = ("duplicated", "distributed", "sharded", "auto")


def local_shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of a global weight, as megatron-core's parallel linear layers hold it."""
    if name.endswith("linear_fc1.weight"):  # partition_stride=2: rank r holds [gate_r; up_r]
        return torch.cat([half.chunk(tp, dim=0)[rank] for half in full.chunk(2, dim=0)])
    dim = 0 if name.endswith("linear_qkv.weight") else 1  # qkv: whole query groups per rank
    return full.chunk(tp, dim=dim)[rank].contiguous()


def check_divisible(args: argparse.Namespace, ffn: int, tp: int) -> None:
    for what, value in (("--heads", args.heads), ("--groups", args.groups), ("ffn", ffn), ("--hidden", args.hidden)):
        if value % tp:
            raise ValueError(f"{what}={value} must be a multiple of TP={tp} (the number of ranks).")
    if args.heads % args.groups or args.hidden % args.heads:
        raise ValueError(
            f"--heads={args.heads} must divide --hidden={args.hidden} and be a multiple of --groups={args.groups}."
        )


def main() -> None:
    parser = gpt_benchmark_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    device = init_distributed()
    rank, tp = dist.get_rank(), dist.get_world_size()
    ffn = int(args.hidden * 2.75)
    check_divisible(args, ffn, tp)

    shape = shape_from(args)
    shapes = gpt_weight_shapes(shape, norms=False)
    torch.manual_seed(0)  # the same global weights and gradients on every rank
    names = list(shapes)
    weights = {n: local_shard(n, torch.randn(shapes[n]) * 0.02, rank, tp).to(device) for n in names}
    grads = {n: local_shard(n, torch.randn(shapes[n]), rank, tp).to(device) for n in names}
    layouts = {n: matrix_layout(n, tuple(w.shape), tp, shape) for n, w in weights.items()}
    params = {mode: [torch.nn.Parameter(weights[n].clone()) for n in names] for mode in MODES}
    optimizers = {
        mode: TensorParallelMuon([{"params": params[mode], "param_fqns": names}], lr=1e-3, weight_decay=0.1,
                                 fp32_matmul_prec="highest", tp_mode=mode, tp_group=dist.group.WORLD, layouts=layouts)
        for mode in MODES
    }

    def set_grads(mode: str) -> None:
        for p, n in zip(params[mode], names):
            p.grad = grads[n].clone()

    seconds = time_interleaved(
        {mode: optimizers[mode].step for mode in MODES},
        {mode: (lambda m=mode: set_grads(m)) for mode in MODES},
        args.warmup, args.repeats, device,
    )
    auto = optimizers["auto"]
    ordered = [layouts[n] for n in names]
    predicted = {mode: step_time_s(ordered, [auto.tp_modes[n] if mode == "auto" else mode for n in names], tp,
                                   auto.tp_profile, auto.settings, "highest") for mode in MODES}
    # Sanity: every mode computes the TP=1 update, so the weights should agree to round-off.
    differences = torch.tensor([max((a - b).abs().max().item() for a, b in zip(params[mode], params["duplicated"]))
                                for mode in MODES], device=device)
    dist.all_reduce(differences, op=dist.ReduceOp.MAX)

    if rank == 0:
        report(args, shapes, tp, device, seconds, dict(zip(MODES, differences.tolist())), predicted, auto)
    dist.destroy_process_group()


def report(args, shapes: dict, tp: int, device: torch.device, seconds: dict, differences: dict, predicted: dict,
           auto: TensorParallelMuon) -> None:
    matrices = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"{matrices / 1e6:.1f}M fp32 matrix parameters (hidden {args.hidden}, {args.layers} layers), "
          f"TP={tp} on {device.type}, {torch.get_num_threads()} threads/rank, torch {torch.__version__}, "
          f"median of {args.repeats} steps")
    profile = auto.tp_profile
    print(f"profile: {profile.fp32_flops / 1e9:.1f} GFLOP/s fp32, link {profile.link_bytes_per_s / 1e9:.2f} GB/s, "
          f"{profile.collective_latency_s * 1e6:.0f} us per collective ({profile.notes})")
    chosen = sorted(set(auto.tp_modes.values()))
    print(f"auto chose: {', '.join(f'{m} x{list(auto.tp_modes.values()).count(m)}' for m in chosen)}")
    for mode in MODES:
        print(f"{mode:12} {seconds[mode] * 1e3:9.1f} ms (predicted {predicted[mode] * 1e3:8.1f} ms)   "
              f"max |weight - duplicated's| {differences[mode]:.1e}")
    ratios = {mode: seconds[mode] / seconds["duplicated"] for mode in MODES}
    fixed = min(MODES[:3], key=lambda mode: seconds[mode])
    print(f"ratio sharded / duplicated      {ratios['sharded']:.3f} (goal <= 0.6)")
    print(f"ratio distributed / duplicated  {ratios['distributed']:.3f}")
    print(f"ratio auto / fastest fixed ({fixed}) {seconds['auto'] / seconds[fixed]:.3f}")
    write_json(args.json, {
        "model": shape_from(args).describe(), "tp": tp, "device": device.type,
        "threads_per_rank": torch.get_num_threads(), "matrix_parameters": matrices, "repeats": args.repeats,
        "step_ms": {mode: s * 1e3 for mode, s in seconds.items()}, "ratio_to_duplicated": ratios,
        "predicted_ms": {mode: s * 1e3 for mode, s in predicted.items()},
        "auto_modes": dict(auto.tp_modes), "auto_over_fastest_fixed": seconds["auto"] / seconds[fixed],
        "fastest_fixed": fixed, "max_weight_difference_to_duplicated": differences,
    })


if __name__ == "__main__":
    main()
