"""Newton-Schulz on the expert matrices of one MoE layer: one batched call per shape against one
call per matrix, and megatron-core's TensorParallelMuon step.

An MoE layer has many experts of equal shape, so a loop over matrices is bound by per-call
overhead, which batching removes. Shapes: --experts experts, each a gated fc1 (gate and up,
orthogonalized separately) and an fc2; default 64 x (256 -> 704, SwiGLU). Rows, at one precision:
- batched:    our orthogonalize_batched, one call per shape;
- per_matrix: emerging_optimizers' Newton-Schulz on each 2-D block in turn;
- mcore_muon: megatron-core's TensorParallelMuon.step (fc1 whole: same flops within 1 %).
Prints medians and ratios; asserts nothing.

    python benchmarks/moe_experts.py [--experts 64 --hidden 256 --ffn 704] [--device cuda] [--json PATH]
"""

import argparse
from types import SimpleNamespace

import torch


from _timing import interleaved_times, medians, paired_ratio, write_json

from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, orthogonalize_batched
from emerging_optimizers import utils as eo_utils

RATIOS = {"batched / per_matrix": ("batched", "per_matrix"), "batched / mcore_muon": ("batched", "mcore_muon")}


def expert_blocks(experts: int, hidden: int, ffn: int, device: torch.device) -> list[torch.Tensor]:
    """Per expert: gate and up halves of fc1 ([ffn, hidden] each) and fc2 ([hidden, ffn])."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(ffn, hidden), (ffn, hidden), (hidden, ffn)] * experts
    return [torch.randn(s, generator=generator).to(device) for s in shapes]


def mcore_muon_step(experts: int, hidden: int, ffn: int, precision: str, device: torch.device):
    """megatron-core's TensorParallelMuon on the expert weights (fc1 [2 * ffn, hidden], fc2)."""
    from megatron.core.optimizer import OptimizerConfig as McoreConfig
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon as McoreMuon
    from megatron.core.optimizer.emerging_optimizers import _muon_config_to_kwargs

    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(device))
              for _ in range(experts) for s in ((2 * ffn, hidden), (hidden, ffn))]
    for p in params:
        p.is_qkv = False  # what its factory's is_qkv_fn reads
        p.grad = torch.randn_like(p)
    # Its factory reads the model config only for the QKV split, which no expert weight has.
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=1, num_query_groups=1, kv_channels=1))
    kwargs = _muon_config_to_kwargs(McoreConfig(optimizer="muon", lr=1e-3), [model], None)
    return McoreMuon(params, **{**kwargs, "fp32_matmul_prec": precision}).step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--precision", default="highest", choices=["highest", "high", "medium"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    for name in ("experts", "hidden", "ffn", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}.")
    device = torch.device(args.device)
    blocks = expert_blocks(args.experts, args.hidden, args.ffn, device)
    settings, ones = NewtonSchulzSettings(), [1.0] * len(blocks)
    steps = {
        "batched": lambda: orthogonalize_batched(blocks, ones, settings),
        "per_matrix": lambda: [settings.orthogonalize(b) for b in blocks],  # 2-D calls, as a per-parameter loop
        "mcore_muon": mcore_muon_step(args.experts, args.hidden, args.ffn, args.precision, device),
    }
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with eo_utils.fp32_matmul_precision(args.precision):
        times = interleaved_times(steps, {name: (lambda: None) for name in steps}, args.warmup, args.repeats,
                                  before=sync, after=sync)
    seconds, ratios = medians(times), {name: paired_ratio(times, a, b) for name, (a, b) in RATIOS.items()}
    print(f"{args.experts} experts of {args.hidden} -> {args.ffn} (SwiGLU): {len(blocks)} blocks, {args.device}, "
          f"precision '{args.precision}', torch {torch.__version__}, median of {args.repeats} rounds")
    for row, s in seconds.items():
        print(f"  {row:12} {s * 1e3:10.1f} ms")
    for name, ratio in ratios.items():
        print(f"  ratio {name:24} {ratio:.3f}")
    write_json(args.json, {"experts": args.experts, "hidden": args.hidden, "ffn": args.ffn, "device": args.device,
                           "precision": args.precision, "repeats": args.repeats,
                           "step_ms": {row: s * 1e3 for row, s in seconds.items()}, "ratios": ratios})


if __name__ == "__main__":
    main()
