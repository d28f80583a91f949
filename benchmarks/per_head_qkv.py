"""Per-head orthogonalization of linear_qkv: Muon step time and FLOPs against the per-group split.

The `--layers` linear_qkv weights of a GQA GPT (hidden h, `--heads` heads in `--groups` query
groups, kv_channels = h / heads), stepped by TensorParallelMuon with the default q/k/v split
(q of all groups, k, v: three matrices) and with the per-head split (`muon_split_qkv_per_head`:
one kv_channels x h matrix per q, k and v head, all in one batched call). FLOPs are the matmul
FLOPs of Newton-Schulz per step (ops/gram_newton_schulz.py's `standard_flops`).

    python benchmarks/per_head_qkv.py [--hidden 1024] [--layers 2] [--device cuda] [--json PATH]

fp32_matmul_prec as --precision says ('highest' by default). Median of interleaved steps.
Prints numbers; asserts nothing.
"""

import argparse

import torch
from _gpt import GptShape, add_shape_arguments, shape_from
from _timing import interleaved_times, medians, paired_ratio, write_json

from megatron_eopt.ops.gram_newton_schulz import standard_flops
from megatron_eopt.ops.splits import MatrixLayout, qkv_row_blocks
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

STEPS = 5
SPLITS = ("per_group", "per_head")


def layouts(shape: GptShape, per_head: bool) -> dict[str, MatrixLayout]:
    groups, blocks = qkv_row_blocks(shape.model_config(), 1, "linear_qkv.weight")
    rows = groups * sum(blocks)
    return {f"layer{i}.linear_qkv.weight": MatrixLayout(f"layer{i}.linear_qkv.weight", (rows, shape.hidden), 0, 1,
                                                        groups, blocks, head_rows=blocks[-1] if per_head else 0)
            for i in range(shape.layers)}


def flops(layout_of: dict[str, MatrixLayout]) -> int:
    return sum(standard_flops(min(s), max(s), STEPS) for layout in layout_of.values()
               for s in layout.global_block_shapes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape(hidden=1024, layers=2, heads=16, groups=4))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="highest", choices=("highest", "high", "medium"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    shape, device = shape_from(args), torch.device(args.device)
    torch.manual_seed(0)
    layout_of = {split: layouts(shape, split == "per_head") for split in SPLITS}
    names = list(layout_of["per_group"])
    weights = [torch.randn(layout_of["per_group"][n].local_shape, device=device) * 0.02 for n in names]
    grads = [torch.randn_like(w) for w in weights]
    params = {split: [torch.nn.Parameter(w.clone()) for w in weights] for split in SPLITS}
    steps = {split: TensorParallelMuon([{"params": params[split], "param_fqns": names}], lr=1e-3, weight_decay=0.1,
                                       fp32_matmul_prec=args.precision, layouts=layout_of[split]).step
             for split in SPLITS}

    def prepare(split: str) -> None:
        for p, g in zip(params[split], grads):
            p.grad = g.clone()

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = interleaved_times(steps, {s: (lambda s=s: prepare(s)) for s in SPLITS}, args.warmup, args.repeats,
                              before=sync, after=sync)
    seconds, gflop = medians(times), {s: flops(layout_of[s]) / 1e9 for s in SPLITS}
    ratio = paired_ratio(times, "per_head", "per_group")
    print(f"{args.layers} linear_qkv weights of {shape.describe()}, kv_channels {shape.kv_channels}; "
          f"{device.type}, {torch.get_num_threads()} threads, fp32_matmul_prec {args.precision!r}, torch "
          f"{torch.__version__}, median of {args.repeats} steps")
    for split in SPLITS:
        print(f"{split:10} {gflop[split]:9.2f} GFLOP/step  {seconds[split] * 1e3:9.1f} ms")
    print(f"per_head / per_group: FLOPs {gflop['per_head'] / gflop['per_group']:.3f}, step time {ratio:.3f}")
    write_json(args.json, {
        "model": shape.describe(), "device": device.type, "precision": args.precision, "repeats": args.repeats,
        "gflop_per_step": gflop, "step_ms": {s: t * 1e3 for s, t in seconds.items()},
        "flop_ratio": gflop["per_head"] / gflop["per_group"], "step_ratio": ratio,
    })


if __name__ == "__main__":
    main()
