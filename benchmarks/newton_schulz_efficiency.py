"""Achieved flop rate of our Newton-Schulz orthogonalization over that of one large matrix product.

The matrices are the blocks TensorParallelMuon orthogonalizes for a GPT model (q, k, v of
every query group, proj, fc1 gate and up, fc2), grouped by shape as the optimizer groups them
(one batched newton_schulz call per shape). Flops per matrix: steps x (4 m n k + 2 k^3), k =
min(m, n) (X X^T, then A A, then B X). The reference is one n x n matrix product in the dtype
Newton-Schulz computes in ('highest': fp32; 'medium': bf16, as emerging_optimizers casts).
The reference is timed just before each shape group in every round, so a ratio compares
neighbours in time (the machine may be shared); the ratio reported is the median over rounds.

    python benchmarks/newton_schulz_efficiency.py [--device cuda --precision medium] [--json PATH]
"""

import argparse
import statistics
import time

import torch


from _gpt import GptShape, add_shape_arguments, gpt_weight_shapes, matrix_layout, shape_from
from _timing import write_json
from emerging_optimizers import utils as eo_utils

from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, orthogonalize_batched

def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    k, n = min(rows, cols), max(rows, cols)
    return steps * (4 * n * k * k + 2 * k**3)


def block_shapes(shape: GptShape) -> dict[tuple[int, int], int]:
    """(rows, cols) -> count of the blocks the optimizer orthogonalizes (TP=1)."""
    counts: dict[tuple[int, int], int] = {}
    for name, size in gpt_weight_shapes(shape, norms=False).items():
        for block in matrix_layout(name, size, 1, shape).global_block_shapes():
            counts[block] = counts.get(block, 0) + 1
    return counts


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure(args, shape: GptShape, device: torch.device) -> dict[str, list[dict[str, float]]]:
    """Per round and shape group: (seconds, reference matmul seconds timed just before it)."""
    settings = NewtonSchulzSettings()
    dtype = torch.bfloat16 if args.precision == "medium" else torch.float32
    a, b = (torch.randn(args.reference_size, args.reference_size, device=device, dtype=dtype) for _ in range(2))
    batches = {f"{s[0]}x{s[1]}": [torch.randn(s, device=device) for _ in range(count)]
               for s, count in block_shapes(shape).items()}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # On a GPU one product takes a fraction of a millisecond, so a single one timed by the host
    # clock measures launch and synchronisation too: time ten back to back.
    reference_repeats = 10 if device.type == "cuda" else 1
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in batches}
    with eo_utils.fp32_matmul_precision(args.precision):
        for index in range(args.warmup + args.repeats):
            for name, matrices in batches.items():
                reference = timed(lambda: [a @ b for _ in range(reference_repeats)], sync) / reference_repeats
                seconds = timed(lambda: orthogonalize_batched(matrices, [1.0] * len(matrices), settings), sync)
                if index >= args.warmup:
                    rounds[name].append({"s": seconds, "reference_s": reference})
    return rounds


def summarize(rounds: dict, shape: GptShape, reference_size: int) -> dict:
    """Per shape group and in total: GFLOP, median ms, GFLOP/s and rate / neighbouring matmul rate."""
    reference_flops = 2 * reference_size**3
    flops = {f"{s[0]}x{s[1]}": c * newton_schulz_flops(*s, 5) for s, c in block_shapes(shape).items()}
    count = len(next(iter(rounds.values())))
    per_round = {name: [(flops[name], r["s"], r["reference_s"]) for r in rows] for name, rows in rounds.items()}
    # Total: all groups of a round together, against that round's mean reference time.
    per_round["total"] = [(sum(flops.values()), sum(rounds[n][i]["s"] for n in rounds),
                           statistics.mean(rounds[n][i]["reference_s"] for n in rounds)) for i in range(count)]
    return {
        "reference_gflops": statistics.median(reference_flops / r["reference_s"]
                                              for rows in rounds.values() for r in rows) / 1e9,
        "rows": {name: {"gflop": rows[0][0] / 1e9, "ms": statistics.median(s for _, s, _ in rows) * 1e3,
                        "gflops": statistics.median(f / s for f, s, _ in rows) / 1e9,
                        "ratio": statistics.median((f / s) / (reference_flops / ref) for f, s, ref in rows)}
                 for name, rows in per_round.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape(hidden=1024, layers=2))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="highest", choices=("highest", "medium"),
                        help="fp32_matmul_prec: 'highest' fp32, 'medium' bf16 Newton-Schulz")
    parser.add_argument("--reference-size", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    shape, device = shape_from(args), torch.device(args.device)
    summary = summarize(measure(args, shape, device), shape, args.reference_size)
    dtype = "bf16" if args.precision == "medium" else "fp32"
    print(f"Newton-Schulz ({dtype}, 5 quintic steps) on the blocks of a GPT model ({shape.describe()}), "
          f"{device.type}, {torch.get_num_threads()} threads, median of {args.repeats} rounds")
    print(f"  reference {args.reference_size}^3 {dtype} matmul: {summary['reference_gflops']:.1f} GFLOP/s")
    print(f"  {'shape (count)':18} {'GFLOP':>8} {'ms':>9} {'GFLOP/s':>9} {'/ matmul':>9}")
    counts = {f"{s[0]}x{s[1]}": c for s, c in block_shapes(shape).items()}
    for name, row in summary["rows"].items():
        label = f"{name} ({counts[name]})" if name in counts else name
        print(f"  {label:18} {row['gflop']:8.1f} {row['ms']:9.1f} {row['gflops']:9.1f} {row['ratio']:9.3f}")
    write_json(args.json, {"model": shape.describe(), "device": device.type, "dtype": dtype,
                           "threads": torch.get_num_threads(), "reference_size": args.reference_size,
                           "repeats": args.repeats, **summary})


if __name__ == "__main__":
    main()
